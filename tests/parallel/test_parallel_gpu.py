"""Tensor parallelism on two GPUs (``hybridgemm.parallel`` over NCCL): a bf16 Llama-shaped
model sharded over two ranks and patched against the unsharded stock model, run-to-run
bit-identity, and a decode step with its all-reduces and all-gather captured in a CUDA graph.

Two processes, one GPU each (skipped unless two are visible), run every case once; a case that
fails on one rank stops both (tests/two_ranks.py, the runner test_parallel_cpu.py uses too).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from two_ranks import assert_ranks_ok, llama_config, randomize, run_on_two_ranks, token_ids

from helpers import FLOORS, rank_order_sum, rel_err
from hybridgemm.parallel import RowParallelLinear, VocabParallelLinear, parallelize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
transformers = pytest.importorskip("transformers")

# Big enough that the GEMMs are real work (K = 1024 per rank for o), small enough to build fast.
# A vocabulary of 4099 does not divide by 2: the last rank's logits are padded for the gather.
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
              num_hidden_layers=2, vocab_size=4099, max_position_embeddings=256)
SEED = 4321


def _models(rank: int, kernel: str = "torch"):
    """(sharded + patched bf16, stock bf16, stock fp32 of the same bf16 weights), on this rank's
    GPU; the sharded model's sums by the one-shot ``kernel``."""
    device = torch.device("cuda", rank)
    config = llama_config(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    base = randomize(transformers.AutoModelForCausalLM.from_config(config), SEED).eval()
    stock = base.to(device=device, dtype=torch.bfloat16)
    fp32 = transformers.AutoModelForCausalLM.from_config(config).eval().to(device)
    fp32.load_state_dict({k: v.float() for k, v in stock.state_dict().items()})
    sharded = transformers.AutoModelForCausalLM.from_config(config).eval().to(device=device, dtype=torch.bfloat16)
    sharded.load_state_dict(stock.state_dict())
    report = parallelize(sharded, dist.group.WORLD, one_shot_kernel=kernel)
    assert report.all_reduce.startswith(f"one-shot ({kernel} kernel)"), report.all_reduce
    assert len(report.attention) == len(report.mlp) == 2 and report.lm_head == ["lm_head"], report
    assert len(report.patch.fused_qkv) == 2, report.patch
    return sharded, stock, fp32


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def case_bf16_within_flinear_error_bound(rank, group):
    """The sharded bf16 logits are within the bound the project holds kernels to: at most
    2x the error of the unsharded stock bf16 model (F.linear everywhere) against an fp32
    reference of the same weights, or the bf16 floor."""
    sharded, stock, fp32 = _models(rank)
    ids = token_ids(CONFIG["vocab_size"], (2, 24)).cuda(rank)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = _logits(fp32, ids)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    ours, theirs = rel_err(_logits(sharded, ids), ref), rel_err(_logits(stock, ids), ref)
    bound = max(2.0 * theirs, FLOORS[torch.bfloat16])
    assert ours <= bound, f"sharded bf16 logits: rel err {ours:.3g} > bound {bound:.3g} (stock: {theirs:.3g})"


def case_bit_identical_runs_and_ranks(rank, group):
    """Two runs of the same input give the same bits, and every rank holds the same logits."""
    sharded, _, _ = _models(rank)
    ids = token_ids(CONFIG["vocab_size"], (2, 24)).cuda(rank)
    first, second = _logits(sharded, ids), _logits(sharded, ids)
    assert torch.equal(first, second), "two runs of the sharded model differ"
    both = [torch.empty_like(first) for _ in range(2)]
    dist.all_gather(both, first.contiguous(), group=group)
    assert torch.equal(both[0], both[1]), "the ranks' logits differ"


def _decode_step(model, cache, cache_kw: str, cache_position: bool):
    """One decode step (one token per sequence) through the decoder layers, with the KV cache
    and an additive mask over the cache's slots given as static buffers: what a serving loop
    captures in a CUDA graph. ``cache_position``: the layers take the slot to write as
    ``cache_position`` (transformers 4 and early 5), else the cache keeps its own."""
    inner = model.model

    def step(ids, pos, mask):
        h = inner.embed_tokens(ids)
        pos_ids = pos.view(1, -1)
        rope = inner.rotary_emb(h, pos_ids)
        kw = {cache_kw: cache, **({"cache_position": pos} if cache_position else {})}
        for layer in inner.layers:
            out = layer(h, attention_mask=mask, position_ids=pos_ids, position_embeddings=rope, use_cache=True, **kw)
            h = out[0] if isinstance(out, tuple) else out
        return model.lm_head(inner.norm(h))

    return step


def case_cuda_graph_decode_step(rank, group):
    """A decode step captured in a CUDA graph (row-parallel all-reduces and the LM head's
    all-gather included) replays to the logits eager steps give, step after step."""
    from hybridgemm.perf.e2e_models import cached_forward, forward_api, static_cache

    sharded, _, _ = _models(rank)
    assert isinstance(sharded.model.layers[0].self_attn.o_proj, RowParallelLinear)
    assert isinstance(sharded.lm_head, VocabParallelLinear)
    params = inspect.signature(type(sharded.model.layers[0]).forward).parameters
    cache_kw = next((k for k in ("cache", "past_key_values", "past_key_value") if k in params), None)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if cache_kw is None and takes_kwargs:
        cache_kw = "past_key_values"  # a layer that passes its keywords through to the attention
    # Without a cache that keeps its own position (transformers 5's ``cache``), the slot to
    # write goes in as ``cache_position``, named or through **kwargs.
    takes_position = cache_kw != "cache" and ("cache_position" in params or takes_kwargs)
    if cache_kw is None or (cache_kw != "cache" and not takes_position):
        return f"this transformers' decoder layer takes no cache keyword: {list(params)}"
    api = forward_api(sharded)
    device, batch, prompt_len, max_len, steps = torch.device("cuda", rank), 2, 8, 32, 4
    prompt = token_ids(CONFIG["vocab_size"], (batch, prompt_len)).cuda(rank)
    caches = {}
    with torch.no_grad():
        for name in ("eager", "graph", "warmup"):
            caches[name] = static_cache(sharded, batch, max_len)
            last = cached_forward(sharded, api, prompt, caches[name], torch.arange(prompt_len, device=device))
        tok = last[:, -1:].argmax(-1)
        ids = tok.clone()
        pos = torch.tensor([prompt_len], device=device)
        mask = torch.full((1, 1, 1, max_len), float("-inf"), device=device, dtype=torch.bfloat16)
        mask[..., : prompt_len + 1] = 0

        warm = _decode_step(sharded, caches["warmup"], cache_kw, takes_position)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # NCCL communicators, hybridgemm's launchers and workspaces, outside the capture
                warm(ids, pos, mask)
        torch.cuda.current_stream().wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = _decode_step(sharded, caches["graph"], cache_kw, takes_position)(ids, pos, mask)
        eager = _decode_step(sharded, caches["eager"], cache_kw, takes_position)
        for t in range(steps):
            p = prompt_len + t
            ids.copy_(tok)
            pos.fill_(p)
            mask.fill_(float("-inf"))
            mask[..., : p + 1] = 0
            graph.replay()
            expected = eager(ids, pos, mask)
            torch.cuda.synchronize()
            assert torch.equal(static_logits, expected), f"step {t}: graph replay differs from the eager step"
            tok = expected[:, -1:].argmax(-1)
    return None


def _nccl_sum(t):
    out = t.clone(memory_format=torch.contiguous_format)  # NCCL takes contiguous tensors only
    dist.all_reduce(out)
    return out


def _back_to_back_sums(rank, name, gen, reference, what):
    """32 one-shot sums of distinct data back to back, rank 1 starting late: a rank must not
    overwrite its buffer while the other still reads it. Each equals ``reference(y)``."""
    from hybridgemm.parallel import collectives

    ys = [torch.randn(2, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
    expected = [reference(y) for y in ys]
    torch.cuda.synchronize()
    if rank == 1:
        torch.cuda._sleep(50_000_000)
    got = [collectives.tp_sum(y, name) for y in ys]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"back-to-back call {i} differs from {what}"


def case_one_shot_sum_is_nccls_sum(rank, group):
    """parallelize enables the one-shot all-reduce; its sums are bit-identical to NCCL's for
    bf16 and fp32 at odd sizes, eagerly, back to back with one rank running late, and replayed
    from a CUDA graph with new inputs; what it cannot take (fp16, over the buffer, an
    odd byte count) still sums right through NCCL, and an unaligned view is copied first."""
    from hybridgemm.parallel import collectives

    sharded, _, _ = _models(rank)
    report = parallelize(transformers.AutoModelForCausalLM.from_config(llama_config(**CONFIG)), group, patch=False)
    assert report.all_reduce.startswith("one-shot"), report.all_reduce
    name = group.group_name
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)  # each rank its own data
    cases = [((1, 4096), torch.bfloat16), ((3, 1000), torch.bfloat16), ((17, 1000), torch.float32),
             ((8, 8192), torch.bfloat16)]
    buf = collectives._BUFFERS[name]
    assert collectives.enable_one_shot(group) is None and collectives._BUFFERS[name] is buf  # enabled once
    for shape, dtype in cases:
        assert collectives.fits_one_shot(torch.empty(shape, dtype=dtype, device="cuda"), name), (shape, dtype)
        for _ in range(3):
            y = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            assert torch.equal(collectives.tp_sum(y, name), _nccl_sum(y)), (shape, dtype)
            nbytes = y.numel() * y.element_size()
            staged = buf[:nbytes].view(dtype).view(shape)
            assert torch.equal(staged, y), "the sum did not go through the symmetric buffer"
    _back_to_back_sums(rank, name, gen, _nccl_sum, "NCCL's sum")
    # captured in a CUDA graph, replayed on new inputs
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    collectives.tp_sum(x, name)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = collectives.tp_sum(x, name)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
        graph.replay()
        assert torch.equal(out, _nccl_sum(x)), "graph replay of the one-shot sum differs from NCCL's"
    # the NCCL fallbacks
    big = torch.randn(64, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)  # 512 KiB
    half = torch.randn(2, 4096, generator=gen, device="cuda", dtype=torch.float16)
    odd = torch.randn(3, 1001, generator=gen, device="cuda", dtype=torch.bfloat16)  # 6006 bytes
    assert not any(collectives.fits_one_shot(t, name) for t in (big, half, odd))
    unaligned = torch.randn(2 * 4096 + 1, generator=gen, device="cuda", dtype=torch.bfloat16)[1:].view(2, 4096)
    transposed = torch.randn(4096, 2, generator=gen, device="cuda", dtype=torch.float32).t()
    assert collectives.fits_one_shot(unaligned, name) and collectives.fits_one_shot(transposed, name)
    for t in (big, half, odd, unaligned, transposed):
        assert torch.equal(collectives.tp_sum(t, name), _nccl_sum(t)), (t.shape, t.dtype)
    # a tensor on another GPU than the buffer: a clear error on every rank, not a hang
    other = torch.ones(2, 4096, device=f"cuda:{1 - rank}", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="set_device"):
        collectives.tp_sum(other, name)
    del sharded


def _rank_order_sum(y, residual=None):
    """The fp32 sum of every rank's ``y`` in rank order (+ ``residual``), rounded once."""
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y.contiguous())
    return rank_order_sum(parts, residual)


def case_push_sum_is_the_rank_order_sum(rank, group):
    """parallelize with one_shot_kernel="push" enables hybridgemm's push kernel; its sums,
    with and without a residual, are the fp32 rank-order sums rounded once, for bf16, fp16
    and fp32 at odd sizes, eagerly, back to back with one rank running late, and replayed from
    a CUDA graph with new inputs; a message over the buffer still sums right through NCCL."""
    from hybridgemm.parallel import collectives

    report = parallelize(transformers.AutoModelForCausalLM.from_config(llama_config(**CONFIG)), group, patch=False,
                         one_shot_kernel="push")
    assert report.all_reduce.startswith("one-shot (push kernel)"), report.all_reduce
    name = group.group_name
    assert collectives.one_shot_kernel(group) == "push"
    gen = torch.Generator(device="cuda").manual_seed(200 + rank)  # each rank its own data
    same = torch.Generator(device="cuda").manual_seed(300)  # the residual: the same on every rank
    cases = [((1, 4096), torch.bfloat16), ((3, 1000), torch.bfloat16), ((17, 1001), torch.float16),
             ((8, 8192), torch.bfloat16), ((5, 999), torch.float32)]
    for shape, dtype in cases:
        assert collectives.push_fits(torch.empty(shape, dtype=dtype, device="cuda"), name), (shape, dtype)
        for _ in range(3):
            y = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            r = torch.randn(shape, generator=same, device="cuda", dtype=dtype) * 16
            assert torch.equal(collectives.tp_sum(y, name), _rank_order_sum(y)), (shape, dtype)
            assert torch.equal(collectives.tp_sum_residual(y, r, name), _rank_order_sum(y, r)), (shape, dtype)
    _back_to_back_sums(rank, name, gen, _rank_order_sum, "the rank-order sum")
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    collectives.tp_sum_residual(x, res, name)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = collectives.tp_sum_residual(x, res, name)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
        res.copy_(torch.randn(x.shape, generator=same, device="cuda", dtype=x.dtype))
        graph.replay()
        assert torch.equal(out, _rank_order_sum(x, res)), "graph replay of the push sum differs"
    big = torch.randn(64, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)  # 512 KiB: NCCL
    assert not collectives.fits_one_shot(big, name)
    assert torch.equal(collectives.tp_sum(big, name), _nccl_sum(big))


def case_compiled_mlp_sums_one_shot(rank, group):
    """A row-parallel MLP under torch.compile(fullgraph=True, mode="reduce-overhead") matches
    the eager module call after call, and its compiled sum goes through the symmetric buffer."""
    from hybridgemm.parallel import collectives

    sharded, _, _ = _models(rank)
    mlp = sharded.model.layers[0].mlp
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.one_shot
    buf = collectives._BUFFERS[group.group_name]
    compiled = torch.compile(mlp, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(7)  # the same input on every rank, as in TP
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 1, CONFIG["hidden_size"], generator=gen, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            dist.barrier()
            buf.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            got = compiled(x).clone()
            torch.cuda.synchronize()
            assert buf[: x.numel() * 2].count_nonzero() > 0, f"call {i}: the compiled sum did not use the buffer"
            ref = mlp(x)
            err = rel_err(got, ref)
            assert err <= FLOORS[torch.bfloat16], f"call {i}: compiled vs eager rel err {err:.3g}"


def _teacher_forced_decode(model, prompt, steps):
    """Logits (fp32) of each of ``steps`` decode steps over a StaticCache, the tokens fed fixed
    (the same for every model compared)."""
    from hybridgemm.perf.e2e_models import cached_forward, forward_api, static_cache

    device, (batch, n) = prompt.device, prompt.shape
    api, cache = forward_api(model), static_cache(model, batch, n + steps + 1)
    fed = token_ids(CONFIG["vocab_size"], (steps, batch, 1)).to(device)
    out = []
    with torch.no_grad():
        cached_forward(model, api, prompt, cache, torch.arange(n, device=device))
        for i in range(steps):
            pos = torch.arange(n + i, n + i + 1, device=device)
            out.append(cached_forward(model, api, fed[i], cache, pos)[:, -1].float())
    return torch.stack(out)


def case_fused_decode_within_error_bound(rank, group):
    """Static-cache decode through the fused decoder layers over two ranks, their GEMMs forced
    to split-K (this test's shapes have no table entries): rank 0's O and down add the
    residual before the sum, rank 1's add nothing. Within 2x the unsharded stock model's error
    against fp32; the same bits in a second run; the same residual stream on both ranks (the
    final norm's input, compared before the LM head's gather makes the logits alike anyway)."""
    _fused_decode(rank, group, "torch")


def case_fused_decode_push_sums_the_residual(rank, group):
    """The same with one_shot_kernel="push": no GEMM adds the residual, the push kernel's sums
    do (fp32, one rounding)."""
    _fused_decode(rank, group, "push")


def _fused_decode(rank, group, kernel):
    from hybridgemm import dispatch
    from hybridgemm.kernels import triton_splitk
    from hybridgemm.models import decode_checks
    from hybridgemm.models import decoder_layer as dl

    sharded, stock, fp32 = _models(rank, kernel)
    layer = sharded.model.layers[0]
    assert isinstance(layer, dl.HybridDecoderLayer) and decode_checks.takes_static_step(layer), type(layer)
    prompt = token_ids(CONFIG["vocab_size"], (2, 16)).cuda(rank)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = _teacher_forced_decode(fp32, prompt, 8)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    theirs = rel_err(_teacher_forced_decode(stock, prompt, 8), ref)

    config = triton_splitk.TritonSplitKConfig(16, 64, 64, split_k=2, num_warps=4, num_stages=3, fused_reduce=True)
    launches, streams = [], []
    real_config, real_run, real_key = dispatch.splitk_config, triton_splitk.run, dispatch._bound_key

    def run(cfg, *a, residual=None, rope=None, **kw):
        launches.append("rope" if rope is not None else "residual" if residual is not None else "other")
        return real_run(cfg, *a, residual=residual, rope=rope, **kw)

    # every step's launch through run (counted): no bound eager launches
    dispatch.splitk_config, triton_splitk.run, dispatch._bound_key = (lambda *a: config), run, lambda *a: None
    hook = sharded.model.norm.register_forward_pre_hook(lambda mod, args: streams.append(args[0].detach().clone()))
    try:
        ours, again = _teacher_forced_decode(sharded, prompt, 8), _teacher_forced_decode(sharded, prompt, 8)
    finally:
        dispatch.splitk_config, triton_splitk.run, dispatch._bound_key = real_config, real_run, real_key
        hook.remove()
    steps = 2 * 8  # two decodes of 8 steps, 2 layers each: one rotary QKV, O and down per layer
    assert launches.count("rope") == steps * 2, launches
    assert launches.count("residual") == (steps * 2 * 2 if rank == 0 and kernel == "torch" else 0), launches
    err = rel_err(ours, ref)
    bound = max(2.0 * theirs, FLOORS[torch.bfloat16])
    assert err <= bound, f"fused sharded decode: rel err {err:.3g} > bound {bound:.3g} (stock: {theirs:.3g})"
    assert torch.equal(ours, again), "two decodes of the sharded model differ"
    mine = torch.cat([t.reshape(-1) for t in streams])
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine, group=group)
    assert torch.equal(both[0], both[1]), "the ranks' residual streams differ"


CASES = [case_bf16_within_flinear_error_bound, case_bit_identical_runs_and_ranks, case_cuda_graph_decode_step,
         case_one_shot_sum_is_nccls_sum, case_push_sum_is_the_rank_order_sum, case_compiled_mlp_sums_one_shot,
         case_fused_decode_within_error_bound, case_fused_decode_push_sums_the_residual]


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    return run_on_two_ranks(CASES, "nccl", tmp_path_factory.mktemp("tp_gpu"), timeout_s=600)


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
def test_two_gpus(two_gpus, case):
    results = two_gpus[case]
    if all(r.startswith("skipped: ") for r in results):
        pytest.skip(results[0][len("skipped: "):])
    assert_ranks_ok(results)
