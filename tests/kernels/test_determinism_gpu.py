"""Determinism of every dispatched path, on the GPU (``pytest -m gpu``).

For each path — cuBLASLt (heuristic algorithm, and an algorithm restored from a table record),
the Triton tiled GEMM (persistent TMA, plain pointer, fixed-order split-K), the Triton split-K
decode kernel (no split, two-pass, fused single-pass reduction), ``hybridgemm.linear`` through
the dispatcher (default mode forward and autograd; batch_invariant mode) and the cuBLASLt
backward GEMMs — the same inputs give bit-identical outputs:

* across ``REPEATS`` calls in one process: every output is compared with the first by
  ``torch.equal`` and by sha256. Before each call the output is filled with NaN (for paths
  that allocate their own output, freed NaN blocks of the output's size are left in the
  caching allocator, which it usually hands back) and the Triton split-K workspaces are filled
  with NaN: with identical inputs a reduction that read a stale partial from the previous call
  would otherwise still reproduce the same bits.
* across processes: a fresh interpreter imports this module and hashes every path's outputs for
  fixed seeds; the hashes must equal this process's. With ``HYBRIDGEMM_DETERMINISM_HASHES=path``
  the parent also writes its hashes there (``scripts/gpu-check.sh determinism`` runs this file
  twice and compares the two files).

What is promised (and so tested) is determinism for a fixed configuration on a fixed setup:
the same GPU model and SM count, cuBLASLt, Triton and torch versions (tests/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybridgemm
from helpers import FLOORS, assert_counters_zero, check_close_to_reference, make_operands, rel_err
from hybridgemm.kernels.backends import ConfigRejected, get_backend
from hybridgemm.kernels.epilogue import Activation, Epilogue, apply_activation
from hybridgemm.kernels.problem import Problem
from hybridgemm.kernels.triton_gemm import TritonGemmConfig
from hybridgemm.kernels.triton_splitk import TritonSplitKConfig

pytestmark = pytest.mark.gpu

REPEATS = 100
HASH_SEEDS = (1234, 98765)
HASHES_ENV = "HYBRIDGEMM_DETERMINISM_HASHES"
DEVICE = "cuda"  # a module constant so the cases can be dry-run elsewhere (Triton interpreter)

Outputs = tuple[torch.Tensor, ...]


class Unsupported(Exception):
    """This path cannot run on this machine (reported as a skip, never as a pass)."""


# ----------------------------------------------------------------------------- poisoning


def _poison_workspaces() -> None:
    """NaN into every cached Triton split-K workspace (partials must be written before read).
    The arrival counters are left alone: zero between calls is their contract."""
    from hybridgemm.kernels.triton_scratch import _WORKSPACES

    for buf in _WORKSPACES.values():
        buf.fill_(float("nan"))


def _poison_allocator(shapes, dtype) -> None:
    """Leave freed NaN blocks of these shapes in the caching allocator, so that a path that
    allocates its own output most likely gets NaN-filled memory rather than zeros or the
    previous call's bits (best effort: the allocator makes no promise which block it returns)."""
    blocks = [torch.full(s, float("nan"), dtype=dtype, device=DEVICE) for s in shapes]
    del blocks


