"""Tensor parallelism on the CPU (``hybridgemm.parallel``).

Two processes on the gloo backend run every sharded case once (one spawn for the whole
module, bounded by timeouts so that a hang fails instead of blocking): each rank builds the
same fp32 model from the same seed, keeps an unsharded copy, shards the other with
``parallelize`` (which then patches it, so each rank's q/k/v run fused) and compares. The
argument errors and the per-rank slicing need no second process: a fake process group (torch's
test backend, whose collectives do nothing) gives this process a rank in a larger group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from two_ranks import SEED, assert_ranks_ok, llama_config, randomize, run_on_two_ranks, token_ids

import hybridgemm
from helpers import rank_order_sum
from hybridgemm.linear_layer import PartialSumLinear
from hybridgemm.models import decode_step
from hybridgemm.parallel import (
    RowParallelLinear,
    VocabParallelLinear,
    load_full_state_dict,
    parallelize,
)

transformers = pytest.importorskip("transformers")

RTOL = 1e-5


# --- models ------------------------------------------------------------------------------

def qwen2_config(**kw):
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=97, max_position_embeddings=64, tie_word_embeddings=False,
                use_sliding_window=False)
    config = transformers.Qwen2Config(**{**base, **kw})
    config._attn_implementation = "sdpa"
    return config


def causal_lm(config, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), seed).eval()


def assert_same(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item(), msg=lambda m: f"{what}: {m}")


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class MlpWithHead(nn.Module):
    """A gated MLP and an LM head on one module: what parallelize finds in a decoder, small
    enough to compile quickly."""

    def __init__(self, hidden=32, width=64, vocab=97):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width)
        self.up_proj = nn.Linear(hidden, width)
        self.down_proj = nn.Linear(width, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


# --- the cases, run on both ranks ---------------------------------------------------------

def case_mlp_layer_with_bias_on_a_mesh(rank, group):
    """A Llama MLP with biases, sharded over a 1-D DeviceMesh: down_proj's bias counted once."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = randomize(LlamaMLP(llama_config(mlp_bias=True)))
    ref = copy.deepcopy(mlp)
    report = parallelize(mlp, init_device_mesh("cpu", (2,)), patch=False)
    assert (report.tp, report.rank, report.mlp) == (2, rank, ["(root)"]), report
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.adds_bias == (rank == 0)
    assert type(mlp.gate_proj) is nn.Linear and mlp.gate_proj.weight.shape == (32, 32)
    torch.testing.assert_close(mlp.gate_proj.bias, ref.gate_proj.bias[rank * 32:(rank + 1) * 32], rtol=0, atol=0)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert_same(mlp(x), ref(x), "MLP")
    # A gradient through the collectives would be wrong: the backward refuses.
    y = mlp(x)
    try:
        y.sum().backward()
    except RuntimeError as e:
        assert "for inference" in str(e), e
    else:
        raise AssertionError("backward through a sharded MLP did not raise")


