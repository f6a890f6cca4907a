"""The device and the problem of the dispatcher's decision tests on the CPU: an H200 that no
shipped table matches (the ``fake_h200`` fixtures of tests/conftest.py fake it), the problem a
decision is asked for, the Triton records its table entries name, and those entries."""

from __future__ import annotations

import torch
from tuning_tables import SIG

from hybridgemm.autotune_cache.table import TableKey, TuningTable, make_entry
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem

# A device no shipped table matches (so only the tables a test writes are in play).
FAKE_SIG = {**SIG, "gpu_name": "hybridgemm test GPU"}
H200_LIMITS = {"smem_limit": 232448, "capability": (9, 0)}
M, N, K = 16, 384, 512
PROBLEM = Problem(m=M, n=N, k=K, dtype=torch.bfloat16, epilogue=Epilogue(Activation.NONE, True), ldx=K, ldw=K, ldo=N)
KEY = TableKey.from_problem(PROBLEM)  # linear|bf16|bias|N=384|K=512|M=9-16|c
CALL = "linear|bf16|bias|N=384|K=512|c at M=16"  # PROBLEM's shape key and M, as a decision names them

SPLITK_RECORD = {"kind": "triton_splitk", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4,
                 "num_warps": 4, "num_stages": 3}
GEMM_RECORD = {"kind": "triton_gemm", "block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4,
               "num_stages": 3, "persistent": True, "use_tma": True, "epilogue_subtile": False}


def tuned(backend, record, k=KEY, us=9.0, m_points=None, ratios=None):
    """A valid entry for ``k``'s range (timed at both edges unless ``m_points`` is given)."""
    pts = m_points or ([k.m_lo] if k.m_lo == k.m_hi else [k.m_lo, k.m_hi])
    return make_entry(backend, record, m_points=pts, ratios=ratios or [1.1] * len(pts), median_us=us,
                      spread_us=0.1)


def save_table(path, entries, sig=FAKE_SIG):
    """``entries`` ({TableKey: entry}) saved as a table for ``sig`` at ``path``; returns ``path``."""
    t = TuningTable(sig)
    for k, e in entries.items():
        t.set(k, e)
    t.save(path)
    return path
