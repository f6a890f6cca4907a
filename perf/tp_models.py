"""How each rank of perf/bench_tp.py builds its model: its part of one full random model, the
same whatever the variant's sharding, and torch's own tensor-parallel plan for the stock
baseline.

The models: a config of the real model's sizes (perf/e2e_models.py, ``layers`` shortening it)
or ``tiny``, a 2-layer Llama-layout model with attention biases (:data:`TINY`), for tests and
CPU runs. :func:`build` makes each variant of :data:`VARIANTS` (perf/bench_tp.py's docstring
says what each one times): ``tp1_hybridgemm`` whole, ``tp2_hybridgemm`` sharded by
``hybridgemm.parallelize`` (``tp2_hybridgemm_push`` the same with the push one-shot kernel,
``tp2_hybridgemm_nccl`` with every sum on NCCL), all then
``hybridgemm.patch``-ed, and ``tp2_stock`` sharded by
torch's own plan (:func:`shard_stock`): ``ColwiseParallel`` for q/k/v/gate/up,
``RowwiseParallel`` for o/down, the LM head colwise with its logits gathered
(``output_layouts=Replicate()``), over a 1-D ``DeviceMesh``; each attention module's
head-count attributes set to the local counts, as torch's tensor-parallel tutorial does.

How the model is built, so that a 70B shard never needs the whole model in memory:
``hf.build_model`` on the ``meta`` device (no storage), sharded there (``parallelize`` cuts
meta tensors; ``parallelize_module`` makes meta DTensors), then ``to_empty`` allocates only
this rank's shards on the device and :func:`fill` writes them, one decoder layer at a time:
each parameter's full tensor is drawn from a generator seeded by the parameter's name
(:func:`weight_value`; normal, std = the config's ``initializer_range``, norm weights around
1, biases drawn too so that a bias added on the wrong rank shows in the logits), rounded to
bf16, and this rank's part taken from it (``hybridgemm.parallel.load_full_state_dict`` for the
hybridgemm variants, ``distribute_tensor(src_data_rank=None)`` for DTensors). Every variant on
every rank therefore holds its part of one and the same full model, whatever its sharding.
Peak memory per GPU: the shard, plus one full parameter in fp32 (the 70B embedding: 4.2 GB).
Non-persistent buffers (RoPE's inverse frequencies) come from a 1-layer copy of the model
built on the device (:func:`fill_buffers`). ``hybridgemm.patch`` runs after the weights are
written (it concatenates q/k/v and gate/up, which needs their values).

The logits reference (:func:`fp32_reference`) is an fp32 copy of the same full model, filled
the same way with the bf16 values; :func:`full_bytes` and :func:`fits` say whether a whole
model fits one GPU.
"""

from __future__ import annotations

import copy
import math
import re
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

import hybridgemm
from hybridgemm.parallel import load_full_state_dict
from hybridgemm.parallel.collectives import ONE_SHOT_MAX_BYTES
from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf.tp_ranks import Ranks

VARIANTS = {"tp1_hybridgemm": 1, "tp2_hybridgemm": 2, "tp2_hybridgemm_push": 2, "tp2_hybridgemm_nccl": 2,
            "tp2_stock": 2}  # name: ranks
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=False,
            attention_bias=True, mlp_bias=False)


# Families whose checkpoint holds Q/K/V (and gate/up) as one linear: the tensor-parallel plan
# splits separate q/k/v and gate/up projections by heads and rows, not such a stacked one.
_PREFUSED_FAMILIES = ("phi3", "phi4", "glm", "glm4")


def model_names() -> list[str]:
    """The dense models (torch's plan and ``parallelize`` split gate/up/down; a mixture of
    experts' experts would stay whole on every rank) with separate q/k/v, and ``tiny``."""
    return [*(n for n in hf.dense_model_names() if hf.SIZES[n].family not in _PREFUSED_FAMILIES), "tiny"]


def model_config(name: str, layers: int | None = None):
    """The transformers config of ``name`` (:func:`hf.hf_config`; ``tiny``: :data:`TINY`)."""
    if name != "tiny":
        return hf.hf_config(name, layers)
    import transformers

    return transformers.LlamaConfig(**{**TINY, "num_hidden_layers": layers or TINY["num_hidden_layers"]})


