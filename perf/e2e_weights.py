"""The models of an FP8 end-to-end run (perf/bench_e2e.py ``--weights fp8``) besides the stock
one: the dequantized references and the torchao peers.

Dequantized weights: each projection that ``patch(weights="fp8")`` quantized
(``report.fp8``), dequantized from its e4m3 data and scales (kernels/fp8.dequantize: the
product in fp32, rounded once to the dtype asked for), under the stock model's parameter names
(a fused Q/K/V or gate/up weight split back into its parts; an experts module's stacked
``gate_up_proj`` and ``down_proj`` as they are). :func:`dequantized_model` builds a
plain (unpatched) model of the stock weights with those in place: in fp32 it is the reference
the FP8 kernels are measured against; in bf16 it computes what dequantize -> bf16 ``F.linear``
computes.

Peers: torchao's weight-only quantizations (:data:`PEERS`: ``Float8WeightOnlyConfig``, e4m3
per output row; ``Int8WeightOnlyConfig``, int8 per output row), each applied by
``torchao.quantization.quantize_`` to a fresh bf16 copy of the stock model, to the same
projections hybridgemm quantizes (the LM head only with ``quantize_lm_head``). The configs
are made with ``set_inductor_config=False``: torchao would otherwise set process-wide Inductor
options (coordinate-descent tuning and others) that every compiled variant of the run would
then compile under. torchao is optional (``pip install 'hybridgemm[bench]'``); without it
:func:`torchao_version` is None and there are no peers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from hybridgemm.fp8_experts import PROJECTIONS, HybridFP8Experts
from hybridgemm.fp8_modules import FP8FusedLinears, weight_scale_of
from hybridgemm.fused_rows import qual
from hybridgemm.kernels import fp8
from hybridgemm.perf import e2e_models as hf

# variant name: (torchao config class, the weights column of its rows)
PEERS = {
    "torchao_float8_weight_only": ("Float8WeightOnlyConfig", "e4m3_channel"),
    "torchao_int8_weight_only": ("Int8WeightOnlyConfig", "int8_channel"),
}


def torchao_version() -> str | None:
    """The installed torchao's version, or None where it cannot be imported."""
    try:
        import torchao
    except ImportError:
        return None
    return getattr(torchao, "__version__", "unknown")


def dequantized_weights(model: nn.Module, names: list[str], dtype: torch.dtype):
    """``(stock parameter name, dequantized weight in dtype)`` for each FP8 module of ``model``
    named in ``names`` (``report.fp8``), one at a time (a whole model's worth is never held)."""
    for name in names:
        mod = model.get_submodule(name)
        if isinstance(mod, HybridFP8Experts):
            for proj, w in zip(PROJECTIONS, mod.expert_weights(dtype)):
                yield qual(name, proj), w.dequantize(dtype)
            continue
        w = fp8.dequantize(mod.weight, weight_scale_of(mod), dtype)
        if isinstance(mod, FP8FusedLinears):
            parent = name.rpartition(".")[0]
            for part, rows in zip(mod.names, w.split(mod.sizes)):
                yield qual(qual(parent, part), "weight"), rows
        else:
            yield qual(name, "weight"), w


def dequantized_model(config, stock: nn.Module, patched: nn.Module, names: list[str], dtype: torch.dtype,
                      device) -> nn.Module:
    """A plain model of ``config`` in ``dtype``: ``stock``'s weights, with each projection in
    ``names`` replaced by ``patched``'s dequantized FP8 weight (see the module docstring)."""
    model = hf.build_model(config, dtype, device)
    model.load_state_dict(stock.state_dict())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, w in dequantized_weights(patched, names, dtype):
            if key not in params or params[key].shape != w.shape:
                raise ValueError(f"dequantized_model: {key} {tuple(w.shape)} has no parameter of that shape in the "
                                 "stock model")
            params[key].copy_(w)
    return model


def peer_config(variant: str):
    """The torchao config of peer ``variant`` (:data:`PEERS`), ``set_inductor_config=False``
    where the installed version has that field."""
    from torchao import quantization

    cls = getattr(quantization, PEERS[variant][0])
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return cls(set_inductor_config=False) if "set_inductor_config" in fields else cls()


def peer_model(config, stock: nn.Module, variant: str, quantize_lm_head: bool, device) -> nn.Module:
    """A fresh bf16 copy of ``stock`` (its state dict) quantized by torchao as peer
    ``variant``: every ``nn.Linear`` but the LM head (unless ``quantize_lm_head``)."""
    from torchao.quantization import quantize_

    model = hf.build_model(config, next(stock.parameters()).dtype, device)
    model.load_state_dict(stock.state_dict())
    head = model.get_output_embeddings()

    def wanted(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and (quantize_lm_head or mod is not head)

    quantize_(model, peer_config(variant), filter_fn=wanted)
    return model


def peer_models(config, stock: nn.Module, quantize_lm_head: bool, device, log: Callable[[str], None]) -> dict:
    """Every peer of :data:`PEERS` (variant: model, or the exception that kept it from being
    built); none without torchao, which ``log`` is told once."""
    version = torchao_version()
    if version is None:
        log("torchao is not installed: no torchao peer rows (pip install 'hybridgemm[bench]')")
        return {}
    peers = {}
    for variant, (config_name, _) in PEERS.items():
        try:
            peers[variant] = peer_model(config, stock, variant, quantize_lm_head, device)
            log(f"{variant}: torchao {version} {config_name}")
        except Exception as e:  # noqa: BLE001 (its rows record it; the run goes on)
            peers[variant] = e.with_traceback(None)
            log(f"{variant} failed: {type(e).__name__}: {e}")
    return peers
