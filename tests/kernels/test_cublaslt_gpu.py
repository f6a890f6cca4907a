"""cuBLASLt backend on the GPU: correctness, layouts, determinism, graphs, algorithm records."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import check_close_to_reference, make_operands, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]  # fp32 references stay fp32

lt = pytest.importorskip("hybridgemm.kernels.cublaslt")
lts = pytest.importorskip("hybridgemm.kernels.cublaslt_search")
if torch.cuda.is_available() and not lt.is_available():
    pytest.skip("nvmath-python / cuBLASLt not loadable here", allow_module_level=True)

from hybridgemm.kernels.checks import LinearArgumentError  # noqa: E402
from hybridgemm.kernels.epilogue import Activation, Epilogue  # noqa: E402
from hybridgemm.kernels.problem import Problem  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ACTS = [None, "relu", "gelu_tanh"]
SHAPES_MNK = [(1, 100, 72), (3, 257, 130), (17, 64, 1000), (128, 1000, 520), (1000, 37, 45)]




@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("mnk", SHAPES_MNK, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(dtype, act, bias, mnk):
    m, n, k = mnk
    x, w, b = make_operands(m, n, k, dtype, "cuda", bias)
    out = poisoned((m, n), dtype, "cuda")
    lt.linear(x, w, b, act, out=out)
    assert torch.isfinite(out).all(), "some output elements were never written"
    check_close_to_reference(out, x, w, b, act, f"{dtype} {act} M,N,K={mnk}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts(dtype):
    m, n, k = 33, 96, 80
    _, w, b = make_operands(m, n, k, dtype, "cuda")
    buf = torch.randn(m, k + 9, device="cuda").to(dtype)
    cases = {
        "misaligned_cols": buf[:, 1 : k + 1],  # pointer off by one element, row stride k+9
        "transposed": torch.randn(k, m, device="cuda").to(dtype).T,
        "every_other_row": torch.randn(2 * m, k, device="cuda").to(dtype)[::2],
        "3d": torch.randn(3, 11, k, device="cuda").to(dtype),
        "1d": torch.randn(k, device="cuda").to(dtype),
    }
    for name, x in cases.items():
        out = lt.linear(x, w, b, "relu")
        assert out.shape == (*x.shape[:-1], n), name
        check_close_to_reference(out.reshape(-1, n), x.reshape(-1, k), w, b, "relu", name)
    # misaligned weight and bias
    wbuf = torch.randn(n * k + 1, device="cuda").to(dtype)
    w_mis = wbuf[1:].view(n, k)
    bbuf = torch.randn(n + 1, device="cuda").to(dtype)
    b_mis = bbuf[1:]
    x = torch.randn(m, k, device="cuda").to(dtype)
    check_close_to_reference(lt.linear(x, w_mis, b_mis), x, w_mis, b_mis, None, "misaligned w,b")


def test_empty_dims():
    x, w, b = make_operands(0, 16, 32, torch.float16, "cuda")
    assert lt.linear(x, w, b).shape == (0, 16)
    x = torch.randn(5, 0, device="cuda", dtype=torch.float16)
    w = torch.randn(16, 0, device="cuda", dtype=torch.float16)
    b = torch.randn(16, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(lt.linear(x, w, b), b.expand(5, 16))
    torch.testing.assert_close(lt.linear(x, w, b, "relu"), torch.relu(b).expand(5, 16))
    assert (lt.linear(x, w, None) == 0).all()
    x, w, _ = make_operands(4, 0, 8, torch.float16, "cuda")
    assert lt.linear(x, w).shape == (4, 0)


def test_tf32_follows_torch_setting():
    x, w, b = make_operands(256, 512, 1024, torch.float32, "cuda")
    from hybridgemm.kernels.epilogue import reference_linear

    ref = reference_linear(x, w, b)
    exact = rel_err(lt.linear(x, w, b), ref)
    torch.backends.cuda.matmul.allow_tf32 = True
    fast = rel_err(lt.linear(x, w, b), ref)
    assert exact < 1e-5, exact
    assert fast > 10 * exact, (fast, exact)  # TF32 rounds the operands to 10 mantissa bits


def test_bad_input_errors():
    x, w, b = make_operands(4, 8, 16, torch.float16, "cuda")
    with pytest.raises(LinearArgumentError, match="dtype"):
        lt.linear(x.float(), w, b)
    with pytest.raises(LinearArgumentError, match="device"):
        lt.linear(x, w, b.cpu())
    with pytest.raises(LinearArgumentError, match="input features"):
        lt.linear(x[:, :7], w, b)
    with pytest.raises(LinearArgumentError, match="bias must have shape"):
        lt.linear(x, w, b[:5])
    with pytest.raises(ValueError, match="exact GELU"):
        lt.linear(x, w, b, "gelu")
    with pytest.raises(TypeError, match="not supported"):
        lt.linear(x.double(), w.double(), b.double())


def _problem(m, n, k, dtype, bias=True):
    return Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(Activation.NONE, bias), ldx=k, ldw=k, ldo=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_candidates_run_and_round_trip(dtype):
    m, n, k = 64, 384, 512
    x, w, b = make_operands(m, n, k, dtype, "cuda")
    cands = lts.candidates(_problem(m, n, k, dtype), exhaustive_limit=8)
    assert len(cands) >= 2
    assert any(c.source == "exhaustive" for c in cands)
    for algo in cands:
        out = lt.linear(x, w, b, algo=algo)
        check_close_to_reference(out, x, w, b, None, algo.describe())
        rec = json.loads(json.dumps(algo.to_record()))
        restored = lts.restore_algo(rec, _problem(m, n, k, dtype))
        again = lt.linear(x, w, b, algo=restored)
        assert torch.equal(out, again), f"restored {algo.describe()} differs"


def test_restore_refuses_bad_records():
    p = _problem(64, 384, 512, torch.bfloat16)
    algo = lts.heuristic_algos(p, count=1)[0]
    rec = algo.to_record()
    with pytest.raises(lt.InvalidAlgorithm, match="cuBLASLt"):
        lts.restore_algo({**rec, "cublaslt_version": rec["cublaslt_version"] + 1}, p)
    with pytest.raises(lt.InvalidAlgorithm, match="disagree"):
        lts.restore_algo({**rec, "tile": rec["tile"] + 1}, p)
    with pytest.raises(lt.InvalidAlgorithm, match="hex"):
        lts.restore_algo({**rec, "bytes": "zz" * 64}, p)
    with pytest.raises(lt.InvalidAlgorithm):  # a bf16 algorithm does not fit an fp32 problem
        fp32 = _problem(64, 384, 512, torch.float32)
        bad = [a for a in lts.heuristic_algos(p, count=16) if _fails(a, fp32)]
        assert bad, "every bf16 algorithm also fits fp32; pick another misfit"
        lts.restore_algo(bad[0].to_record(), fp32)


def _fails(algo, problem) -> bool:
    try:
        lts.restore_algo(algo.to_record(), problem)
    except lt.InvalidAlgorithm:
        return True
    return False


def test_bit_identical_repeats():
    x, w, b = make_operands(16, 4096, 4096, torch.bfloat16, "cuda")
    for algo in lts.heuristic_algos(_problem(16, 4096, 4096, torch.bfloat16), count=4):
        first = lt.linear(x, w, b, algo=algo)
        for _ in range(20):
            assert torch.equal(lt.linear(x, w, b, algo=algo), first), algo.describe()


_HASH_SCRIPT = """
import hashlib, torch, hybridgemm.kernels.cublaslt as lt
torch.manual_seed(1234)
outs = []
for m in (1, 16, 300):
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    w = (torch.randn(3072, 2048, device="cuda") / 45).bfloat16()
    b = torch.randn(3072, device="cuda").bfloat16()
    outs.append(lt.linear(x, w, b, "gelu_tanh").float().cpu().numpy().tobytes())
