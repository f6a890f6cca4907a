"""FP8 experts on the GPU (``pytest -m gpu``): the MoE kernels over stacked e4m3 weights (per
channel and per 128 x 128 block) in bf16 against the fp32 computation over the dequantized
weights, as close as the bf16 kernels over those weights rounded to bf16 are, at decode and
prefill token counts and at Qwen3-30B-A3B's shape; the integer e4m3 conversion bit-identical to
Triton's cast; bit-identical across calls; CUDA-graph capture and torch.compile (fullgraph) of a
patched tiny Qwen3-MoE with FP8 experts equal to its eager result."""

from __future__ import annotations

import pytest
import torch

import hybridgemm
from hybridgemm import experts
from hybridgemm.fp8_experts import HybridFP8Experts
from hybridgemm.kernels import fp8, triton_e4m3

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _rel(a, ref) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9 or later")
    return torch.device("cuda")


def _weights(e, i, h, granularity, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w_gu = torch.randn(e, 2 * i, h, device=device, generator=g) * 0.05
    w_d = torch.randn(e, h, i, device=device, generator=g) * 0.05
    return fp8.quantize_fp8(w_gu.bfloat16(), granularity), fp8.quantize_fp8(w_d.bfloat16(), granularity)


def _fp32(x, ids, weights, w_gu, w_d):
    return experts.experts_loop(x.float(), ids, weights.float(), w_gu.dequantize(torch.float32),
                                w_d.dequantize(torch.float32), "silu")


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 333, 1000])
@pytest.mark.parametrize("e,k,i,h", [(8, 2, 384, 256), (32, 8, 128, 200)], ids=["mixtral-like", "qwen3-moe-like"])
def test_fp8_experts_error_matches_the_dequantized_bf16_kernels(cuda, granularity, tokens, e, k, i, h):
    w_gu, w_d = _weights(e, i, h, granularity, cuda, tokens)
    x = torch.randn(tokens, h, device=cuda).bfloat16()
    ids, weights = experts.route(torch.randn(tokens, e, device=cuda), k)
    want = _fp32(x, ids, weights, w_gu, w_d)
    dense = experts.moe(x, (ids, weights), w_gu.dequantize(), w_d.dequantize())
    out = torch.full((tokens, h), float("nan"), device=cuda, dtype=torch.bfloat16)
    out.copy_(experts.moe(x, (ids, weights), w_gu, w_d))
    assert torch.isfinite(out).all()
    assert _rel(out, want) <= 1.1 * _rel(dense, want) + 1e-3, (_rel(out, want), _rel(dense, want))
    assert torch.equal(out, experts.moe(x, (ids, weights), w_gu, w_d))


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("tokens", [1, 8, 2048])
def test_qwen3_30b_a3b_experts_in_fp8(cuda, granularity, tokens):
    e, k, i, h = 128, 8, 768, 2048
    w_gu, w_d = _weights(e, i, h, granularity, cuda)
    x = torch.randn(tokens, h, device=cuda).bfloat16()
    ids, weights = experts.route(torch.randn(tokens, e, device=cuda), k)
    want = _fp32(x, ids, weights, w_gu, w_d)
    dense = experts.moe(x, (ids, weights), w_gu.dequantize(), w_d.dequantize())
    out = experts.moe(x, (ids, weights), w_gu, w_d)
    assert _rel(out, want) <= 1.1 * _rel(dense, want) + 1e-3, (_rel(out, want), _rel(dense, want))


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("tokens", [1, 40])
def test_the_integer_conversion_equals_tritons_cast(cuda, granularity, tokens, monkeypatch):
    w_gu, w_d = _weights(16, 256, 384, granularity, cuda)
    x = torch.randn(tokens, 384, device=cuda).bfloat16()
    ids, weights = experts.route(torch.randn(tokens, 16, device=cuda), 2)
    fast = experts.moe(x, (ids, weights), w_gu, w_d)
    monkeypatch.setattr(triton_e4m3, "INTEGER_CONVERSION", False)
    assert torch.equal(experts.moe(x, (ids, weights), w_gu, w_d), fast)


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("shape", [(2, 9), (1, 1)], ids=["grouped", "pair-major"])
def test_a_patched_fp8_qwen3_moe_block_in_a_cuda_graph_and_compiled(cuda, granularity, shape):
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      num_experts=16, num_experts_per_tok=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(cuda, torch.bfloat16).eval()
    hybridgemm.patch(model, weights="fp8", granularity=granularity)
    block = model.model.layers[0].mlp
    assert type(block.experts) is HybridFP8Experts
    h = torch.randn(*shape, 256, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(h)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(h)
        graph.replay()
        compiled = torch.compile(block, fullgraph=True)(h)
        logits = torch.compile(model, fullgraph=True)(torch.randint(0, 256, shape, device=cuda)).logits
    torch._dynamo.reset()
    assert torch.equal(captured, eager)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    assert torch.isfinite(logits).all()
