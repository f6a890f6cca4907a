"""FP8 weights on the GPU (``pytest -m gpu``): ``hybridgemm.linear`` with an FP8 weight against
the fp32 product of its dequantized weight, the decision per M, bit-identical repeats, CUDA
graph capture, and a small bf16 Llama patched with ``weights="fp8"`` decoding through the
fused step (eager and compiled fullgraph with CUDA graphs) as close to an fp32 model with the
same dequantized weights as dequantize-then-bf16 is."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import dequantized_copy, static_decode
from hybridgemm import dispatch
from hybridgemm.kernels import triton_splitk

pytestmark = pytest.mark.gpu
VOCAB = 512


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 conversion below compute capability 8.9")


def _rel(a, ref) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 333, 1000])
@pytest.mark.parametrize("n,k,act", [(1000, 1152, None), (4096, 4096, "gelu_tanh"), (6144, 4096, None),
                                     (257, 300, "relu")])
def test_linear_with_an_fp8_weight_matches_the_dequantized_fp32_product(granularity, m, n, k, act):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    q = hybridgemm.quantize_fp8(w, granularity)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    wd = q.dequantize(torch.float32)
    ref32 = F.linear(x.float(), wd, b.float())
    ref32 = {None: ref32, "relu": F.relu(ref32), "gelu_tanh": F.gelu(ref32, approximate="tanh")}[act]
    deq = F.linear(x, wd.bfloat16(), b)
    deq = {None: deq, "relu": F.relu(deq), "gelu_tanh": F.gelu(deq, approximate="tanh")}[act]
    got = hybridgemm.linear(x, q, b, act)
    again = hybridgemm.linear(x, q, b, act)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert torch.equal(got, again)
    assert _rel(got, ref32) <= 1.1 * _rel(deq, ref32) + 2e-4, (_rel(got, ref32), _rel(deq, ref32))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    choice = dispatch.decision_for(x, q.data, b, out, act, q.weight_format)
    assert choice.backend == ("triton_splitk" if m <= 64 else "torch"), choice


def test_noncontiguous_rows_and_a_3d_input():
    q = hybridgemm.quantize_fp8(torch.randn(384, 512, device="cuda").bfloat16())
    x = torch.randn(2, 9, 1024, device="cuda").bfloat16()[..., ::2]
    got = hybridgemm.linear(x, q)
    ref = F.linear(x.float(), q.dequantize(torch.float32))
    assert got.shape == (2, 9, 384) and _rel(got, ref) < 1e-2


def test_cuda_graph_capture_of_an_fp8_linear():
    q = hybridgemm.quantize_fp8(torch.randn(4096, 4096, device="cuda").bfloat16())
    x = torch.randn(4, 4096, device="cuda").bfloat16()
    eager = hybridgemm.linear(x, q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hybridgemm.linear(x, q)  # warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = hybridgemm.linear(x, q)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, hybridgemm.linear(x, q)) and not torch.equal(y, eager)


def _models(granularity):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    patched = copy.deepcopy(base).to("cuda", torch.bfloat16)
    report = hybridgemm.patch(patched, weights="fp8", granularity=granularity)
    assert report.fused_layers == ["model.layers.0", "model.layers.1"] and len(report.fp8) == 8
    # the same model with the dequantized weights: fp32 (the reference) and bf16 (dequantize -> F.linear)
    ref = dequantized_copy(base.to("cuda"), patched)
    deq = copy.deepcopy(ref).to(torch.bfloat16)
    return ref, deq, patched


def _decode(model, tokens, compiled: bool):
    return static_decode(model, tokens, compiled, VOCAB)[0]


@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_patched_llama_decodes_as_close_to_fp32_as_dequantized_bf16(granularity, compiled, monkeypatch):
    ref, deq, patched = _models(granularity)
    calls = {"fp8": 0, "glu": 0}
    real = triton_splitk.run

    def run(cfg, *a, weight_scale=None, **kw):
        calls["fp8"] += weight_scale is not None
        calls["glu"] += weight_scale is not None and kw.get("glu") == "silu"
        return real(cfg, *a, weight_scale=weight_scale, **kw)

    monkeypatch.setattr(triton_splitk, "run", run)
    tokens = [torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(i)).cuda() for i in range(5)]
    with torch.no_grad():
        want = _decode(ref, tokens, False)
        base = _decode(deq, tokens, False)
        got = _decode(patched, tokens, compiled)
        again = _decode(patched, tokens, compiled)
    torch._dynamo.reset()
    assert calls["fp8"] >= 4 * 2  # QKV, O, gate/up and down of both layers ran the FP8 split-K kernel
    assert calls["glu"] >= 2  # gate/up with the SwiGLU product in its epilogue
    assert _rel(got, want) <= 1.5 * _rel(base, want) + 1e-3, (_rel(got, want), _rel(base, want))
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity", ["channel", "block128"])
@pytest.mark.parametrize("n,k", [(1, 16), (257, 300), (6144, 4096)])
def test_one_pass_dequantize_equals_the_reference_bit_for_bit(dtype, granularity, n, k):
    """kernels/triton_dequant.py (bf16: the integer e4m3 conversion) against kernels/fp8.py
    ``dequantize``: every finite e4m3 code appears, scales of several magnitudes, output poisoned."""
    from hybridgemm.kernels import fp8
    from hybridgemm.kernels.lazy import triton_module

    g = torch.Generator(device="cuda").manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (refused when a weight is made)
    codes.view(-1)[: min(n * k, 254)] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F],
                                                     device="cuda", dtype=torch.uint8)[: min(n * k, 254)]
    data = codes.view(fp8.E4M3)
    shape = (n,) if granularity == "channel" else (-(-n // 128), -(-k // 128))
    scale = torch.rand(shape, device="cuda", generator=g) * 10.0 ** torch.randint(-4, 2, shape, device="cuda",
                                                                                    generator=g)
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
        got = triton_module("triton_dequant").dequantize(data, scale, granularity, dtype)
    finally:
        torch.empty = real_empty
    assert torch.equal(got, fp8.dequantize(data, scale, dtype))
