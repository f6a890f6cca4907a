"""Batch-invariant mode (fusion/modes.py): each output row is bit-identical whatever M.

CPU part: the mode API, the fixed-config rule (independent of M, never split-K, one load
path), the decision built on it (the device's limits; PyTorch when no config takes the
problem), and the Triton tiled kernel with that config under the interpreter (fp16/fp32; bf16's
interpreter dot is wrong, see test_triton_gemm.py): rows of an M = 1 call against the same
rows inside M = 7, 64 and 130 calls, compared with torch.equal. A sensitivity test shows the
same comparison fails for a split-K config, so the check can catch what it guards against.
GPU part (marker ``gpu``): the same through ``hybridgemm.linear`` at M up to 4096, llama-like
and odd shapes, misaligned inputs, the attention projections, and the default mode untouched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_device import H200_LIMITS

import hybridgemm
from helpers import check_close_to_reference, make_operands, poisoned
from hybridgemm import decide, dispatch, explain, modes
from hybridgemm.decide import Choice
from hybridgemm.kernels import backends
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CPU_MS = (1, 7, 64, 130)
GPU_MS = (1, 7, 64, 1000, 4096)


@pytest.fixture(autouse=True)
def _default_mode_around_each_test():
    """Every test starts and ends in the default mode (the mode is process-global)."""
    hybridgemm.set_mode("default")
    yield
    hybridgemm.set_mode("default")


def _problem(m, n, k, dtype, bias=True, act=Activation.NONE, **layout):
    return Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(act, bias), ldx=layout.pop("ldx", k), ldw=k,
                   ldo=n, **layout)


def _cfg(m, n, k, dtype, bias=True, act=Activation.NONE):
    cfg, why = modes.fixed_config(_problem(m, n, k, dtype, bias, act))
    assert cfg is not None, why
    return cfg


def _assert_prefix_rows_equal(outs: dict[int, torch.Tensor], what: str) -> None:
    """Rows of each smaller-M call equal (bitwise) the same rows of every larger-M call."""
    ms = sorted(outs)
    for i, small in enumerate(ms):
        for big in ms[i + 1:]:
            a, b = outs[small], outs[big][:small]
            if not torch.equal(a, b):
                bad = (a != b).any(dim=-1).nonzero().flatten().tolist()
                raise AssertionError(f"{what}: rows {bad[:8]} of the M={small} call differ from the M={big} call")


# ----------------------------------------------------------------------------- mode API


def test_set_get_mode_and_bad_name():
    assert hybridgemm.get_mode() == "default"
    assert hybridgemm.set_mode("batch_invariant") == "default"
    assert hybridgemm.get_mode() == "batch_invariant"
    assert hybridgemm.set_mode("default") == "batch_invariant"
    with pytest.raises(ValueError, match="valid modes: 'default', 'batch_invariant'") as e:
        hybridgemm.set_mode("batch-invariant")
    assert "'batch-invariant'" in str(e.value)
    assert hybridgemm.get_mode() == "default"  # a bad name changes nothing
    for name in ("get_mode", "set_mode", "mode"):
        assert name in hybridgemm.__all__


def test_context_manager_restores_the_previous_mode_even_on_error():
    with hybridgemm.mode("batch_invariant") as m:
        assert m == "batch_invariant" == hybridgemm.get_mode()
        with hybridgemm.mode("default"):
            assert hybridgemm.get_mode() == "default"
        assert hybridgemm.get_mode() == "batch_invariant"
    assert hybridgemm.get_mode() == "default"
    with pytest.raises(RuntimeError, match="boom"):
        with hybridgemm.mode("batch_invariant"):
            raise RuntimeError("boom")
    assert hybridgemm.get_mode() == "default"
    hybridgemm.set_mode("batch_invariant")
    with pytest.raises(KeyError):
        with hybridgemm.mode("default"):
            raise KeyError("x")
    assert hybridgemm.get_mode() == "batch_invariant"
    with pytest.raises(ValueError, match="valid modes"):
        with hybridgemm.mode("fast"):
            pass
    assert hybridgemm.get_mode() == "batch_invariant"


def test_each_mode_has_its_own_decision_caches():
    default_caches = dispatch._MODE_CACHES["default"]
    assert {c.mode for c in default_caches} == {"default"}
    assert dispatch._launchers[0] is default_caches[1]
    default_caches[1]["sentinel"] = "a default-mode launcher"
    before = dispatch.generation()
    with hybridgemm.mode("batch_invariant"):
        assert dispatch.generation() == before + 1  # launches cached outside dispatch go stale too
        fast = dispatch._launchers[0]
        assert fast is dispatch._MODE_CACHES["batch_invariant"][1] and fast is not default_caches[1]
        assert {c.mode for c in dispatch._MODE_CACHES["batch_invariant"]} == {"batch_invariant"}
        assert "sentinel" not in fast  # a default decision is never seen here
        fast["other"] = "a batch-invariant launcher"
    assert dispatch._launchers[0] is default_caches[1] and "other" not in default_caches[1]
    assert dispatch.generation() == before + 2 and default_caches[1]["sentinel"]  # kept across the switch
    decide.reload_tables()  # forgets every mode's decisions
    assert all(len(c) == 0 for caches in dispatch._MODE_CACHES.values() for c in caches)


def test_cpu_tensors_use_torch_as_in_default_mode():
    x, w, b = make_operands(5, 24, 40, torch.float32, "cpu")
    ref = hybridgemm.linear(x, w, b, "relu")
    with hybridgemm.mode("batch_invariant"):
        assert torch.equal(hybridgemm.linear(x, w, b, "relu"), ref)


# ----------------------------------------------------------------------------- the fixed config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (6144, 4096), (10240, 8192), (1000, 1003),
                                 (48, 40), (96, 76), (8, 8)])
@pytest.mark.parametrize("act", [Activation.NONE, Activation.GELU])
def test_fixed_config_is_one_per_shape_never_split_and_valid_for_every_m(dtype, n, k, act):
    ms = (1, 2, 7, 64, 130, 1000, 4096, 16384, 1 << 20)
    # x's layout and alignment vary from call to call; they must not change the config either.
    layouts = ({"ldx": k}, {"ldx": k + 3, "align_x": 2}, {"ldx": k + 8, "align_x": 16})
    configs = {modes.fixed_config(_problem(m, n, k, dtype, True, act, **lay))[0] for m in ms for lay in layouts}
    assert len(configs) == 1, configs
    cfg = configs.pop()
    assert cfg is not None
    assert cfg.split_k == 1 and cfg.block_k == min(128 // torch.empty((), dtype=dtype).element_size(),
                                                    max(16, 1 << (k - 1).bit_length()))
    e = torch.empty((), dtype=dtype).element_size()
    # TMA only where every M can use it: the one-row relaxation (a 1 x K x with K*e not a
    # multiple of 16 bytes) must not make M = 1 take another load path than M = 2.
    assert cfg.use_tma == ((k * e) % 16 == 0 and (n * e) % 16 == 0)
    for m in ms:  # and the config is valid for every M with a dense x
        if m * k < 2**31 and m * n < 2**31:
            ok, why = cfg.supports(_problem(m, n, k, dtype, True, act))
            assert ok, f"M={m}: {why}"


def test_fixed_config_rule_tiles():
    big = _cfg(1, 4096, 4096, torch.bfloat16)
    assert (big.block_m, big.block_n, big.block_k, big.num_stages, big.num_warps) == (128, 256, 64, 4, 8)
    assert big.epilogue_subtile and big.persistent and big.use_tma
    for n in (8192, 10240):
        assert _cfg(1, n, 8192, torch.bfloat16).block_n == 256
    # N = 6144: 192 tiles of 128 x 256 at M = 1024 fill 73% of the second wave on 132 SMs, so
    # 128 x 128; on a 96-SM device the same tiles make two full waves
    assert _cfg(1, 6144, 4096, torch.bfloat16).block_n == 128
    assert {modes.fixed_config(_problem(m, 6144, 4096, torch.bfloat16), num_sms=96)[0].block_n
            for m in (1, 4096)} == {256}
    kv = _cfg(1, 1024, 4096, torch.bfloat16)
    assert (kv.block_m, kv.block_n, kv.block_k) == (128, 128, 64)
    f32 = _cfg(1, 4096, 4096, torch.float32)
    assert (f32.block_m, f32.block_n, f32.block_k) == (128, 128, 32)
    narrow = _cfg(1, 48, 40, torch.float16)
    assert (narrow.block_n, narrow.block_k) == (64, 64)
    # a device with less shared memory gets a smaller tile, still the same for every M
    small = {modes.fixed_config(_problem(m, 4096, 4096, torch.bfloat16), smem_limit=101376,
                                capability=(8, 6))[0] for m in (1, 4096)}
    assert len(small) == 1 and not next(iter(small)).use_tma
    # W spanning 2**31 elements: no config for any M (documented PyTorch fallback)
    cfg, why = modes.fixed_config(_problem(1, 1 << 20, 1 << 12, torch.bfloat16))
    assert cfg is None and "2**31" in why


def test_needs_dense_x():
    tma, ptr = _cfg(4, 96, 72, torch.float16), _cfg(4, 96, 76, torch.float16)
    assert tma.use_tma and not ptr.use_tma
    buf = torch.zeros(4 * 80 + 8, dtype=torch.float16)
    dense = buf[:4 * 72].view(4, 72)
    assert not modes.needs_dense_x(tma, dense)
    assert modes.needs_dense_x(tma, buf[1:1 + 4 * 72].view(4, 72))  # 2-byte aligned pointer
    assert modes.needs_dense_x(tma, buf[:4 * 76].view(4, 76)[:, :72])  # 152-byte row stride
    assert not modes.needs_dense_x(ptr, buf[1:1 + 4 * 76].view(4, 76))


# ----------------------------------------------------------------------------- the decision

WIDE = Problem(m=16, n=4096, k=4096, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True),
               ldx=4096, ldw=4096, ldo=4096)
TOO_BIG = dataclasses.replace(WIDE, n=65536, k=65536, ldx=65536, ldw=65536, ldo=65536)


def test_batch_invariant_rule_without_a_device_assumes_hopper():
    choice = modes.batch_invariant_choice(WIDE, None)
    assert choice == Choice("triton_gemm", modes.fixed_config(WIDE)[0], modes.SOURCE,
                            "linear|bf16|bias|N=4096|K=4096|c at M=16", modes.rule_text(WIDE))


def test_batch_invariant_rule_uses_the_devices_limits(monkeypatch):
    asked = []
    monkeypatch.setattr(backends, "device_limits", lambda index: (asked.append(index), dict(H200_LIMITS))[1])
    monkeypatch.setattr(backends, "num_sms", lambda index: (asked.append(index), 100)[1])
    few_sms = modes.fixed_config(WIDE, **H200_LIMITS, num_sms=100)[0]
    assert few_sms != modes.fixed_config(WIDE, **H200_LIMITS, num_sms=132)[0]  # the SM count matters here
    choice = modes.batch_invariant_choice(WIDE, 2)
    assert (choice.backend, choice.config, choice.source) == ("triton_gemm", few_sms, modes.SOURCE)
    assert asked == [2, 2]


def test_batch_invariant_rule_falls_back_to_pytorch_and_says_why(monkeypatch):
    assert modes.batch_invariant_choice(TOO_BIG, None) == Choice(
        "torch", None, modes.SOURCE, "linear|bf16|bias|N=65536|K=65536|c at M=16",
        "no Triton config takes this problem (a tensor spans more than 2**31 elements (the kernels use 32-bit "
        "offsets)); PyTorch computes it, deterministic but NOT batch-invariant")

    def no_triton(problem, **limits):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(modes, "fixed_config", no_triton)
    choice = modes.batch_invariant_choice(WIDE, None)
    assert (choice.backend, choice.config) == ("torch", None)
    assert choice.reason == ("no Triton config takes this problem (Triton is not available (No module named "
                             "'triton')); PyTorch computes it, deterministic but NOT batch-invariant")


def test_explain_says_batch_invariant_and_the_config_is_the_same_for_every_m():
    lines = {}
    with hybridgemm.mode("batch_invariant"):
        for m in (1, 7, 4096):
            text = explain((m, 4096), (4096, 4096), "bf16", activation="relu")
            assert f"M={m} N=4096 K=4096" in text
            lines[m] = next(line for line in text.splitlines() if "batch_invariant mode:" in line)
    assert len(set(lines.values())) == 1
    line = lines[1]
    assert "batch_invariant mode: triton_gemm [block_m=128 block_n=256 block_k=64" in line
    assert "split_k=1" in line and "same kernel for every M" in line
    if not torch.cuda.is_available():
        assert "not guaranteed batch-invariant" in line
    assert "batch_invariant" not in explain((1, 4096), (4096, 4096))  # default mode


# ----------------------------------------------------------------------------- the kernel (interpreter or GPU)


def _run_fixed(x, w, b, act, out=None):
    """The mode's kernel on any device (the interpreter on a CPU machine), into a poisoned out."""
    cfg, why = modes.fixed_config(Problem.from_tensors(x, w, b, torch.empty(0, w.shape[0], dtype=x.dtype),
                                                       Epilogue(act, b is not None)))
    assert cfg is not None and cfg.split_k == 1, why
    if modes.needs_dense_x(cfg, x):
        x = x.clone()
    out = poisoned((x.shape[0], w.shape[0]), x.dtype, x.device) if out is None else out
    modes.run(cfg, x, w, b, out, act)
    assert not out.isnan().any(), "some outputs were never written"
    return out