def case_attention_layer_with_biases(rank, group):
    """Llama attention with q/k/v and o biases (attention_bias=True), patched after sharding."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = llama_config(attention_bias=True)
    attn = randomize(LlamaAttention(config, layer_idx=0)).eval()
    ref = copy.deepcopy(attn)
    report = parallelize(attn, group)
    assert report.attention == ["(root)"] and report.patch.fused_qkv == ["(root)"], report
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.num_key_value_groups == 2
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(8))
    rope = LlamaRotaryEmbedding(config)
    pos = rope(x, torch.arange(6).view(1, -1))
    with torch.no_grad():
        assert_same(attn(x, pos, None)[0], ref(x, pos, None)[0], "attention")


def case_llama_gqa_one_kv_head(rank, group):
    """One KV head, two ranks: each keeps a copy of it; o_proj and down_proj biases once."""
    config = llama_config(num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    model, ref = causal_lm(config), causal_lm(config)
    report = parallelize(model, group)
    assert len(report.attention) == 2 and len(report.mlp) == 2 and report.lm_head == ["lm_head"], report
    assert len(report.patch.fused_qkv) == 2, report.patch
    # the decoder layers fuse with row-parallel O/down (on the CPU their stock forward runs)
    assert report.patch.fused_layers == ["model.layers.0", "model.layers.1"], report.patch
    assert not any("decoder layer" in why for _, why in report.patch.skipped), report.patch
    # gloo on the CPU: no symmetric memory, the sums go through the group's own all-reduce
    assert report.all_reduce == "nccl (the group's backend is gloo, not nccl)", report.all_reduce
    assert "sums: nccl (" in report.summary()
    attn, ref_attn = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    assert attn.num_key_value_groups == 2 and attn.q_proj.out_features == 16 and attn.k_proj.out_features == 8
    torch.testing.assert_close(attn.k_proj.weight, ref_attn.k_proj.weight, rtol=0, atol=0)  # the one KV head
    ids = token_ids(config.vocab_size)
    assert_same(logits(model, ids), logits(ref, ids), "Llama logits (Hkv=1 < tp=2)")


def case_qwen2_padded_vocab_state_dict(rank, group):
    """Qwen2 (q/k/v biases, 97-token vocabulary: 49 + 48 rows): logits, the stock state-dict
    keys with per-rank shapes, and load_full_state_dict into a differently seeded model."""
    config = qwen2_config()
    model, ref = causal_lm(config), causal_lm(config)
    stock_keys = list(ref.state_dict())
    report = parallelize(model, group)
    assert isinstance(model.lm_head, VocabParallelLinear) and model.lm_head.weight.shape == (49 - rank, 32)
    assert len(report.patch.fused_qkv) == 2
    ids = token_ids(config.vocab_size)
    assert_same(logits(model, ids), logits(ref, ids), "Qwen2 logits")

    sd = model.state_dict()
    assert list(sd) == stock_keys
    assert sd["model.layers.0.self_attn.q_proj.bias"].shape == (16,)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (8, 32)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (32, 16)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (32, 32)

    other = causal_lm(config, seed=SEED + 99)
    parallelize(other, group)
    assert not torch.allclose(logits(other, ids), logits(ref, ids))
    result = load_full_state_dict(other, ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    assert_same(logits(other, ids), logits(ref, ids), "Qwen2 logits after load_full_state_dict")


def case_mistral_logits(rank, group):
    config = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=96,
                                        max_position_embeddings=64, sliding_window=None, tie_word_embeddings=False)
    model, ref = causal_lm(config), causal_lm(config)
    report = parallelize(model, group)
    assert len(report.attention) == 2 and len(report.mlp) == 2 and report.lm_head == ["lm_head"], report
    ids = token_ids(config.vocab_size)
    assert_same(logits(model, ids), logits(ref, ids), "Mistral logits")


def case_tied_lm_head_stays_whole(rank, group):
    config = llama_config(tie_word_embeddings=True)
    model, ref = causal_lm(config), causal_lm(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    report = parallelize(model, group)
    assert report.lm_head == [] and any(n == "lm_head" and "tied" in r for n, r in report.skipped), report
    # (hybridgemm.patch may swap the head's class; it stays a whole nn.Linear, still tied)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = token_ids(config.vocab_size)
    assert_same(logits(model, ids), logits(ref, ids), "tied-head logits")


def _fused_kernels_on_cpu(calls: list):
    """The fused decoder-layer path on CPU tensors (Triton interpreter), as tests/
    tests/models/test_decode_step.py widens it; records each split-K launch's fusion. Returns an undo."""
    from hybridgemm import dispatch
    from hybridgemm.kernels import triton_splitk
    from hybridgemm.models import decode_checks

    config = triton_splitk.TritonSplitKConfig(16, 16, 32, split_k=2, num_warps=4, num_stages=2, fused_reduce=True)
    saved = [(decode_checks, "on_kernel_device"), (dispatch, "splitk_config"), (triton_splitk, "run"),
             (triton_splitk, "prologue_fits")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in saved]
    real_run = triton_splitk.run

    def run(cfg, *a, norm=None, residual=None, rope=None, **kw):
        calls.append("rope" if rope is not None else "norm" if norm is not None else
                     "residual" if residual is not None else "plain")
        return real_run(cfg, *a, norm=norm, residual=residual, rope=rope, **kw)

    decode_checks.on_kernel_device = lambda x: True
    dispatch.splitk_config = lambda x2, w, b, out, weight_format="": config
    triton_splitk.prologue_fits = lambda cfg, itemsize: True  # the norm prologue fused, as on the GPU's shape
    triton_splitk.run = run

    def undo():
        for mod, name, value in saved:
            setattr(mod, name, value)
    return undo