def digest(tensors: Outputs) -> str:
    """sha256 of the tensors' shapes, dtypes and raw bytes."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the paths


@dataclass(frozen=True)
class Prepared:
    call: Callable[[], Outputs]  # poisons, runs once, returns the outputs (may be reused buffers)
    check: Callable[[Outputs], None]  # correctness of one call's outputs (against a reference)
    what: str  # the kernel/config that runs, for failure messages


@dataclass(frozen=True)
class Case:
    name: str
    prepare: Callable[[int], Prepared]  # seed -> Prepared; raises Unsupported

    def __str__(self) -> str:
        return self.name


def _operands(seed, m, n, k, dtype, bias):
    torch.manual_seed(seed)
    return make_operands(m, n, k, dtype, DEVICE, bias)


def _backend_case(name, backend, mnk, dtype, bias, act, make_config) -> Case:
    """A backend's ``run(config, ...)`` into a NaN-poisoned ``out``, the way the dispatcher
    calls it; ``make_config(problem)`` returns the config (None: cuBLASLt's heuristic)."""
    m, n, k = mnk

    def prepare(seed: int) -> Prepared:
        be = get_backend(backend)
        if not be.available():
            raise Unsupported(f"backend {backend} is not available here")
        x, w, b = _operands(seed, m, n, k, dtype, bias)
        out = torch.empty(m, n, dtype=dtype, device=DEVICE)
        problem = Problem.from_tensors(x, w, b, out, Epilogue(Activation.parse(act), bias))
        try:
            config = make_config(problem)
        except ConfigRejected as e:
            raise Unsupported(f"{backend} config does not fit this device: {e}") from None

        def call() -> Outputs:
            out.fill_(float("nan"))
            _poison_workspaces()
            be.run(config, x, w, b, out, act)
            return (out,)

        def check(outs: Outputs) -> None:
            check_close_to_reference(outs[0], x, w, b, act, name)

        return Prepared(call, check, "heuristic" if config is None else be.describe(config))

    return Case(name, prepare)


def _cublaslt_heuristic(problem: Problem):
    from hybridgemm.kernels import cublaslt as lt

    ok, why = lt.supports(problem)
    if not ok:
        raise ConfigRejected(why)
    return None


def _cublaslt_restored(problem: Problem):
    """What a table hit runs: an algorithm's JSON record restored (and checked) for the problem.
    Picks one with a split-K reduction when the heuristic offers one (its reduction order is
    what could make it nondeterministic), else the heuristic's last choice."""
    from hybridgemm.kernels import cublaslt_search as lts

    algos = lts.heuristic_algos(problem, torch.cuda.current_device(), count=16)
    if not algos:
        raise ConfigRejected("cuBLASLt's heuristic offers no algorithm")
    pick = next((a for a in algos if a.field_dict["splitk"] > 1), algos[-1])
    record = json.loads(json.dumps(pick.to_record()))
    try:
        return get_backend("cublaslt").config_from_record(record, problem)
    except ConfigRejected as e:  # made for this very problem a moment ago: a bug, not a skip
        raise AssertionError(f"restoring cuBLASLt algorithm {pick.describe()} failed: {e}") from None


def _record(config):
    """A Triton config through its table record and the dispatcher's validity check. The
    configs below were chosen to fit Hopper (H100/H200): a rejection there is a bug in this
    file, not a skip; on older GPUs (no TMA, less shared memory) it is a skip."""

    def make(problem: Problem):
        backend = "triton_gemm" if isinstance(config, TritonGemmConfig) else "triton_splitk"
        try:
            return get_backend(backend).config_from_record(json.loads(json.dumps(config.to_record())), problem)
        except ConfigRejected as e:
            if torch.cuda.get_device_capability() >= (9, 0):
                raise AssertionError(f"{config} should fit a Hopper GPU: {e}") from None
            raise

    return make


def _linear_case(name, lead, n, k, dtype, bias, act, mode: str | None = None) -> Case:
    """``hybridgemm.linear`` (inference: the dispatcher's chosen kernel, table or rule), in the
    default dispatch mode or, with ``mode``, inside ``hybridgemm.mode(mode)``."""
    m = 1
    for d in lead:
        m *= d

    def prepare(seed: int) -> Prepared:
        in_mode = getattr(hybridgemm, "mode", None)
        if mode is not None and in_mode is None:
            raise Unsupported(f"this hybridgemm has no dispatch modes (wanted {mode!r})")
        scope = (lambda: in_mode(mode)) if mode is not None else contextlib.nullcontext
        x2, w, b = _operands(seed, m, n, k, dtype, bias)
        x = x2.view(*lead, k)

        def call() -> Outputs:
            _poison_allocator([(*lead, n)], dtype)
            _poison_workspaces()
            with scope():
                return (hybridgemm.linear(x, w, b, act),)

        def check(outs: Outputs) -> None:
            check_close_to_reference(outs[0].reshape(m, n), x2, w, b, act, name)

        with scope():
            what = hybridgemm.explain(tuple(x.shape), (n, k), dtype, bias, act)
        return Prepared(call, check, what)

    return Case(name, prepare)


def _autograd_case(name, m, n, k, dtype, act) -> Case:
    """``hybridgemm.linear`` forward and backward (dx, dW, db) through autograd."""

    def prepare(seed: int) -> Prepared:
        x0, w0, b0 = _operands(seed, m, n, k, dtype, True)
        gy = torch.randn(m, n, device=DEVICE).to(dtype)
        leaves = [t.clone().requires_grad_(True) for t in (x0, w0, b0)]

        def call() -> Outputs:
            for t in leaves:
                t.grad = None
            _poison_allocator([(m, n), (m, k), (n, k), (n,)], dtype)
            _poison_workspaces()
            y = hybridgemm.linear(*leaves, act)
            y.backward(gy)
            return (y.detach(), *(t.grad for t in leaves))

        def check(outs: Outputs) -> None:
            x, w, b = (t.detach() for t in leaves)
            check_close_to_reference(outs[0], x, w, b, act, name)
            _check_grads(outs[1:], gy, x, w, b, act, name)

        return Prepared(call, check, "hybridgemm.linear forward + backward")

    return Case(name, prepare)


def _check_grads(grads, gy, x, w, b, act, what) -> None:
    """dx, dW, db within the same bound as the forward: 2 x torch's own error, or the floor."""
    act = Activation.parse(act)
    ref_leaves = [t.double().requires_grad_(True) for t in (x, w, b)]
    apply_activation(F.linear(*ref_leaves), act).backward(gy.double())
    low = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]  # torch in the same dtype
    apply_activation(F.linear(*low), act).backward(gy)
    for name, got, ref, theirs in zip(("dx", "dW", "db"), grads, ref_leaves, low):
        ours, torch_err = rel_err(got, ref.grad), rel_err(theirs.grad, ref.grad)
        bound = max(2.0 * torch_err, FLOORS[x.dtype])
        assert ours <= bound, f"{what} {name}: rel err {ours:.3g} > {bound:.3g} (torch's own: {torch_err:.3g})"


