"""Shared test helpers: references, error measures and bounds."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hybridgemm.kernels.epilogue import Activation, apply_activation, reference_linear

# Error floors per dtype (relative Frobenius error). Bounds are max(2 x torch's own error on
# the same inputs, floor): a kernel must be about as accurate as F.linear, and never sloppier
# than the dtype's rounding allows.
FLOORS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def w8a8_reference(x: torch.Tensor, q, bias: torch.Tensor | None = None, activation=None) -> torch.Tensor:
    """``act(x8 @ W.T + b)`` in fp32 as cuBLASLt's FP8 GEMM computes it (kernels/cublaslt_fp8.py):
    x quantized as that path quantizes it (per token for a ``channel`` FP8 weight ``q``, per 1 x 128
    block for ``block128``: quantize_fp8's formula on each row or row block) then dequantized,
    times the dequantized weight, plus the bias, then the activation."""
    from hybridgemm.kernels import fp8
    from hybridgemm.kernels.epilogue import Activation, apply_activation

    xf = x.float()
    if q.granularity == "channel":
        xq = fp8.quantize_fp8(xf, "channel").dequantize(torch.float32)
    else:
        m, k = xf.shape
        blocks = torch.zeros(m, -(-k // 128) * 128, device=x.device)
        blocks[:, :k] = xf
        xq = fp8.quantize_fp8(blocks.view(-1, 128), "channel").dequantize(torch.float32).view(m, -1)[:, :k]
    z = torch.nn.functional.linear(xq, q.dequantize(torch.float32), None if bias is None else bias.float())
    return apply_activation(z, Activation.parse(activation))


def rank_order_sum(parts: list[torch.Tensor], residual: torch.Tensor | None = None) -> torch.Tensor:
    """What a tensor-parallel sum of ``parts`` (one per rank) must give: their fp32 sum in rank
    order, plus ``residual``, rounded once to their dtype."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    if residual is not None:
        acc += residual.float()
    return acc.to(parts[0].dtype)


def assert_chain_reads_its_producer(chain, expected, x0: torch.Tensor, out: torch.Tensor,
                                    bound: float = 1.5e-2, calls: int = 20) -> None:
    """A chain of kernel calls, each reading the last one's output, against ``expected(x0)``:
    ``calls`` times eagerly (``chain(x0)`` returns the result), then captured once as a CUDA
    graph and replayed ``calls`` times on fresh ``x0`` (the result lands in ``out``). The
    relative error stays near bf16 rounding for a chain whose grids each wait for their
    producer; a grid that read its input too early (stale or half-written) is off by O(1)."""
    want = expected(x0)
    for _ in range(calls):
        assert rel_err(chain(x0), want) < bound
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(x0)
    for _ in range(calls):
        x0.copy_(torch.randn_like(x0))
        want = expected(x0)
        g.replay()
        assert rel_err(out, want) < bound


def torch_linear(x, w, b, activation) -> torch.Tensor:
    """What a user gets from PyTorch today: F.linear then the activation, in the input dtype."""
    return apply_activation(F.linear(x, w, b), Activation.parse(activation))


def check_close_to_reference(out, x, w, b, activation, what: str = "") -> tuple[float, float]:
    """Assert ``out`` is within the bound of an fp64 reference; return (ours, torch's) error."""
    ref = reference_linear(x, w, b, activation)
    ours = rel_err(out, ref)
    theirs = rel_err(torch_linear(x, w, b, activation), ref)
    bound = max(2.0 * theirs, FLOORS[x.dtype])
    assert ours <= bound, f"{what}: rel err {ours:.3g} > bound {bound:.3g} (torch's own: {theirs:.3g})"
    return ours, theirs


def make_operands(m, n, k, dtype, device, bias=True, scale=1.0):
    x = torch.randn(m, k, device=device, dtype=torch.float32).to(dtype) * scale
    w = (torch.randn(n, k, device=device, dtype=torch.float32) / max(k, 1) ** 0.5).to(dtype)
    b = torch.randn(n, device=device, dtype=torch.float32).to(dtype) if bias else None
    return x, w, b


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_counters_zero():
    """Single-pass split-K leaves every arrival counter at 0 (the next call relies on it)."""
    from hybridgemm.kernels.triton_scratch import counters_snapshot

    for buf in counters_snapshot():
        assert not buf.any(), "split-K arrival counters were not reset"


def range_entry(backend: str, record: dict, lo: int, hi: int, ratio: float = 1.1, median_us: float = 10.0) -> dict:
    """A table entry for the M range lo-hi, as the tuner writes one: timed at the range's
    sample points, ``ratio`` times F.linear's speed at each."""
    from hybridgemm.autotune_cache.keys import sample_points
    from hybridgemm.autotune_cache.table import make_entry

    points = sample_points(lo, hi)
    return make_entry(backend, record, m_points=points, ratios=[ratio] * len(points), median_us=median_us,
                      spread_us=0.1, flinear_us=median_us * ratio)


def bench_cli(*argv):
    """``hybridgemm bench|plot ...`` through the parsers perf/cli_commands.py adds; returns the exit code."""
    import argparse

    from hybridgemm.perf.cli_commands import add_bench_parser, add_plot_parser

    ap = argparse.ArgumentParser(prog="hybridgemm")
    sub = ap.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_plot_parser(sub)
    args = ap.parse_args(list(argv))
    return args.fn(args)


def run_like_the_dispatcher(backend: str, config, x, weight, bias, activation=None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` as fusion/dispatch.py computes it once a decision names
    ``backend`` and ``config``, on CPU tensors under the Triton interpreter: the operands
    normalised by kernels/checks.py (leading dims flattened, row-major rows, a unit-stride
    aligned bias), the backend's kernel into a NaN-poisoned (M, N) output, and that output
    viewed with x's leading dims."""
    from hybridgemm.kernels import backends
    from hybridgemm.kernels.checks import contiguous_bias, row_major, rows_2d

    x2, w2, b2 = row_major(rows_2d(x)), row_major(weight), contiguous_bias(bias)
    out = poisoned((x2.shape[0], weight.shape[0]), x.dtype, x.device)
    assert backends.get_backend(backend).run(config, x2, w2, b2, out, Activation.parse(activation)) is out
    return out.reshape(*x.shape[:-1], weight.shape[0])


def llama_variants(hidden_size: int, intermediate_size: int, vocab_size: int, device: str = "cuda",
                   kind: str = "llama", window: int | None = None, attention: str | None = None):
    """A small 2-layer Llama (``kind="qwen3"``: Qwen3, with its q/k norms; ``"granite"``: Granite, with its
    multipliers; ``"qwen3_moe"``/``"mixtral"``: those mixtures of 8 experts, 2 per token, of a quarter of
    ``intermediate_size`` / of it; ``"qwen2_moe"``: Qwen2-MoE, 8 experts of a quarter of it and a gated shared
    expert of half of it; ``"gemma"``: Gemma, its (1 + w) norms drawn from U(-0.5, 0.5), GeGLU; ``"gemma2"``: Gemma
    2, the same with post-norms, a sliding-window layer and the attention softcap, eager attention; ``"gemma3"``:
    Gemma 3, post-norms and (1 + w) q/k norms; ``"phi3"``: Phi-3, its Q/K/V and gate/up one linear each in the
    checkpoint (``"phi3_partial"``: with the rotary over three quarters of each head, Phi-4-mini's); ``"olmo2"``:
    OLMo 2, post-norms only, q/k norms over all heads; ``"stablelm"``: StableLM, LayerNorms, the rotary over a
    quarter of each head, a Q/K/V bias; ``"stablelm_parallel"``: the same with the parallel residual and no bias;
    ``"cohere"``: Cohere, its LayerNorm, the parallel residual, the rotary of neighbouring columns; ``"gpt_neox"``:
    GPT-NeoX, LayerNorms, the parallel residual, its per-head Q/K/V layout, the rotary over a quarter of each head,
    8 KV heads; ``"falcon"``: Falcon-7B's form, multi-query (one KV head), one LayerNorm for the parallel attention
    and MLP, no biases; ``"falcon_new"``: Falcon-40B's, its Q/K/V grouped per KV head, a LayerNorm each for the
    attention and the MLP; ``"olmoe"``: OLMoE, 8 experts of a quarter of ``intermediate_size``, 2 per token, q/k
    norms over all heads; ``"olmo3"``, ``"ministral"``: OLMo 3 and Ministral, a sliding-window layer and a full one;
    ``"smollm3"``: SmolLM3, its second layer without positional embedding; ``"ministral3"``: Ministral 3, its queries
    scaled per position from position 2 on; ``"glm"``, ``"helium"``: GLM and Helium, the rotary of neighbouring pairs
    over the first half of each head and over whole heads; ``"glm4"``: GLM-4 (0414), GLM's with norms around each
    sublayer; ``"ernie4_5"``: Ernie 4.5, the rotary of neighbouring pairs in fp32 from its fp32 cos/sin;
    ``"ernie4_5_moe"``: Ernie 4.5 MoE, a dense first layer, then 8 experts of a quarter of ``intermediate_size``, 2
    per token, with a shared expert and its router's selection bias; ``"hunyuan"``: Hunyuan, q/k norms of the
    rotated heads; ``"hunyuan_moe"``: the same attention, 8 experts, 2 per token, with a shared expert;
    ``"exaone4"``: EXAONE 4, OLMo 2's layer, per-head q/k norms, a sliding layer and a full one without rotary;
    ``"seed_oss"``: Seed-OSS, Llama's layer with q/k/v biases, dropouts of its attention's and MLP's outputs;
    ``"cohere2"``: Cohere 2, Cohere's layer, the rotary on its sliding layer only)
    of 8 heads and 2 KV heads, random weights, seed 0, three ways: fp32 (the reference), bf16 stock, and bf16
    patched by hybridgemm with both decoder layers fused. ``window``: Gemma 2/3's, OLMo 3's, Ministral's and
    EXAONE 4's sliding window (else 4; Gemma 3's two layers then sliding and full, else both sliding, its config's
    pattern);
    ``attention``: the attention implementation (else transformers' default)."""
    import copy

    import transformers

    import hybridgemm

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "granite": transformers.GraniteConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig, "gemma": transformers.GemmaConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig, "phi3": transformers.Phi3Config,
           "phi3_partial": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
           "gemma3": transformers.Gemma3TextConfig,
           "olmo2": transformers.Olmo2Config, "stablelm": transformers.StableLmConfig,
           "stablelm_parallel": transformers.StableLmConfig, "cohere": transformers.CohereConfig,
           "gpt_neox": transformers.GPTNeoXConfig, "falcon": transformers.FalconConfig,
           "falcon_new": transformers.FalconConfig, "olmoe": transformers.OlmoeConfig,
           "glm4_moe": transformers.Glm4MoeConfig, "olmo3": transformers.Olmo3Config,
           "ministral": transformers.MinistralConfig, "smollm3": transformers.SmolLM3Config,
           "ministral3": transformers.Ministral3Config, "glm": transformers.GlmConfig,
           "helium": transformers.HeliumConfig, "glm4": transformers.Glm4Config,
           "ernie4_5": transformers.Ernie4_5Config, "ernie4_5_moe": transformers.Ernie4_5_MoeConfig,
           "hunyuan": transformers.HunYuanDenseV1Config, "hunyuan_moe": transformers.HunYuanMoEV1Config,
           "exaone4": transformers.Exaone4Config, "seed_oss": transformers.SeedOssConfig,
           "cohere2": transformers.Cohere2Config}[kind]
    extra = {"granite": dict(residual_multiplier=0.22, attention_multiplier=0.05, embedding_multiplier=12.0,
                             logits_scaling=8.0),
             "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4),
             "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                               shared_expert_intermediate_size=intermediate_size // 2),
             "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
             "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=intermediate_size // 4),
             "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                              n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                              attention_bias=True),
             "phi3": dict(pad_token_id=0, resid_pdrop=0.1),
             "phi3_partial": dict(pad_token_id=0, partial_rotary_factor=0.75),
             "stablelm": dict(partial_rotary_factor=0.25, use_qkv_bias=True),
             "stablelm_parallel": dict(partial_rotary_factor=0.25, use_parallel_residual=True),
             "gpt_neox": dict(rotary_pct=0.25),
             "falcon": dict(multi_query=True, parallel_attn=True, bias=False),
             "falcon_new": dict(new_decoder_architecture=True, num_kv_heads=2, bias=False),
             "gemma2": dict(sliding_window=window or 4, attn_logit_softcapping=50.0),
             "olmo3": dict(sliding_window=window or 4, layer_types=["sliding_attention", "full_attention"]),
             "ministral": dict(sliding_window=window or 4, layer_types=["sliding_attention", "full_attention"]),
             "exaone4": dict(sliding_window=window or 4, layer_types=["sliding_attention", "full_attention"]),
             "seed_oss": dict(residual_dropout=0.1, attention_bias=True),
             "cohere2": dict(sliding_window=window or 4, layer_types=["sliding_attention", "full_attention"]),
             "smollm3": dict(no_rope_layers=[1, 0], pad_token_id=0),
             "glm": dict(pad_token_id=0), "helium": dict(pad_token_id=0), "glm4": dict(pad_token_id=0),
             "ernie4_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                                  moe_num_shared_experts=1, moe_layer_start_index=1),
             "hunyuan_moe": dict(num_experts=8, moe_topk=2),
             "ministral3": dict(pad_token_id=0, rope_parameters={
                 "rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1,
                 "original_max_position_embeddings": 2}),
             # (with a window: a sliding layer beside a full one, whose length says the cache's)
             "gemma3": dict(sliding_window=window or 4,
                            **({"layer_types": ["sliding_attention", "full_attention"]} if window else {})),
             }.get(kind, {})
    falcon = kind.startswith("falcon")
    heads = {} if kind == "gpt_neox" or falcon else dict(num_key_value_heads=2, head_dim=hidden_size // 8)
    width = {"ffn_hidden_size" if falcon else "intermediate_size": intermediate_size}
    config = cls(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=8,
                 max_position_embeddings=128, tie_word_embeddings=False, **{**width, **heads, **extra})
    torch.manual_seed(0)
    load = {} if attention is None else {"attn_implementation": attention}
    base = transformers.AutoModelForCausalLM.from_config(config, **load).eval()
    if kind in ("glm4_moe", "ernie4_5_moe"):  # its selection bias starts at zero: values that change choices
        with torch.no_grad():  # (GLM-4-MoE's a buffer, Ernie's a parameter)
            for name, b in [*base.named_buffers(), *base.named_parameters()]:
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.3)
    if kind == "olmoe":  # its q/k norms start at weight 1: other factors, so that they show
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    if kind in ("gemma", "gemma2", "gemma3"):  # its norms start at weight 0: other factors, so that 1 + w shows
        with torch.no_grad():
            for name, p in base.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    if kind in ("glm4", "hunyuan", "hunyuan_moe", "exaone4"):  # norms start at weight 1: other factors, so that
        # a norm in another's place shows
        with torch.no_grad():
            for name, p in base.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    if kind.startswith("stablelm") or kind in ("cohere", "cohere2", "gpt_neox") or falcon:
        # LayerNorms start as the identity
        with torch.no_grad():
            for name, p in base.named_parameters():
                if "norm" in name or (falcon and p.dim() == 1):  # (Falcon's: ln_attn, ln_mlp, ln_f too)
                    p.uniform_(*((0.5, 1.5) if name.endswith("weight") else (-0.5, 0.5)))
    ref = copy.deepcopy(base).to(device)
    stock = copy.deepcopy(base).to(device, torch.bfloat16)
    # routers in fp32, as their models load them: Ernie's (_keep_in_fp32_modules_strict), Hunyuan's
    # (its gate builds wg in fp32)
    routers = {"ernie4_5_moe": ("gate.weight", "e_score_correction_bias"), "hunyuan_moe": ("gate.wg.weight",)}
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if name.endswith(routers.get(kind, ())):
                p.data = p.data.float().copy_(base.get_parameter(name))
    patched = copy.deepcopy(stock)
    layers = {"gpt_neox": "gpt_neox.layers", "falcon": "transformer.h", "falcon_new": "transformer.h"}.get(
        kind, "model.layers")
    assert hybridgemm.patch(patched).fused_layers == [f"{layers}.0", f"{layers}.1"]
    return ref, stock, patched


def assert_trains_as_stock(model, stock, ids: torch.Tensor, logits_atol: float, grad_atol: float) -> None:
    """One forward and backward of each (the loss: the logits' mean square): ``model``'s logits
    as ``stock``'s (rtol 1e-5), and the gradient of each of ``stock``'s parameters as the
    same-named one of ``model`` (rtol 1e-4)."""
    logits = []
    for m in (model, stock):
        out = m(input_ids=ids).logits
        out.square().mean().backward()
        logits.append(out.detach())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=logits_atol)
    grads = dict(model.named_parameters())
    for name, p in stock.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=grad_atol, msg=name)


def static_decode(model, tokens, compiled: bool, vocab: int, prompt: int = 5, cache_len: int = 32):
    """Logits (fp32) of each fed token (``tokens``: [B, 1] each) after a ``prompt``-token random
    prompt, over a fresh StaticCache on CUDA; compiled with ``reduce-overhead`` and fullgraph
    where ``compiled``. Returns ``(logits [steps, B, vocab], cache)``."""
    from hybridgemm.perf import e2e_models as hf

    api = hf.forward_api(model)
    cache = hf.static_cache(model, tokens[0].shape[0], cache_len)
    ids = torch.randint(0, vocab, (tokens[0].shape[0], prompt), generator=torch.Generator().manual_seed(5)).cuda()
    hf.cached_forward(model, api, ids, cache, torch.arange(prompt, device="cuda"))

    def step(tok, pos):
        return hf.cached_forward(model, api, tok, cache, pos)[:, -1].float()

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
    out = []
    pos = torch.tensor([prompt], device="cuda")
    for tok in tokens:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        out.append(fn(tok, pos).clone())
        pos.add_(1)
    return torch.stack(out), cache


def dequantized_copy(stock, patched):
    """``stock`` (deep-copied) with each projection's weight replaced by ``patched``'s FP8 weight
    dequantized in fp32 (fused Q/K/V and gate/up split back into their linears): the model that
    ``patched`` approximates, for FP8 error references."""
    import copy

    from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear, weight_scale_of
    from hybridgemm.kernels import fp8

    ref = copy.deepcopy(stock)
    for name, mod in patched.named_modules():
        if isinstance(mod, (FP8FusedLinears, FP8HybridLinear)):
            w = fp8.dequantize(mod.weight, weight_scale_of(mod), torch.float32)
            parent = ref.get_submodule(name.rpartition(".")[0])
            if isinstance(mod, FP8FusedLinears):
                for part, rows in zip(mod.names, w.split(mod.sizes)):
                    getattr(parent, part).weight.data.copy_(rows.to(getattr(parent, part).weight.dtype))
            else:
                target = ref.get_submodule(name).weight
                target.data.copy_(w.to(target.dtype))
    return ref


def greedy_static_decode(model, steps: int, vocab: int, tokens=None, batch: int = 2, prompt: int = 3):
    """Greedy decode over a StaticCache on the model's device (the CPU tests'): ``(logits per
    step, tokens fed, cache)``; ``tokens``: feed these instead of the argmax (to replay another
    model's choices)."""
    from hybridgemm.perf import e2e_models as hf

    api = hf.forward_api(model)
    cache = hf.static_cache(model, batch, 16)
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(3))
    logits = [hf.cached_forward(model, api, ids, cache, torch.arange(prompt))[:, -1]]
    fed = []
    for i in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[i]
        fed.append(tok)
        logits.append(hf.cached_forward(model, api, tok, cache, torch.tensor([prompt + i]))[:, -1])
    return logits, fed, cache


def assert_static_decode_matches(model, stock, vocab: int, steps: int, batch: int) -> None:
    """``model`` decodes as ``stock`` does over a StaticCache (CPU, fp32): logits per step and
    the caches' keys, values and lengths, ``stock``'s greedy tokens fed to both."""
    with torch.no_grad():
        ref, fed, ref_cache = greedy_static_decode(stock, steps, vocab, None, batch)
        out, _, cache = greedy_static_decode(model, steps, vocab, fed, batch)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for got, want in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)
        assert int(got.cumulative_length) == int(want.cumulative_length)


def tiny_moe_lm(kind: str, vocab: int, hidden: int, experts: int, top_k: int, head_dim: int | None = None,
                **load):
    """A 2-layer causal LM of transformers' ``kind`` ("mixtral", "qwen3_moe", "olmoe" (its q/k
    norms over all heads), "qwen2_moe" with a shared expert, or DeepSeek-V3's router form:
    "glm4_moe" (4 groups, 2 kept; q/k/v biases, the rotary over half of each head) and
    "deepseek_v3" (MLA attention; 2 groups, 1 kept), both with shared experts, a dense first layer
    and their selection bias N(0, 0.3)) of 4 heads and 2 KV
    heads, seed 0, its experts N(0, 0.1) (large enough to matter in the logits); ``load``:
    from_config's keywords (attn_implementation)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=experts, num_experts_per_tok=top_k,
                                         **common)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=40, num_experts=experts, num_experts_per_tok=top_k,
                                          intermediate_size=80, head_dim=head_dim or hidden // 4, **common)
    elif kind == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(moe_intermediate_size=40, n_routed_experts=experts, num_experts_per_tok=top_k,
                                         n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                         intermediate_size=80, head_dim=head_dim or hidden // 4, attention_bias=True,
                                         **common)
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(moe_intermediate_size=40, n_routed_experts=experts,
                                            num_experts_per_tok=top_k, n_group=2, topk_group=1,
                                            routed_scaling_factor=2.5, first_k_dense_replace=1, intermediate_size=80,
                                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                            v_head_dim=16, **common)
    elif kind == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=40, num_experts=experts, num_experts_per_tok=top_k, **common)
    else:
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=40, num_experts=experts, num_experts_per_tok=top_k,
                                          shared_expert_intermediate_size=56, intermediate_size=80, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **load).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
            elif kind == "olmoe" and name.endswith(("q_norm.weight", "k_norm.weight")):  # (they start at ones)
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (it starts at zero)
                b.normal_(0, 0.3)
    return model


def compile_offline(script: str) -> None:
    """Run ``script`` (which compiles kernels for a GPU target with Triton's offline API and
    prints "compiled") in a fresh process without the interpreter; skip the calling test where
    this Triton's offline-compile API differs (the script exits with "API: ..." then)."""
    import os
    import subprocess
    import sys

    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode and "API:" in done.stderr:
        pytest.skip(f"this Triton's offline-compile API differs: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


def silu_product(gu: torch.Tensor) -> torch.Tensor:
    """transformers' eager ``act_fn(gate) * up`` of a stacked (gate | up) tensor, in its dtype.
    On the GPU torch's own SiLU kernel; on the CPU the formula as the interpreter evaluates the
    kernel's (float32 ``g / (1 + exp(-g))``, its exp numpy's), so that each device checks the
    bytes of the very product it computes."""
    gate, up = gu.chunk(2, dim=1)
    if gu.is_cuda:
        return F.silu(gate) * up
    g = gate.float().numpy()
    act = torch.from_numpy(g / (np.float32(1.0) + np.exp(-g))).to(gu.dtype)
    return act * up