def weight_value(name: str, shape, config, device, dtype: torch.dtype, round_to: torch.dtype, norm: bool,
                 seed: int = E.SEED) -> torch.Tensor:
    """The full tensor of parameter ``name`` of the benchmark's model: the same on every rank
    and for every variant (a generator seeded by ``seed`` and the name), normal with std
    ``config.initializer_range`` (1 + that for a norm's weight), rounded to ``round_to`` (the
    benchmark's dtype, so an fp32 copy holds the bf16 model's values), in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    t = torch.randn(tuple(shape), generator=gen, device=device).mul_(getattr(config, "initializer_range", 0.02))
    return (t.add_(1) if norm else t).to(round_to).to(dtype)


def _layer_chunks(names) -> dict[str, list[str]]:
    """Parameter names by the module that :func:`fill` loads them through: the module of their
    first numbered path component (a decoder layer), the root ("") for the rest."""
    out: dict[str, list[str]] = {}
    for n in names:
        m = re.match(r"(.*?\.\d+)\.", n)
        out.setdefault(m.group(1) if m else "", []).append(n)
    return out


def fill_buffers(model: nn.Module, config, dtype: torch.dtype, device) -> None:
    """Give ``model`` (built on the meta device, then ``to_empty``) its non-persistent buffers
    (RoPE tables, which no state dict holds): copied from a 1-layer model of ``config`` built on
    ``device`` (a buffer of layer i from that model's layer 0)."""
    names = [n for n, _ in model.named_buffers()]
    if not names:
        return
    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    donor = dict(hf.build_model(small, dtype, device).named_buffers())
    with torch.no_grad():
        for n, buf in model.named_buffers():
            src = donor.get(re.sub(r"\.\d+\.", ".0.", n, count=1))
            if src is None or src.shape != buf.shape:
                raise RuntimeError(f"bench_tp: cannot initialise the buffer {n} (not in a 1-layer model of the config)")
            buf.copy_(src)
    del donor
    E._free(device)


def fill(model: nn.Module, shapes: dict, norms: set, config, device, dtype: torch.dtype, round_to: torch.dtype) -> None:
    """Allocate ``model``'s (local) parameters on ``device`` and write this rank's part of each
    full tensor (:func:`weight_value`; ``shapes``: the full shapes, ``norms``: the norm weights),
    one decoder layer at a time. A plain parameter is cut by the rule ``parallelize`` recorded
    (:func:`hybridgemm.parallel.load_full_state_dict`; an unsharded one loads whole), a DTensor
    gets its placements' shard of the full tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    fill_buffers(model, config, dtype, device)
    with torch.no_grad():
        for prefix, names in _layer_chunks(shapes).items():
            module = model.get_submodule(prefix)
            cut = len(prefix) + 1 if prefix else 0
            params = dict(module.named_parameters())
            full = {}
            for n in names:
                value = weight_value(n, shapes[n], config, device, dtype, round_to, n in norms)
                p = params[n[cut:]]
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                                       .to_local())
                else:
                    full[n[cut:]] = value
            loaded = load_full_state_dict(module, full, strict=False)
            if loaded.unexpected_keys:
                raise RuntimeError(f"bench_tp: parameters not in the model: {loaded.unexpected_keys[:4]}")
            del full


def gpu_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads on this GPU: every parameter's local part (a
    DTensor's shard) once, the input embedding table left out unless the LM head is tied to it
    (as :func:`hf.decode_weight_bytes` counts a whole model)."""
    from torch.distributed.tensor import DTensor

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = emb.weight if emb is not None and not (head is not None and head.weight is emb.weight) else None
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p is not skip)
    return sum(t.numel() * t.element_size() for t in local)