def _grad_case(name, which, m, n, k, dtype) -> Case:
    """The cuBLASLt backward GEMMs (kernels/cublaslt_grad.py): dx = dz @ W, and dW = dz.T @ x
    with or without the fused bias gradient (BGRADB)."""

    def prepare(seed: int) -> Prepared:
        from hybridgemm.kernels import cublaslt as lt

        if not lt.is_available():
            raise Unsupported("cuBLASLt (nvmath-python) is not available here")
        from hybridgemm.kernels.cublaslt_grad import grad_input, grad_weight

        torch.manual_seed(seed)
        dz = torch.randn(m, n, device=DEVICE).to(dtype)
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
        if which == "input":
            shapes, run = [(m, k)], lambda: (grad_input(dz, w),)
            refs = [(dz.double() @ w.double(), dz @ w)]
        else:
            bias_grad = which == "weight+bias"
            shapes = [(n, k)] + ([(n,)] if bias_grad else [])
            run = lambda: tuple(t for t in grad_weight(dz, x, bias_grad=bias_grad) if t is not None)
            refs = [(dz.double().T @ x.double(), dz.T @ x)] + (
                [(dz.double().sum(0), dz.sum(0))] if bias_grad else [])

        def call() -> Outputs:
            _poison_allocator(shapes, dtype)
            return run()

        def check(outs: Outputs) -> None:
            assert len(outs) == len(refs)
            for got, (ref, theirs) in zip(outs, refs):
                ours, torch_err = rel_err(got, ref), rel_err(theirs, ref)
                bound = max(2.0 * torch_err, FLOORS[dtype])
                assert ours <= bound, f"{name}: rel err {ours:.3g} > {bound:.3g}"

        return Prepared(call, check, f"cublaslt_grad {which}")

    return Case(name, prepare)


BF16, FP16 = torch.bfloat16, torch.float16

CASES = [
    _backend_case("cublaslt-heuristic", "cublaslt", (33, 1000, 520), BF16, True, "gelu_tanh", _cublaslt_heuristic),
    _backend_case("cublaslt-restored-record", "cublaslt", (16, 256, 8192), BF16, True, None, _cublaslt_restored),
    _backend_case("cublaslt-heuristic-fp16-relu", "cublaslt", (300, 257, 130), FP16, False, "relu",
                  _cublaslt_heuristic),
    # 7 x 24 = 168 tiles of 128 x 128 for 132 SMs: the persistent programs loop over tiles.
    _backend_case("triton_gemm-persistent-tma", "triton_gemm", (777, 3072, 1032), BF16, True, "relu",
                  _record(TritonGemmConfig(128, 128, 64, 8, 8, 4, persistent=True, use_tma=True))),
    _backend_case("triton_gemm-persistent-tma-subtile", "triton_gemm", (1000, 2048, 512), FP16, True, "gelu_tanh",
                  _record(TritonGemmConfig(128, 256, 64, 8, 8, 3, True, True, epilogue_subtile=True))),
    _backend_case("triton_gemm-pointer", "triton_gemm", (300, 520, 390), FP16, True, "gelu",
                  _record(TritonGemmConfig(64, 128, 64, 8, 4, 4, persistent=False, use_tma=False))),
    _backend_case("triton_gemm-persistent-pointer", "triton_gemm", (513, 1000, 777), BF16, False, None,
                  _record(TritonGemmConfig(128, 128, 64, 8, 8, 4, persistent=True, use_tma=False))),
    _backend_case("triton_gemm-split-k", "triton_gemm", (1024, 1024, 4096), BF16, True, "gelu",
                  _record(TritonGemmConfig(128, 128, 64, 8, 8, 3, False, True, split_k=4))),
    _backend_case("triton_splitk-no-split", "triton_splitk", (1, 4096, 4096), BF16, True, "gelu_tanh",
                  _record(TritonSplitKConfig(16, 64, 128, 1, 4, 4))),
    _backend_case("triton_splitk-two-pass", "triton_splitk", (5, 1064, 4096), BF16, True, None,
                  _record(TritonSplitKConfig(16, 64, 128, 8, 4, 4))),
    _backend_case("triton_splitk-fused-reduce", "triton_splitk", (16, 1064, 4096), FP16, True, "relu",
                  _record(TritonSplitKConfig(16, 32, 256, 4, 4, 4, fused_reduce=True))),
    _backend_case("triton_splitk-fused-reduce-odd", "triton_splitk", (37, 1000, 3000), BF16, False, "gelu",
                  _record(TritonSplitKConfig(64, 32, 128, 6, 4, 4, fused_reduce=True))),
    _linear_case("linear-decode", (1, 1), 6144, 4096, BF16, True, None),
    _linear_case("linear-prefill", (4, 75), 4608, 3584, BF16, True, "gelu_tanh"),
    _linear_case("linear-odd-shape", (17,), 257, 130, FP16, False, "relu"),
    _linear_case("linear-batch-invariant-mode", (3, 7), 1000, 520, BF16, True, "gelu", mode="batch_invariant"),
    _autograd_case("linear-autograd", 300, 1000, 520, BF16, "gelu_tanh"),
    _grad_case("cublaslt-grad-input", "input", 300, 1000, 520, BF16),
    _grad_case("cublaslt-grad-weight-bias", "weight+bias", 2048, 1024, 768, BF16),
    _grad_case("cublaslt-grad-weight", "weight", 17, 257, 130, FP16),
]
_BY_NAME = {c.name: c for c in CASES}
assert len(_BY_NAME) == len(CASES), "case names must be unique"


