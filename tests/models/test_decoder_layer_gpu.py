"""Decoder-layer fusion on the GPU (``pytest -m gpu``): a small bf16 Llama whose layers take the
fused path (norm prologues, residual epilogues; split-K forced for its small GEMMs, which the
table leaves to other backends), eagerly and under ``torch.compile(fullgraph=True)``, with
logits as close to the fp32 model's as stock bf16's are.
"""

from __future__ import annotations

import pytest
import torch

from helpers import llama_variants
from hybridgemm import dispatch
from hybridgemm.kernels import triton_splitk

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 512
SPLITK = triton_splitk.TritonSplitKConfig(16, 64, 64, split_k=2, num_warps=4, num_stages=3, fused_reduce=True)


def _rel(a, ref) -> float:
    return float((a.float() - ref).norm() / ref.norm())


@pytest.fixture
def models(monkeypatch):
    ref, stock, patched = llama_variants(256, 704, VOCAB)
    calls = []
    real = triton_splitk.run

    def run(cfg, *a, norm=None, residual=None, **kw):
        calls.append("norm" if norm is not None else "residual" if residual is not None else "plain")
        return real(cfg, *a, norm=norm, residual=residual, **kw)

    monkeypatch.setattr(dispatch, "splitk_config", lambda *a: SPLITK)
    # the norm prologue fused whatever the config: its numerics on the GPU (where the rule fuses
    # it only in one config shape, triton_splitk.prologue_fits)
    monkeypatch.setattr(triton_splitk, "prologue_fits", lambda config, itemsize: True)
    monkeypatch.setattr(triton_splitk, "run", run)
    return ref, stock, patched, calls


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5)])
def test_fused_layers_logits(models, compiled, shape):
    ref, stock, patched, calls = models
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(sum(shape))).cuda()
    run = torch.compile(patched, fullgraph=True) if compiled else patched
    with torch.no_grad():
        want = ref(ids).logits
        got = run(ids).logits
        base = stock(ids).logits
    assert calls.count("norm") == 2 and calls.count("residual") == 4, calls
    assert _rel(got, want) <= 1.5 * _rel(base, want) + 1e-3, (_rel(got, want), _rel(base, want))
    torch._dynamo.reset()