def _static_decode(model, ids, steps: int, tokens=None):
    """Greedy decode over a StaticCache: (last logits per step, tokens fed)."""
    from hybridgemm.perf import e2e_models as hf

    api, cache = hf.forward_api(model), hf.static_cache(model, ids.shape[0], 16)
    prompt = ids.shape[1]
    out = [hf.cached_forward(model, api, ids, cache, torch.arange(prompt))[:, -1]]
    fed = []
    for i in range(steps):
        tok = out[-1].argmax(-1, keepdim=True) if tokens is None else tokens[i]
        fed.append(tok)
        out.append(hf.cached_forward(model, api, tok, cache, torch.arange(prompt + i, prompt + i + 1))[:, -1])
    return out, fed


def case_fused_decoder_layers_over_ranks(rank, group):
    """Fused decoder layers with row-parallel O and down, kernels run (interpreter), biases
    everywhere, and the sums give the unsharded model's logits, in a plain forward and in a
    static-cache decode through the fused attention step. With torch's one-shot kernel
    (here: its fallback) rank 0's O/down GEMMs add the residual (and the bias), rank 1's add
    nothing: two KV heads (one per rank) and one (copied). With ``one_shot_kernel="push"``
    (on gloo: the push kernel's arithmetic over the collectives, fp32 sum plus the residual)
    no GEMM adds the residual, only rank 0's the bias, and the sums add it once."""
    for kernel, kv_heads in (("torch", 2), ("torch", 1), ("push", 2)):
        config = llama_config(hidden_size=64, intermediate_size=96, num_key_value_heads=kv_heads,
                              attention_bias=True, mlp_bias=True)
        config._attn_implementation = "sdpa"  # the fused attention step follows the model's SDPA
        model, ref = causal_lm(config), causal_lm(config)
        report = parallelize(model, group, one_shot_kernel=kernel)
        assert report.patch.fused_layers == ["model.layers.0", "model.layers.1"], report.patch
        assert report.patch.fused_attention == report.patch.fused_layers, report.patch
        assert report.all_reduce.startswith("nccl (the group's backend is gloo"), report.all_reduce
        rows = [m for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
        assert len(rows) == 4 and all(m.sums_residual == (kernel == "push") for m in rows), rows
        what = f"(Hkv={kv_heads}, {kernel} kernel)"
        calls: list = []
        undo = _fused_kernels_on_cpu(calls)
        try:
            ids = token_ids(config.vocab_size, (2, 5))  # 10 rows: the fused path (no cache: the module's attention)
            assert_same(logits(model, ids), logits(ref, ids), f"fused logits {what}")
            # per layer: QKV with the norm; O and down with the residual on rank 0 (torch's
            # kernel), else plain (the push kernel's sum adds it)
            part = "residual" if rank == 0 and kernel == "torch" else "plain"
            assert calls == ["norm", part, part] * 2, calls
            calls.clear()
            if kv_heads == 2:  # compiled: the fused ops (a down with no residual) and the sums traced
                compiled = torch.compile(model, backend="aot_eager")
                with torch.no_grad():
                    assert_same(compiled(input_ids=ids, use_cache=False).logits, logits(ref, ids),
                                f"compiled fused {what}")
                assert calls == ["norm", part, part] * 2, calls
                calls.clear()
                torch._dynamo.reset()
            with torch.no_grad():
                want, fed = _static_decode(ref, ids[:, :3], steps=2)  # the second step reads the first's cache
                got, _ = _static_decode(model, ids[:, :3], steps=2, tokens=fed)
            for step, (g, w) in enumerate(zip(got, want)):
                assert_same(g, w, f"static-cache decode step {step} {what}")
            # the 6-row prefill as above; then each step of each layer: QKV with the rotary and
            # cache write, O and down
            assert calls == ["norm", part, part] * 2 + ["rope", part, part] * 2 * 2, calls
        finally:
            undo()


def case_residual_sum_is_the_rank_order_sum(rank, group):
    """Where the push kernel cannot take a sum (here: gloo), ``sum_parts_residual`` computes
    what the kernel does, bit for bit: the ranks' bf16 parts summed in fp32 in rank order, the
    residual added, one rounding; eagerly and compiled. ``tp_sum_residual`` itself refuses a
    group without the push kernel."""
    from hybridgemm.parallel import collectives

    torch.manual_seed(SEED)
    model = randomize(MlpWithHead())
    parallelize(model, group, patch=False, one_shot_kernel="push")
    down = model.down_proj
    assert isinstance(down, RowParallelLinear) and down.sums_residual and not down.one_shot
    gen = torch.Generator().manual_seed(50 + rank)  # each rank its own part
    same = torch.Generator().manual_seed(60)  # the residual: the same on every rank
    compiled = torch.compile(down.sum_parts_residual, fullgraph=True, backend="aot_eager")
    for shape in ((1, 32), (3, 5, 32), (17, 32)):
        y = torch.randn(shape, generator=gen).to(torch.bfloat16)
        r = (torch.randn(shape, generator=same) * 64).to(torch.bfloat16)
        parts = [torch.empty_like(y) for _ in range(2)]
        dist.all_gather(parts, y, group=group)
        want = rank_order_sum(parts, r)
        with torch.no_grad():
            assert torch.equal(down.sum_parts_residual(y, r), want), shape
            assert torch.equal(compiled(y, r), want), f"compiled {shape}"
        # the other order, the residual rounded into rank 0's part first, differs somewhere
        other = rank_order_sum([(parts[0].float() + r.float()).to(torch.bfloat16), parts[1]])
        assert not torch.equal(other, want), shape
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="tp_sum_residual needs the push kernel"):
        collectives.tp_sum_residual(y, r, group.group_name)


