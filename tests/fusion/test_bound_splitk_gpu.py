"""Eager fused split-K calls launched from their bound signature (fusion/dispatch.py
``_bound_key``, kernels/triton_splitk.py ``bind``): from the second call of a signature on, the
launch bound at the first, with the call's own pointers. The same bits as the general path on
the same operands and close to an fp32 reference, with the norm prologue, the residual (scaled
too, and a second one after it) and each way of splitting K (one split, the fused reduction,
the two-launch reduction); a changed signature, autograd and a table reload take the general
path."""

from __future__ import annotations

import pytest
import torch

from hybridgemm import decide, dispatch
from hybridgemm.kernels import triton_splitk

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
N, K, EPS, SCALE = 330, 200, 1e-5, 0.22  # N, K not multiples of 64
CONFIGS = {
    "one_split": triton_splitk.TritonSplitKConfig(16, 64, 64, split_k=1, num_warps=4, num_stages=3),
    "fused_reduce": triton_splitk.TritonSplitKConfig(16, 64, 64, split_k=2, num_warps=4, num_stages=3,
                                                     fused_reduce=True),
    "two_launches": triton_splitk.TritonSplitKConfig(16, 32, 32, split_k=3, num_warps=4, num_stages=2),
}
FUSIONS = ("none", "residual", "scaled_residual", "norm", "norm_residual", "two_residuals")


@pytest.fixture
def runs(monkeypatch):
    """The pinned config's general-path runs, counted (those with a residual apart too)."""
    state = {"config": CONFIGS["one_split"], "runs": 0, "residual": 0}
    real = triton_splitk.run

    def run(*a, **kw):
        state["runs"] += 1
        state["residual"] += kw.get("residual") is not None
        return real(*a, **kw)

    monkeypatch.setattr(dispatch, "splitk_config", lambda *a, **kw: state["config"])
    monkeypatch.setattr(triton_splitk, "run", run)
    return state


def _operands(m: int):
    return torch.randn(m, 1, K, device="cuda", dtype=BF16), torch.randn(m, 1, N, device="cuda", dtype=BF16)


def _call(x, w, b, g, r, fusion: str):
    kw = {}
    if "residual" in fusion:
        kw["residual"] = r
        if fusion.startswith("scaled"):
            kw["residual_scale"] = SCALE
        if fusion == "two_residuals":  # (a tensor of its own per call: at another address each time)
            kw["residual2"] = _second_residual(r)
    if "norm" in fusion:
        kw["norm"] = (g, EPS, None)
    return dispatch.fused_splitk(x, w, b, keep_prologue=True, **kw)


def _second_residual(r: torch.Tensor) -> torch.Tensor:
    return r * 7 + 1


def _reference(x, w, b, g, r, fusion: str) -> torch.Tensor:
    x = x.float()
    if "norm" in fusion:  # Llama's RMSNorm: normalised in fp32, rounded, times the weight
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(BF16).float() * g.float()
    y = x @ w.float().T + b.float()
    if "residual" in fusion:
        y = r.float() + y * (SCALE if fusion.startswith("scaled") else 1.0)
    if fusion == "two_residuals":
        y = y + _second_residual(r).float()
    return y


def _poison_allocator(m: int) -> None:
    """Leave a freed block of NaNs of the output's size where the next allocation takes it."""
    torch.full((m, 1, N), float("nan"), device="cuda", dtype=BF16)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_bound_launch_computes_what_the_general_path_does(runs, config, fusion, m):
    runs["config"] = CONFIGS[config]
    w = torch.randn(N, K, device="cuda", dtype=BF16) / K**0.5
    b, g = torch.randn(N, device="cuda", dtype=BF16), 1 + 0.1 * torch.randn(K, device="cuda", dtype=BF16)
    with torch.no_grad():
        first = _operands(m)
        assert _call(first[0], w, b, g, first[1], fusion) is not None and runs["runs"] == 1
        x, r = _operands(m)  # fresh data at other addresses: the bound launch must take these
        _poison_allocator(m)
        got = _call(x, w, b, g, r, fusion)
        assert runs["runs"] == 1  # launched bound, not through run
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "_bound_key", lambda *a: None)
            want = _call(x, w, b, g, r, fusion)
        assert runs["runs"] == 2
    assert got.shape == (m, 1, N) and torch.equal(got, want)
    ref = _reference(x, w, b, g, r, fusion)
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2


