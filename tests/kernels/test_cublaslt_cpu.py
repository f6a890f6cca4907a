"""What of the cuBLASLt backend can be checked without a GPU: import, records, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgemm.kernels import cublaslt as lt
from hybridgemm.kernels.cublaslt_algos import CublasLtAlgo, InvalidAlgorithm
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

FIELD_NAMES = ["algo_id", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "inner_shape",
               "cluster_shape"]


def test_import_needs_no_cuda_driver():
    code = ("import torch, hybridgemm, hybridgemm.kernels.cublaslt, hybridgemm.kernels.epilogue;"
            "assert not torch.cuda.is_initialized(), 'CUDA initialised at import';"
            "print('ok', hybridgemm.__version__)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok ")


@settings(deadline=None, max_examples=50)
@given(data=st.binary(min_size=64, max_size=64),
       values=st.lists(st.integers(0, 2**31 - 1), min_size=9, max_size=9),
       version=st.integers(1, 10**7), ws=st.integers(0, 2**25))
def test_record_round_trip(data, values, version, ws):
    algo = CublasLtAlgo(data, tuple(zip(FIELD_NAMES, values)), version, ws, "exhaustive")
    rec = json.loads(json.dumps(algo.to_record()))
    assert CublasLtAlgo.from_record(rec) == algo


def _record():
    return CublasLtAlgo(bytes(range(64)), tuple((n, i) for i, n in enumerate(FIELD_NAMES)), 130100).to_record()


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.update(kind="triton"), "not a cuBLASLt"),
    (lambda r: r.pop("tile"), "lacks field"),
    (lambda r: r.update(bytes="zz" * 64), "hex"),
    (lambda r: r.update(bytes="00" * 63), "64 bytes"),
    (lambda r: r.update(splitk=True), "must be an int"),
    (lambda r: r.update(stages="3"), "must be an int"),
    (lambda r: r.update(cublaslt_version="13"), "must be an int"),
])
def test_bad_records_are_refused(mutate, match):
    rec = _record()
    mutate(rec)
    with pytest.raises(InvalidAlgorithm, match=match):
        CublasLtAlgo.from_record(rec)


def test_other_version_is_refused():
    with pytest.raises(InvalidAlgorithm, match="re-tune"):
        CublasLtAlgo.from_record(_record(), running_version=130200)


def test_not_a_dict_is_refused():
    with pytest.raises(InvalidAlgorithm):
        CublasLtAlgo.from_record(["kind", "cublaslt"])


def test_supports_reasons():
    def prob(dtype=torch.bfloat16, act=Activation.NONE, m=4):
        return Problem(m=m, n=8, k=8, dtype=dtype, epilogue=Epilogue(act, True), ldx=8, ldw=8, ldo=8)

    assert lt.supports(prob()) == (True, "")
    ok, why = lt.supports(prob(act=Activation.GELU))
    assert not ok and "gelu" in why
    ok, why = lt.supports(prob(dtype=torch.float64))
    assert not ok and "dtype" in why
    ok, why = lt.supports(prob(m=0))
    assert not ok and "empty" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_cpu_tensors_never_reach_cublaslt():
    assert not lt.is_available()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        lt.linear(x, w)