def case_compiled_fullgraph(rank, group):
    """Row-parallel MLP and vocab-parallel head under torch.compile(fullgraph=True)."""
    torch.manual_seed(SEED)
    model = randomize(MlpWithHead())
    ref = copy.deepcopy(model)
    report = parallelize(model, group, patch=False)
    assert report.mlp == ["(root)"] and report.lm_head == ["lm_head"], report
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_same(compiled(x), ref(x), "compiled MLP + head")
        assert_same(model(x), ref(x), "eager MLP + head")


CASES = {f.__name__[len("case_"):]: f for f in (
    case_mlp_layer_with_bias_on_a_mesh, case_attention_layer_with_biases, case_llama_gqa_one_kv_head,
    case_qwen2_padded_vocab_state_dict, case_mistral_logits, case_tied_lm_head_stays_whole,
    case_fused_decoder_layers_over_ranks, case_residual_sum_is_the_rank_order_sum, case_compiled_fullgraph)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every case run once on two gloo ranks."""
    return run_on_two_ranks(list(CASES.values()), "gloo", tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks(two_ranks, case):
    assert_ranks_ok(two_ranks[CASES[case].__name__])


# --- one process: a fake group gives it a rank in a larger one ---------------------------

@pytest.fixture
def fake_group():
    """``fake_group(world_size, rank)``: this process as ``rank`` of a group whose
    collectives do nothing (enough to shard, not to run)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int, rank: int = 0):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        return dist.group.WORLD

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_not_a_module_is_a_type_error():
    for bad, needle in ((None, "got None"), (nn.Linear, "pass an instance"), ("model", "got str")):
        with pytest.raises(TypeError, match=needle):
            parallelize(bad)
    with pytest.raises(TypeError, match="not an initialised nn.Module"):
        parallelize(nn.Module.__new__(nn.Module))


def test_group_must_be_a_group_or_mesh_and_distributed_initialised():
    model = causal_lm(llama_config())
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or None"):
        parallelize(model, "nccl")
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize(model)
    with pytest.raises(TypeError, match="fuse_qkv given with patch=False"):
        parallelize(model, patch=False, fuse_qkv=False)


def test_mesh_must_be_one_dimensional(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    model = causal_lm(llama_config())
    with pytest.raises(ValueError, match=r"1-D DeviceMesh .* 2-D mesh of shape \(2, 2\)"):
        parallelize(model, init_device_mesh("cpu", (2, 2)))


@pytest.mark.parametrize("tp, config, needle", [
    (3, dict(), "tp=3 does not divide the 4 attention heads"),
    # 12 heads over 6 ranks is 2 each, but 4 KV heads are neither a multiple nor a divisor of 6
    (6, dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=4), "does not fit the 4 key/value heads"),
    (2, dict(intermediate_size=33), "does not divide the intermediate size 33"),
    (4, dict(vocab_size=3), "vocabulary of 3 is too small"),
])
def test_sizes_that_do_not_split_are_clear_errors_and_change_nothing(fake_group, tp, config, needle):
    group = fake_group(tp)
    model = causal_lm(llama_config(**config))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=needle) as info:
        parallelize(model, group)
    assert str(info.value).startswith("hybridgemm.parallelize: model.") or "lm_head" in str(info.value)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert type(model.model.layers[0].self_attn.o_proj) is nn.Linear