print(hashlib.sha256(b"".join(outs)).hexdigest())
"""


def test_bit_identical_across_processes():
    digests = {
        subprocess.run([sys.executable, "-c", _HASH_SCRIPT], capture_output=True, text=True, check=True,
                       env=dict(os.environ)).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1, digests
    assert len(next(iter(digests))) == 64
    # and the same inside this process
    torch.manual_seed(1234)
    outs = []
    for m in (1, 16, 300):
        x = torch.randn(m, 2048, device="cuda").bfloat16()
        w = (torch.randn(3072, 2048, device="cuda") / 45).bfloat16()
        b = torch.randn(3072, device="cuda").bfloat16()
        outs.append(lt.linear(x, w, b, "gelu_tanh").float().cpu().numpy().tobytes())
    assert hashlib.sha256(b"".join(outs)).hexdigest() in digests


def test_cuda_graph_capture_replays():
    x, w, b = make_operands(8, 1024, 768, torch.bfloat16, "cuda")
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lt.linear(static_x, w, b, "relu")  # warm: plan and workspace outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = lt.linear(static_x, w, b, "relu")
    for _ in range(3):
        fresh = torch.randn_like(x)
        static_x.copy_(fresh)
        static_out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, lt.linear(fresh, w, b, "relu"))


def test_plan_cache_is_bounded():
    lt.clear_caches()
    cap = lt._plans.max_size
    w = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    for m in range(1, cap + 40):
        lt.linear(torch.randn(m, 32, device="cuda", dtype=torch.float16), w)
    assert len(lt._plans) <= cap
