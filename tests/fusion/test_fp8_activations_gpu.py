"""W8A8 FP8 projections on the GPU (``pytest -m gpu``; Hopper with cuBLASLt 12.9+): past the
decode rows an FP8 module with ``fp8_activations`` runs cuBLASLt's FP8 GEMM over x quantized to
e4m3 (the result bit for bit that of kernels/cublaslt_fp8.run, against an fp32 computation of
the same quantization as close as bf16 rounding allows); at decode rows it is the W8A16 result
bit for bit; a CUDA graph replays it; in a patched model's prefill every projection runs that GEMM
on its input, and the logits stay near those of an fp32 model that quantizes each
projection's input the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridgemm
from helpers import rel_err, w8a8_reference
from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear
from hybridgemm.kernels import cublaslt_fp8, fp8

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ok, why = cublaslt_fp8.environment()
    if not ok:
        pytest.skip(why)
    return torch.device("cuda")


def fresh_bound_runs(monkeypatch):
    """An empty cache of bound W8A8 launches for this test (keys hold data pointers, which an
    earlier test's freed tensors may have had)."""
    monkeypatch.setattr(cublaslt_fp8, "BOUND_RUNS", type(cublaslt_fp8.BOUND_RUNS)(64, lru=True))


def _llama(cuda):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(cuda, torch.bfloat16).eval()


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("m", [16, 65, 333, 1000])
def test_an_fp8_module_with_fp8_activations(cuda, granularity, m):
    g = torch.Generator(device=cuda).manual_seed(m)
    model = _llama(cuda)
    hybridgemm.patch(model, weights="fp8", granularity=granularity, activations="fp8")
    mod = model.model.layers[0].mlp.down_proj  # (512, 1024)
    assert type(mod) is FP8HybridLinear and mod.fp8_activations
    x = (torch.randn(m, 1024, device=cuda, generator=g) * 2).bfloat16()
    q = fp8.FP8Weight(mod.weight, mod.weight_scale, granularity)
    with torch.no_grad():
        got = mod(x)
        mod.fp8_activations = False
        w8a16 = mod(x)
    if m <= 64:
        assert torch.equal(got, w8a16)
        return
    assert torch.equal(got, cublaslt_fp8.run(x, q.data, q.scale, mod.bias))
    assert rel_err(got, w8a8_reference(x, q, mod.bias)) < 1e-2
    assert not torch.equal(got, w8a16)
    mod.fp8_activations = True
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mod(x)
        graph.replay()
    assert torch.equal(captured, got)


class _W8A8Reference(nn.Module):
    """An fp32 projection as cuBLASLt's FP8 GEMM computes it (helpers.w8a8_reference)."""

    def __init__(self, q: fp8.FP8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.q, self.bias = q, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = w8a8_reference(x.reshape(-1, x.shape[-1]), self.q, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _w8a8_reference_model(stock: nn.Module, granularity: str) -> nn.Module:
    """``stock`` in fp32 with each projection (not the LM head) on its weight quantized to e4m3
    and its input quantized as W8A8 prefill quantizes it."""
    ref = copy.deepcopy(stock).float()
    bf16 = dict(stock.named_modules())
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            parent, _, child = name.rpartition(".")
            src = bf16[name]
            q = fp8.quantize_fp8(src.weight.detach(), granularity)
            bias = None if src.bias is None else src.bias.detach().float()
            setattr(ref.get_submodule(parent), child, _W8A8Reference(q, bias))
    return ref


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_a_patched_llama_prefills_with_fp8_activations(cuda, granularity, monkeypatch):
    stock = _llama(cuda)
    ref = _w8a8_reference_model(stock, granularity)
    w8a16, w8a8 = copy.deepcopy(stock), copy.deepcopy(stock)
    hybridgemm.patch(w8a16, weights="fp8", granularity=granularity)
    hybridgemm.patch(w8a8, weights="fp8", granularity=granularity, activations="fp8")
    assert all(m.fp8_activations for m in w8a8.modules() if isinstance(m, (FP8FusedLinears, FP8HybridLinear)))
    ids = torch.randint(0, 512, (1, 300), device=cuda, generator=torch.Generator(device=cuda).manual_seed(1))
    with torch.no_grad():
        expected, a = ref(ids).logits, w8a16(ids).logits
        calls = []
        real = cublaslt_fp8.run_and_bind

        def run_and_bind(x, w, weight_scale, b, out, act, glu=None):  # each call's operands and result recorded
            out, bound = real(x, w, weight_scale, b, out, act, glu)
            if glu is not None:  # down: its input is the gated product, formed as it is quantized
                gate, up = x.chunk(2, dim=1)
                x = torch.nn.functional.silu(gate) * up
            calls.append((x.clone(), w, weight_scale, b, out.clone()))
            return out, bound

        fresh_bound_runs(monkeypatch)  # (every call of the one forward a first one anyway)
        monkeypatch.setattr(cublaslt_fp8, "run_and_bind", run_and_bind)
        b = w8a8(ids).logits
    # every projection of both layers (Q/K/V, O, gate/up, down) ran the W8A8 GEMM on its 300 rows,
    # each within bf16 rounding of the fp32 product of its input quantized the same way
    assert len(calls) == 8 and all(x.shape[0] == 300 for x, *_ in calls)
    for x, w, scale, bias, out in calls:
        q = fp8.FP8Weight(w, scale, fp8.granularity_of(w, scale), x.dtype)
        assert rel_err(out, w8a8_reference(x, q, bias)) < 1e-2
    assert torch.isfinite(b).all() and not torch.equal(a, b)
    # the logits: the input quantization's rounding is discontinuous, so bf16 rounding upstream
    # moves some inputs across an e4m3 boundary and the W8A8 model lies about as far from the
    # fp32 W8A8 model as the W8A16 one does (measured: 0.98-1.01x); a wrong scale or input
    # would put it far beyond
    assert rel_err(b, expected) < 1.5 * rel_err(a, expected), (rel_err(b, expected), rel_err(a, expected))


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("m", [65, 333, 1000])
def test_the_gated_product_formed_while_quantizing_is_the_composition_bit_for_bit(cuda, granularity, m,
                                                                                  monkeypatch):
    """``linear_fp8_glu`` (a gated MLP's down over its gate/up output): past the decode rows with
    W8A8 the product ``silu(gate) * up`` is formed inside the quantization of x and never
    written; the result equals, bit for bit, down called on the product written first, for
    rows of a wider buffer and 3-D inputs too; at decode rows and without the option it is the
    composition's call (the split-K or dequantized path)."""
    from hybridgemm import fp8_linear

    g = torch.Generator(device=cuda).manual_seed(m)
    k, n = 1376, 520
    q = fp8.quantize_fp8((torch.randn(n, k, device=cuda, generator=g) / k**0.5).bfloat16(), granularity)
    bias = torch.randn(n, device=cuda, generator=g).bfloat16()
    buf = (torch.randn(m, 2 * k + 64, device=cuda, generator=g) * 3).bfloat16()
    buf[:, 0] = -120.0  # SiLU's -0 and a saturating exp
    glu_calls = []
    real = cublaslt_fp8.run_and_bind
    fresh_bound_runs(monkeypatch)  # each call below the first of its signature
    monkeypatch.setattr(cublaslt_fp8, "run_and_bind", lambda *a: glu_calls.append(a[-1]) or real(*a))
    for gu in (buf[:, :2 * k], buf[:, :2 * k].contiguous().view(1, m, 2 * k)):
        gate, up = gu.chunk(2, dim=-1)
        with torch.no_grad():
            for option in (True, False):
                glu_calls.clear()
                got = fp8_linear.linear_fp8_glu(gu, q.data, q.scale, bias, "silu", option)
                want = fp8_linear.linear_fp8(torch.nn.functional.silu(gate) * up, q.data, q.scale, bias, None, option)
                assert got.shape == (*gu.shape[:-1], n) and torch.equal(got, want)
                assert glu_calls == (["silu", None] if option else [])  # ours, then the composition's
    if m == 65:  # at the decode rows' edge (64) and below: the composition's call, x as it is
        gu = buf[:64, :2 * k]
        gate, up = gu.chunk(2, dim=-1)
        with torch.no_grad():
            got = fp8_linear.linear_fp8_glu(gu, q.data, q.scale, bias, "silu", True)
            want = fp8_linear.linear_fp8(torch.nn.functional.silu(gate) * up, q.data, q.scale, bias, None, True)
        assert torch.equal(got, want)


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("m", [65, 333, 1000])
def test_a_signature_again_takes_its_bound_launch_with_the_general_paths_bits(cuda, granularity, m, monkeypatch):
    """The first W8A8 call of a signature (fusion/fp8_linear.py) runs the general path and keeps
    its launch (kernels/cublaslt_fp8.BoundRun); later calls with fresh x take that launch: bit
    for bit ``run``'s result for their own x (each after a block of the output's size was filled
    with NaN and freed, which the output's allocation may take), for x and for the gated
    product; a CUDA graph captures the bound launch and replays it on new x."""
    from hybridgemm import fp8_linear

    fresh_bound_runs(monkeypatch)
    g = torch.Generator(device=cuda).manual_seed(m)
    n, k = 520, 1488  # 12 blocks of K: block scales whose row stride (12) cuBLASLt reads as they are
    q = fp8.quantize_fp8((torch.randn(n, k, device=cuda, generator=g) / k**0.5).bfloat16(), granularity)
    bias = torch.randn(n, device=cuda, generator=g).bfloat16()
    binds = []
    real = cublaslt_fp8.run_and_bind
    monkeypatch.setattr(cublaslt_fp8, "run_and_bind", lambda *a: binds.append(a[-1]) or real(*a))
    calls = {None: lambda x: fp8_linear.linear_fp8(x, q.data, q.scale, bias, None, True),
             "silu": lambda x: fp8_linear.linear_fp8_glu(x, q.data, q.scale, bias, "silu", True)}
    with torch.no_grad():
        for glu, call in calls.items():
            for _ in range(3):
                x = (torch.randn(m, k if glu is None else 2 * k, device=cuda, generator=g) * 2).bfloat16()
                x.new_full((m, n), float("nan"))  # freed at once: the block the output may take holds NaN
                got = call(x)
                assert torch.equal(got, real(x, q.data, q.scale, bias, None, None, glu)[0])
                if glu is None:
                    assert rel_err(got, w8a8_reference(x, q, bias)) < 1e-2
            assert binds == [glu]  # only the first call ran the general path
            binds.clear()
        static = (torch.randn(m, k, device=cuda, generator=g)).bfloat16()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = calls[None](static)
        new = (torch.randn(m, k, device=cuda, generator=g) * 3).bfloat16()
        static.copy_(new)
        graph.replay()
        assert torch.equal(captured, real(new, q.data, q.scale, bias, None, None, None)[0]) and not binds


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_bound_launches_without_bias_of_unaligned_x_and_of_a_stashed_product(cuda, granularity, monkeypatch):
    """Signatures the test above does not reach: no bias; x starting 2 bytes into its buffer
    (the quantization kernel specialised for x off 16-byte alignment); the gated product of a
    row wider than one pass (``fp8_quant.ONE_PASS_MAX``: the stash, inside the bound call's one
    allocation). Three calls of each: the checked call's bits, one general call."""
    from hybridgemm import fp8_linear
    from hybridgemm.kernels import fp8_quant

    fresh_bound_runs(monkeypatch)
    g = torch.Generator(device=cuda).manual_seed(7)
    m, n = 333, 520
    binds = []
    real = cublaslt_fp8.run_and_bind
    monkeypatch.setattr(cublaslt_fp8, "run_and_bind", lambda *a: binds.append(a[-1]) or real(*a))
    wide = 9728  # > ONE_PASS_MAX; 76 blocks of K (block scales read as they are)
    assert wide > fp8_quant.ONE_PASS_MAX and fp8_quant.stashes(wide, "silu")
    for what, k, glu, with_bias, offset in (("no bias", 1488, None, False, 0), ("x off alignment", 1488, None, True, 1),
                                            ("stashed product", wide, "silu", True, 0)):
        q = fp8.quantize_fp8((torch.randn(n, k, device=cuda, generator=g) / k**0.5).bfloat16(), granularity)
        bias = torch.randn(n, device=cuda, generator=g).bfloat16() if with_bias else None
        width = k if glu is None else 2 * k
        binds.clear()
        with torch.no_grad():
            for _ in range(3):
                buf = (torch.randn(m * width + 8, device=cuda, generator=g) * 2).bfloat16()
                x = buf[offset : offset + m * width].view(m, width)
                if glu is None:
                    got = fp8_linear.linear_fp8(x, q.data, q.scale, bias, None, True)
                else:
                    got = fp8_linear.linear_fp8_glu(x, q.data, q.scale, bias, glu, True)
                assert torch.equal(got, real(x, q.data, q.scale, bias, None, None, glu)[0]), what
        assert binds == [glu], what  # one general call, then the bound launch