def test_group_of_one_shards_nothing_but_patches(fake_group):
    group = fake_group(1)
    model = causal_lm(llama_config())
    ref = causal_lm(llama_config())
    report = parallelize(model, group)
    assert (report.tp, report.rank, report.attention, report.mlp, report.lm_head) == (1, 0, [], [], [])
    assert len(report.patch.fused_qkv) == 2
    ids = token_ids(96)
    assert_same(logits(model, ids), logits(ref, ids), "tp=1 logits")


def test_each_rank_keeps_its_heads_rows_and_columns(fake_group):
    """Rank 3 of 4, 8 query heads of 4 in 2 GQA groups: heads 6-7, which read KV head 1;
    intermediate 64 -> columns 48-63; vocabulary 10 -> rows 9 (3 per rank, the last has 1)."""
    group = fake_group(4, rank=3)
    config = llama_config(num_attention_heads=8, num_key_value_heads=2, vocab_size=10, attention_bias=True)
    model, ref = causal_lm(config), causal_lm(config)
    report = parallelize(model, group, patch=False)
    assert (report.rank, report.tp, len(report.attention), len(report.mlp), report.lm_head) == (3, 4, 2, 2, ["lm_head"])
    a, r = model.model.layers[1].self_attn, ref.model.layers[1].self_attn
    eq = lambda t, u: torch.testing.assert_close(t, u, rtol=0, atol=0)  # noqa: E731
    eq(a.q_proj.weight, r.q_proj.weight[24:32])
    eq(a.q_proj.bias, r.q_proj.bias[24:32])
    eq(a.k_proj.weight, r.k_proj.weight[4:8])
    eq(a.v_proj.bias, r.v_proj.bias[4:8])
    eq(a.o_proj.weight, r.o_proj.weight[:, 24:32])
    eq(a.o_proj.bias, r.o_proj.bias)  # whole on every rank; only rank 0 adds it
    assert not a.o_proj.adds_bias and a.num_key_value_groups == 2
    m, rm = model.model.layers[1].mlp, ref.model.layers[1].mlp
    eq(m.up_proj.weight, rm.up_proj.weight[48:64])
    eq(m.down_proj.weight, rm.down_proj.weight[:, 48:64])
    eq(model.lm_head.weight, ref.lm_head.weight[9:10])
    assert (model.lm_head.rows, model.lm_head.vocab) == (3, 10)


def test_state_dict_keys_and_loading_a_full_one(fake_group):
    group = fake_group(2, rank=1)
    config = qwen2_config()
    model, ref = causal_lm(config), causal_lm(config, seed=SEED + 5)
    parallelize(model, group)
    assert list(model.state_dict()) == list(ref.state_dict())
    full = ref.state_dict()
    load_full_state_dict(model, full)
    sd = model.state_dict()
    key = "model.layers.1.self_attn.q_proj.bias"
    torch.testing.assert_close(sd[key], full[key][16:])
    torch.testing.assert_close(sd["lm_head.weight"], full["lm_head.weight"][49:])
    torch.testing.assert_close(sd["model.norm.weight"], full["model.norm.weight"])
    # An already sharded state dict is not a full one: the error names the key.
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight: expected the full"):
        load_full_state_dict(model, sd)


def test_a_second_parallelize_changes_nothing(fake_group):
    group = fake_group(2)
    model = causal_lm(llama_config())
    parallelize(model, group)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning):
        report = parallelize(model, group)
    assert report.attention == report.mlp == report.lm_head == []
    assert all("already sharded" in r for _, r in report.skipped)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_one_shot_needs_an_enabled_nccl_group(fake_group):
    from hybridgemm.parallel import collectives

    group = fake_group(2, 0)
    why = collectives.enable_one_shot(group)
    assert why == "the group's backend is fake, not nccl", why
    assert collectives.enable_one_shot(group, max_bytes=0) == "disabled (max_bytes <= 0)"
    assert collectives.one_shot_capacity(group) == 0
    assert not collectives.fits_one_shot(torch.ones(2, 8), group.group_name)
    # a group with one-shot disabled by the caller reports it, and still shards
    model = causal_lm(llama_config())
    report = parallelize(model, group, one_shot_bytes=0, patch=False)
    assert report.attention and report.all_reduce == "nccl (disabled (max_bytes <= 0))", report.all_reduce
    # an unknown one-shot kernel: a clear error, nothing changed
    with pytest.raises(ValueError, match=r"one-shot kernel 'nvls' is not one of \('torch', 'push'\)"):
        collectives.enable_one_shot(group, kernel="nvls")
    fresh = causal_lm(llama_config())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match="one_shot_kernel must be one of"):
        parallelize(fresh, group, one_shot_kernel="nvls")
    after = fresh.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_lazy_exports():
    assert hybridgemm.parallelize is parallelize and hybridgemm.load_full_state_dict is load_full_state_dict
    assert "parallelize" in hybridgemm.__all__ and "parallel" in dir(hybridgemm)
    with pytest.raises(AttributeError):
        hybridgemm.no_such_name  # noqa: B018