def shard_stock(model: nn.Module, mesh, tp: int) -> list[str]:
    """Shard ``model`` in place with ``torch.distributed.tensor.parallel`` over the 1-D ``mesh``
    (see the module docstring); returns notes. ``NotImplementedError`` (the variant is then
    skipped) for a model this plan does not fit: not the ``model.layers[i].self_attn/.mlp``
    layout, or head counts ``tp`` does not divide (colwise sharding would cut a head)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or kv_heads % tp:
        raise NotImplementedError(f"torch's colwise split needs tp={tp} to divide the {heads} query and {kv_heads} "
                                  "key/value heads")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__} has no model.layers: not the Llama/Qwen2 layout")
    plan = {**{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    width = heads * head_dim
    local = {"num_heads": (heads, heads // tp), "num_attention_heads": (heads, heads // tp),
             "num_key_value_heads": (kv_heads, kv_heads // tp), "hidden_size": (width, width // tp)}
    for layer in layers:
        parallelize_module(layer, mesh, plan)
        for attr, (whole, part) in local.items():  # what this transformers version keeps on the module
            if layer.self_attn.__dict__.get(attr) == whole:
                setattr(layer.self_attn, attr, part)
    if getattr(config, "tie_word_embeddings", False):
        return ["lm_head tied to the input embedding: left whole on every rank"]
    try:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    except Exception as e:  # noqa: BLE001 (the head then runs whole on every rank, which the note says)
        return [f"lm_head left whole ({type(e).__name__}: {e})"[:300]]
    model.lm_head.register_forward_hook(_wait_for_gather)
    return []


def _wait_for_gather(module, args, out):
    """The gathered logits, waited for: eager DTensor returns them as an AsyncCollectiveTensor
    whose gather is only waited for when something reads it, and the prefill mode reads nothing,
    which would leave the gather out of the time (hybridgemm's all_gather is waited for in the
    forward). Under torch.compile the output is a plain traced tensor, returned as it is."""
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


@dataclass
class Built:
    model: nn.Module
    weight_bytes: int  # read per decode step on this GPU
    notes: list[str] = field(default_factory=list)


def meta_model(run: E.Run, dtype: torch.dtype) -> tuple[nn.Module, dict, set]:
    """The model of ``run`` on the meta device, its full parameter shapes and its norm weights."""
    model = hf.build_model(run.config, dtype, "meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    norms = {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if "Norm" in type(m).__name__
             for pn, _ in m.named_parameters(recurse=False)}
    return model, shapes, norms


def build(run: E.Run, variant: str, ranks: Ranks) -> Built:
    """``variant``'s model on this rank (see the module docstring)."""
    model, shapes, norms = meta_model(run, run.dtype)
    notes = []
    if variant.startswith("tp2_hybridgemm"):
        one_shot = 0 if variant.endswith("_nccl") else ONE_SHOT_MAX_BYTES
        kernel = "push" if variant.endswith("_push") else "torch"
        report = hybridgemm.parallelize(model, ranks.group, patch=False, one_shot_bytes=one_shot,
                                        one_shot_kernel=kernel)
        run.log(report.summary())
        notes += [f"left whole: {n}: {why}" for n, why in report.skipped]
    elif variant == "tp2_stock":
        notes += shard_stock(model, ranks.mesh(run.device), VARIANTS[variant])
    fill(model, shapes, norms, run.config, run.device, run.dtype, run.dtype)
    built = Built(model.eval(), gpu_weight_bytes(model), notes)
    if "hybridgemm" in variant:
        run.log(hybridgemm.patch(model).summary())
    return built


def fp32_reference(run: E.Run, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | BaseException]:
    """Per error mode of ``ids`` (mode: tokens, perf/bench_e2e.py's ``ERROR_MODES``), its
    logits by an fp32 copy of the whole model (the bf16 values; TF32 off), or the exception;
    the copy is freed after (bench_e2e's :func:`~hybridgemm.perf.bench_e2e.fp32_error_logits`)."""
    def whole_fp32():
        model, shapes, norms = meta_model(run, torch.float32)
        fill(model, shapes, norms, run.config, run.device, torch.float32, run.dtype)
        return model.eval()

    return E.fp32_error_logits(run, whole_fp32, ids)


def full_bytes(run: E.Run, dtype: torch.dtype) -> int:
    model, shapes, _ = meta_model(run, dtype)
    return sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()


def fits(nbytes: int, device, fraction: float, free: bool = False) -> str | None:
    """None when ``nbytes`` fit in ``fraction`` of the device's total (or ``free``) memory, else
    the figures that say why not. The CPU is not checked."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free_b, total_b = torch.cuda.mem_get_info(device)
    have = free_b if free else total_b
    if nbytes <= fraction * have:
        return None
    return f"{nbytes / 1e9:.1f} GB, above {fraction:.0%} of the GPU's {'free' if free else 'total'} {have / 1e9:.1f} GB"