def case_hashes(seeds=HASH_SEEDS) -> dict[str, str]:
    """``{"<case>@<seed>": sha256 or "unsupported: why"}`` for every case, one call each.
    Run by the test process and by a fresh interpreter (the cross-process test)."""
    out = {}
    for case in CASES:
        for seed in seeds:
            try:
                prepared = case.prepare(seed)
            except Unsupported as e:
                out[f"{case.name}@{seed}"] = f"unsupported: {e}"
                continue
            out[f"{case.name}@{seed}"] = digest(prepared.call())
    torch.cuda.synchronize()
    return out


# ----------------------------------------------------------------------------- tests


def _prepare_or_skip(case: Case, seed: int) -> Prepared:
    try:
        return case.prepare(seed)
    except Unsupported as e:
        pytest.skip(f"{case.name}: {e}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_repeats_are_bit_identical(case):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh data per test (conftest seeds it)
    p = _prepare_or_skip(case, seed)
    first = tuple(t.clone() for t in p.call())
    torch.cuda.synchronize()
    for i, t in enumerate(first):
        assert torch.isfinite(t).all(), f"{case.name} ({p.what}): output {i} has unwritten (NaN) elements"
    p.check(first)
    digests = {digest(first)}
    for call in range(2, REPEATS + 1):
        outs = p.call()
        assert len(outs) == len(first)
        for i, (got, want) in enumerate(zip(outs, first)):
            if not torch.equal(got, want):
                bad = (got != want) | torch.isnan(got)
                pytest.fail(f"{case.name} ({p.what}): call {call}, output {i} differs from call 1 in "
                            f"{int(bad.sum())} of {got.numel()} elements (seed {seed})")
        digests.add(digest(outs))
    assert len(digests) == 1, f"{case.name}: {len(digests)} distinct sha256 over {REPEATS} calls"
    assert_counters_zero()


_HERE_AND_TESTS = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]))
_HASH_SCRIPT = """
import json, sys
sys.path[:0] = sys.argv[1:]
import test_determinism_gpu as t
print("HASHES " + json.dumps(t.case_hashes(), sort_keys=True))
"""


def test_bit_identical_across_processes():
    # The fresh process starts from the defaults: no explicit table path, the default mode.
    hybridgemm.decide.set_table_path(None)
    if getattr(hybridgemm, "set_mode", None) is not None:
        hybridgemm.set_mode("default")
    here = case_hashes()
    if os.environ.get(HASHES_ENV):
        Path(os.environ[HASHES_ENV]).write_text(json.dumps(here, sort_keys=True, indent=1) + "\n")
    res = subprocess.run([sys.executable, "-c", _HASH_SCRIPT, *_HERE_AND_TESTS], capture_output=True,
                         text=True, env=dict(os.environ), timeout=900)
    assert res.returncode == 0, f"the fresh process failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    lines = [line for line in res.stdout.splitlines() if line.startswith("HASHES ")]
    assert len(lines) == 1, res.stdout[-3000:]
    there = json.loads(lines[0][len("HASHES "):])
    assert set(there) == set(here)
    differ = sorted(k for k in here if here[k] != there[k])
    assert not differ, f"outputs differ between two processes for {differ}"
    ran = [k for k, v in here.items() if not v.startswith("unsupported")]
    assert any(k.startswith("triton_") for k in ran), here  # Triton runs on any CUDA GPU
    assert any(k.startswith("linear-") for k in ran), here