# (N, K): the first pair has K*2 and K*4 multiples of 16 bytes (TMA), the second does not
# (pointer path), neither K is a multiple of 64.
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 72), (48, 75)])
@pytest.mark.parametrize("bias,act", [(True, Activation.NONE), (True, Activation.RELU),
                                      (False, Activation.GELU)])
def test_rows_bitwise_equal_across_m(device, no_tf32, dtype, n, k, bias, act):
    x_all, w, b = make_operands(max(CPU_MS), n, k, dtype, device, bias=bias)
    outs = {m: _run_fixed(x_all[:m], w, b, act) for m in CPU_MS}
    _assert_prefix_rows_equal(outs, f"{dtype} N={n} K={k} {act.value}")
    # a row taken on its own (a pointer into the middle of x) is the same as inside the batch
    for i in (5, 129):
        assert torch.equal(_run_fixed(x_all[i:i + 1], w, b, act)[0], outs[130][i])
    check_close_to_reference(outs[130], x_all, w, b, act, f"{dtype} N={n} K={k}")


def test_the_bitwise_check_catches_a_split_k_config(device):
    """What the mode rules out, shown to be caught: split K changes the reduction order, and
    the comparison used above sees it (so it can fail)."""
    from hybridgemm.kernels.triton_gemm import TritonGemmConfig

    x, w, b = make_operands(64, 64, 256, torch.float16, device)
    fixed = _run_fixed(x, w, b, Activation.NONE)
    split = TritonGemmConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=2,
                             persistent=False, use_tma=False, split_k=2)
    out = poisoned((64, 64), torch.float16, device)
    from hybridgemm.kernels import triton_gemm

    triton_gemm.run(split, x, w, b, out)
    assert not torch.equal(out, fixed)
    with pytest.raises(AssertionError, match="rows .* differ"):
        _assert_prefix_rows_equal({64: out, 65: torch.cat([fixed, fixed[:1]])}, "split vs fixed")