def test_each_presets_whole_parts_are_what_parallelize_leaves_whole():
    """A preset's ``tp_whole`` (what ``rank_projections`` keeps at full size) names exactly the
    decoder-layer parts parallelize does not split in the model the preset's config builds."""
    transformers = pytest.importorskip("transformers")
    from hybridgemm.autotune_cache.presets import PRESETS
    from hybridgemm.parallel.tensor_parallel import split_parts
    from hybridgemm.perf import e2e_models as hf

    own = {"gpt2": lambda: transformers.GPT2Config(n_layer=1),  # (no bench config: these two built here)
           "bert-base": lambda: transformers.BertConfig(num_hidden_layers=1)}
    checked = 0
    for name, preset in PRESETS.items():
        try:
            cfg = own[name]() if name in own else hf.hf_config(name, layers=1)
        except ValueError:  # (a preset without a model config in the benches: Mistral)
            continue
        with torch.device("meta"):
            auto = transformers.AutoModel if name == "bert-base" else transformers.AutoModelForCausalLM
            model = auto.from_config(cfg)
        layer_parts = {"attention"} | (set() if preset.moe else {"mlp"})
        assert layer_parts - split_parts(model, 2) == set(preset.tp_whole), name
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name, parts", [("llama3-8b", {"attention", "mlp", "lm_head"}),
                                         ("pythia-6.9b", {"lm_head"}), ("phi3-mini", {"lm_head"})])
def test_split_parts_names_what_parallelize_splits(name, parts):
    """The parts of a meta model parallelize splits (GPT-NeoX's and Phi-3's layers it leaves
    whole, only an LM head named lm_head split by rows); a size that does not split is its error."""
    transformers = pytest.importorskip("transformers")
    from hybridgemm.parallel.tensor_parallel import split_parts
    from hybridgemm.perf import e2e_models as hf

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.hf_config(name, layers=2))
    if "lm_head" not in model._modules:  # (GPT-NeoX's head is embed_out in older transformers, 5.8.1: left whole)
        parts = parts - {"lm_head"}
    assert split_parts(model, 2) == parts
    if name == "llama3-8b":
        with pytest.raises(ValueError, match="tp=3 does not divide the 32 attention heads"):
            split_parts(model, 3)



class _OnePart(PartialSumLinear):
    """A row-parallel linear of one part: its sums are the part itself."""

    def __init__(self, weight, bias, adds_bias, sums_residual):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        self.adds_bias, self.sums_residual = adds_bias, sums_residual

    def sum_parts(self, y):
        return y

    def sum_parts_residual(self, y, residual):
        return residual + y


@pytest.mark.parametrize("adds_bias,sums_residual", [(True, False), (False, False), (False, True), (True, True)])
def test_a_row_parallel_projection_adds_the_second_residual_after_its_sum(adds_bias, sums_residual):
    """decode_step.project_add(..., residual2=x) over a row-parallel projection: its sum holds
    the first residual where this part adds it (with the bias, or in the residual-summing
    collective), then x is added to the sum."""
    torch.manual_seed(0)
    w, b = torch.randn(24, 40), torch.randn(24)
    proj = _OnePart(w, b, adds_bias, sums_residual)
    x, a, r2 = torch.randn(3, 40), torch.randn(3, 24), torch.randn(3, 24) * 300
    with torch.no_grad():
        got = decode_step.project_add(proj, x, a, None, residual2=r2)
        y = F.linear(x, w, b if adds_bias else None)
    first = a + y if adds_bias or sums_residual else y  # (a part without the bias leaves a to the one with it)
    assert torch.equal(got, first + r2)