def test_a_changed_signature_takes_the_general_path(runs):
    w = torch.randn(N, K, device="cuda", dtype=BF16) / K**0.5
    b, g = torch.randn(N, device="cuda", dtype=BF16), 1 + 0.1 * torch.randn(K, device="cuda", dtype=BF16)
    x, r = _operands(3)
    with torch.no_grad():
        for _ in range(2):
            _call(x, w, b, None, r, "residual")
        assert runs["runs"] == 1
        _call(*_operands(5)[:1], w, b, None, _operands(5)[1], "residual")  # another M
        assert runs["runs"] == 2
        _call(x, w.clone(), b, None, r, "residual")  # the same values elsewhere: a weight replaced
        assert runs["runs"] == 3
        shifted = torch.empty(3 * N + 1, device="cuda", dtype=BF16)[1:].view(3, 1, N).copy_(r)
        y = _call(x, w, b, None, shifted, "residual")  # the residual's alignment class
        assert runs["runs"] == 4
        assert torch.equal(y, _call(x, w, b, None, r, "residual")) and runs["runs"] == 4
        _call(x, w, b, None, r, "scaled_residual")  # a scale
        assert runs["runs"] == 5
        strided = torch.randn(3, 1, 2 * K, device="cuda", dtype=BF16)[..., :K]
        for _ in range(2):  # x's rows padded (not contiguous): the general path at every call
            assert torch.equal(_call(strided, w, b, None, r, "residual"),
                               _call(strided.contiguous(), w, b, None, r, "residual"))
        assert runs["runs"] == 7
        _call(x, w, b.clone(), None, r, "residual")  # another bias
        assert runs["runs"] == 8
        odd_bias = torch.empty(N + 1, device="cuda", dtype=BF16)[1:].copy_(b)
        for _ in range(2):  # a bias off 16-byte alignment (the general path aligns a copy): never bound
            assert torch.equal(_call(x, w, odd_bias, None, r, "residual"), _call(x, w, b, None, r, "residual"))
        assert runs["runs"] == 10
        for _ in range(2):
            _call(x, w, b, g, r, "norm")
        _call(x, w, b, g.clone(), r, "norm")  # another norm weight
        dispatch.fused_splitk(x, w, b, keep_prologue=True, norm=(g, EPS / 10, None))  # another eps
        assert runs["runs"] == 13
        with pytest.MonkeyPatch.context() as mp:  # the norm taken apart from the GEMM: never bound
            mp.setattr(triton_splitk, "prologue_fits", lambda config, itemsize: False)
            for _ in range(2):
                dispatch.fused_splitk(x, w, b, keep_prologue=False, norm=(g, EPS, None))
        assert runs["runs"] == 15
    wg = w.clone().requires_grad_()
    for _ in range(2):  # autograd wanted: the general path at every call
        _call(x, wg, b, None, r, "residual")
    assert runs["runs"] == 17
    with torch.no_grad():
        _call(x, w, b, None, r, "residual")
        assert runs["runs"] == 17
        decide.reload_tables()  # cached decisions dropped: so are the bound launches
        _call(x, w, b, None, r, "residual")
        assert runs["runs"] == 18


def test_a_patched_model_decodes_the_same_bits_with_bound_launches(runs):
    """Eager static-cache decode of a small patched Llama (the pinned config): the same logits
    with and without bound launches; its O and down with their residuals launch bound at every
    decode step after the first."""
    from helpers import llama_variants, static_decode

    runs["config"] = CONFIGS["fused_reduce"]
    _, _, patched = llama_variants(256, 704, 512)
    tokens = [torch.randint(0, 512, (2, 1), generator=torch.Generator().manual_seed(i)).cuda() for i in range(6)]
    with torch.no_grad():
        bound, _ = static_decode(patched, tokens, False, 512)
        bound_runs, runs["residual"] = runs["residual"], 0
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "_bound_key", lambda *a: None)
            general, _ = static_decode(patched, tokens, False, 512)
    assert torch.equal(bound, general)
    # O and down with their residuals, two layers: every decode step after the first launched bound
    assert runs["residual"] - bound_runs == 4 * (len(tokens) - 1), (bound_runs, runs["residual"])