def test_row_chunks_past_32_bit_offsets_change_no_row(device, monkeypatch):
    # Chunks of whole row tiles (as if block_m rows hit 2**31), the last one partial: each row
    # keeps its place in its tile, so any difference is the chunking's (the interpreter's
    # numpy dot is not bitwise the same for a row at another place in its tile).
    n, k = 48, 72
    x, w, b = make_operands(1, n, k, torch.float16, device)
    cfg, _ = modes.fixed_config(Problem.from_tensors(x, w, b, torch.empty(0, n, dtype=x.dtype),
                                                     Epilogue(Activation.RELU, True)))
    x, w, b = make_operands(2 * cfg.block_m + 24, n, k, torch.float16, device)
    whole = _run_fixed(x, w, b, Activation.RELU)
    chunks = []
    monkeypatch.setattr(modes, "_chunk_rows", lambda x, out: chunks.append(x.shape[0]) or cfg.block_m)
    assert torch.equal(_run_fixed(x, w, b, Activation.RELU), whole)
    assert chunks == [x.shape[0]]  # the chunked path ran (three launches)


# ----------------------------------------------------------------------------- GPU, through the dispatcher


def _poison_allocator(nbytes: int) -> None:
    """Fill freed blocks of torch's caching allocator with NaN so that outputs the dispatcher
    allocates start as NaN (unwritten elements would show)."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device="cuda")


def _linear_at_each_m(x_all, w, b, act, ms=GPU_MS):
    outs = {}
    for m in ms:
        _poison_allocator(m * w.shape[0] * x_all.element_size() + (1 << 20))
        outs[m] = hybridgemm.linear(x_all[:m], w, b, act)
        assert not outs[m].isnan().any(), f"M={m}: unwritten outputs"
    return outs


def _bi_choices(n, k):
    choices = dispatch._MODE_CACHES["batch_invariant"][0]
    return {c for (dev, p), c in choices.items() if (p.n, p.k) == (n, k)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096)])
@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_gpu_rows_bitwise_equal_across_m(dtype, n, k, act):
    decide.reload_tables()
    x_all, w, b = make_operands(max(GPU_MS), n, k, dtype, "cuda")
    with hybridgemm.mode("batch_invariant"):
        outs = _linear_at_each_m(x_all, w, b, act)
        one_row = hybridgemm.linear(x_all[777:778], w, b, act)  # a row sliced out of a batch
    _assert_prefix_rows_equal(outs, f"{dtype} N={n} K={k} {act}")
    assert torch.equal(one_row[0], outs[4096][777])
    choices = _bi_choices(n, k)
    assert len({(c.backend, c.config) for c in choices}) == 1, choices  # one config for every M
    c = next(iter(choices))
    assert c.backend == "triton_gemm" and c.config.split_k == 1 and c.source == "batch_invariant"
    check_close_to_reference(outs[1000], x_all[:1000], w, b, act, f"{dtype} N={n} K={k} {act}")


@pytest.mark.gpu
def test_gpu_odd_shape_takes_the_pointer_path_for_every_m():
    n, k = 1000, 1003  # K*2 bytes not a multiple of 16: no TMA for M > 1, so none for M = 1 either
    x_all, w, b = make_operands(1000, n, k, torch.bfloat16, "cuda")
    with hybridgemm.mode("batch_invariant"):
        outs = _linear_at_each_m(x_all, w, b, "relu", ms=(1, 7, 64, 1000))
        rows = [hybridgemm.linear(x_all[i:i + 1], w, b, "relu") for i in (1, 3, 999)]  # misaligned pointers
        text = explain((1, k), (n, k), "bf16", activation="relu")
    _assert_prefix_rows_equal(outs, "N=1000 K=1003")
    for i, row in zip((1, 3, 999), rows):
        assert torch.equal(row[0], outs[1000][i])
    assert "use_tma=False" in text and "split_k=1" in text
    check_close_to_reference(outs[1000], x_all, w, b, "relu", "N=1000 K=1003")


@pytest.mark.gpu
def test_gpu_misaligned_x_is_copied_not_rerouted():
    n, k = 1024, 4096
    buf = torch.randn(64, k + 1, device="cuda").bfloat16()
    x = buf[:, 1:]  # 2-byte aligned, row stride 8194 bytes: TMA cannot describe it
    _, w, b = make_operands(1, n, k, torch.bfloat16, "cuda")
    with hybridgemm.mode("batch_invariant"):
        skew = hybridgemm.linear(x, w, b)
        again = hybridgemm.linear(x, w, b)  # the second call must not take a stale fast path
        dense = hybridgemm.linear(x.contiguous(), w, b)
        first = hybridgemm.linear(x[:1].contiguous(), w, b)
    assert torch.equal(skew, dense) and torch.equal(again, dense) and torch.equal(first[0], dense[0])


@pytest.mark.gpu
def test_gpu_fp32_rows_bitwise_equal(no_tf32):
    x_all, w, b = make_operands(1000, 512, 384, torch.float32, "cuda")
    with hybridgemm.mode("batch_invariant"):
        outs = _linear_at_each_m(x_all, w, b, "gelu", ms=(1, 7, 64, 1000))
    _assert_prefix_rows_equal(outs, "fp32")
    check_close_to_reference(outs[1000], x_all, w, b, "gelu", "fp32")


@pytest.mark.gpu
def test_gpu_attention_projections_are_batch_invariant():
    torch.manual_seed(0)
    proj = hybridgemm.AttentionProjection(512, 8, 2, qkv_bias=True, out_bias=True, device="cuda",
                                          dtype=torch.bfloat16)
    x = torch.randn(6, 37, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), hybridgemm.mode("batch_invariant"):
        q6, k6, v6 = proj.forward_qkv(x)
        q1, k1, v1 = proj.forward_qkv(x[2:3])
        o6 = proj.forward_out(q6)
        o1 = proj.forward_out(q6[2:3])
    for big, one in ((q6, q1), (k6, k1), (v6, v1), (o6, o1)):
        assert torch.equal(big[2:3], one)


@pytest.mark.gpu
def test_gpu_default_mode_is_unaffected():
    decide.reload_tables()
    x, w, b = make_operands(16, 4096, 4096, torch.bfloat16, "cuda")
    before = hybridgemm.linear(x, w, b)
    text_before = explain((16, 4096), (4096, 4096))
    with hybridgemm.mode("batch_invariant"):
        invariant = hybridgemm.linear(x, w, b)
    after = hybridgemm.linear(x, w, b)
    assert torch.equal(before, after)
    assert explain((16, 4096), (4096, 4096)) == text_before and "batch_invariant" not in text_before
    dev = torch.cuda.current_device()
    p = Problem.from_tensors(x, w, b, torch.empty_like(before), Epilogue(Activation.NONE, True))
    cached, fresh = dispatch._MODE_CACHES["default"][0][(dev, p)], decide.choose(p, dev)
    assert (cached.backend, cached.source, cached.key) == (fresh.backend, fresh.source, fresh.key)
    check_close_to_reference(invariant, x, w, b, None, "batch_invariant M=16")
