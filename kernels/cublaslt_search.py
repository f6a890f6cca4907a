"""Algorithm search for the cuBLASLt backend: heuristic ranking, exhaustive enumeration,
and restoring a recorded algorithm with validation. Used by the tuner and benchmarks, never
on the call path."""

from __future__ import annotations

import numpy as np

from .cublaslt import forward_plan, heuristic_workspace_bytes
from .cublaslt_algos import CublasLtAlgo, InvalidAlgorithm, set_algo_field
from .cublaslt_plan import HEURISTIC_COUNT
from .cublaslt_runtime import WORKSPACE_BYTES, bindings, cublaslt_version, reduced_reduction_allowed
from .problem import Problem


def heuristic_algos(problem: Problem, device_index: int = 0, count: int = HEURISTIC_COUNT,
                    max_workspace: int | None = None):
    """The heuristic's top ``count`` under ``max_workspace`` bytes (default: the limit the
    untuned first choice uses, ``cublaslt.heuristic_workspace_bytes()``)."""
    plan = forward_plan(problem, device_index, reduced_reduction_allowed(problem.dtype))
    try:
        return plan.heuristics(count, max_workspace)
    finally:
        plan.destroy()


def _cap_array(lt, algo_buf: np.ndarray, attr) -> list[int]:
    written = np.zeros(1, dtype=np.uint64)
    lt.matmul_algo_cap_get_attribute(algo_buf.ctypes.data, attr, 0, 0, written.ctypes.data)
    n = int(written[0]) // 4
    if n == 0:
        return []
    arr = np.zeros(n, dtype=np.uint32)
    lt.matmul_algo_cap_get_attribute(algo_buf.ctypes.data, attr, arr.ctypes.data, arr.nbytes,
                                     written.ctypes.data)
    return [int(v) for v in arr]


def _cap_scalar(lt, algo_buf: np.ndarray, attr) -> int:
    written = np.zeros(1, dtype=np.uint64)
    val = np.zeros(1, dtype=lt.get_matmul_algo_cap_attribute_dtype(attr))
    lt.matmul_algo_cap_get_attribute(algo_buf.ctypes.data, attr, val.ctypes.data, val.nbytes,
                                     written.ctypes.data)
    return int(val[0])


def exhaustive_algos(problem: Problem, device_index: int = 0, limit: int = 256,
                     splitk_values: tuple[int, ...] = (1, 2, 4, 8)) -> list[CublasLtAlgo]:
    """Every (algorithm id, tile, stages, split-K) that ``cublasLtMatmulAlgoCheck`` accepts for
    this problem, via ``AlgoGetIds -> AlgoInit -> caps -> AlgoCheck``, up to ``limit``.

    Split-K > 1 uses one reduction scheme per algorithm (the first supported of
    COMPUTE_TYPE, INPLACE, OUTPUT_TYPE: fp32 partials first, as they round least).
    Swizzle and cluster shape stay at the algorithm's defaults to keep the space tractable.
    No one algorithm id takes more than a quarter of ``limit``, so a small limit still spans
    several kernel families instead of the tile variants of the first one.
    """
    lt = bindings()
    plan = forward_plan(problem, device_index, reduced_reduction_allowed(problem.dtype))
    version = cublaslt_version()
    C = lt.MatmulAlgoCapAttribute
    found: list[CublasLtAlgo] = []
    try:
        ids = lt.matmul_algo_get_ids(plan.handle, plan.compute_type, plan.scale_type, plan.data_type,
                                     plan.data_type, plan.data_type, plan.data_type, 128)
        epi_bit = int(lt.Epilogue[plan.spec.epilogue])
        for algo_id in ids:
            buf = np.zeros(8, dtype=np.uint64)
            try:
                lt.matmul_algo_init(plan.handle, plan.compute_type, plan.scale_type, plan.data_type,
                                    plan.data_type, plan.data_type, plan.data_type, int(algo_id),
                                    buf.ctypes.data)
            except lt.cuBLASLtError:
                continue
            if epi_bit != 1 and (_cap_scalar(lt, buf, C.EPILOGUE_MASK) & epi_bit) != epi_bit:
                continue
            tiles = _cap_array(lt, buf, C.TILE_IDS) or [0]
            stages = _cap_array(lt, buf, C.STAGES_IDS) or [0]
            splitk_ok = _cap_scalar(lt, buf, C.SPLITK_SUPPORT)
            red_mask = _cap_scalar(lt, buf, C.REDUCTION_SCHEME_MASK)
            scheme = next((s for s in (2, 1, 4) if red_mask & s), 0)
            per_id, budget = max(4, limit // 4), len(found)
            for tile in tiles:
                for stage in stages:
                    for splitk in splitk_values:
                        if splitk > 1 and (not splitk_ok or not scheme):
                            continue
                        cand = buf.copy()
                        set_algo_field(cand, "TILE_ID", tile)
                        set_algo_field(cand, "STAGES_ID", stage)
                        set_algo_field(cand, "SPLITK_NUM", splitk)
                        if splitk > 1:
                            set_algo_field(cand, "REDUCTION_SCHEME", scheme)
                        algo = CublasLtAlgo.from_buffer(cand, version, 0, "exhaustive")
                        try:
                            ws = plan.check(algo)
                        except InvalidAlgorithm:
                            continue
                        found.append(CublasLtAlgo(algo.data, algo.fields, version, ws, "exhaustive"))
                        if len(found) >= limit:
                            return found
                        if len(found) - budget >= per_id:
                            break
                    if len(found) - budget >= per_id:
                        break
                if len(found) - budget >= per_id:
                    break
        return found
    finally:
        plan.destroy()


def candidates(problem: Problem, device_index: int = 0, heuristic_count: int = HEURISTIC_COUNT,
               exhaustive_limit: int = 64) -> list[CublasLtAlgo]:
    """Heuristic top-``heuristic_count`` first (under the default workspace limit, then the
    ranking under the whole allocated workspace: the two rank differently, see
    ``cublaslt.heuristic_workspace_bytes``), then exhaustive finds not already listed."""
    algos = heuristic_algos(problem, device_index, heuristic_count)
    seen = {tuple(sorted(a.field_dict.items())) for a in algos}
    if heuristic_workspace_bytes() < WORKSPACE_BYTES:
        for a in heuristic_algos(problem, device_index, heuristic_count, WORKSPACE_BYTES):
            sig = tuple(sorted(a.field_dict.items()))
            if sig not in seen:
                seen.add(sig)
                algos.append(a)
    if exhaustive_limit > 0:
        for a in exhaustive_algos(problem, device_index, limit=exhaustive_limit + len(algos)):
            sig = tuple(sorted(a.field_dict.items()))
            if sig not in seen:
                seen.add(sig)
                algos.append(a)
                if len(algos) >= heuristic_count + exhaustive_limit:
                    break
    return algos


def restore_algo(record: dict, problem: Problem, device_index: int = 0) -> CublasLtAlgo:
    """Rebuild an algorithm from its record and check it fits ``problem`` on this cuBLASLt.
    Raises :class:`InvalidAlgorithm` naming the reason (other version, edited bytes, misfit)."""
    algo = CublasLtAlgo.from_record(record, running_version=cublaslt_version())
    plan = forward_plan(problem, device_index, reduced_reduction_allowed(problem.dtype))
    try:
        plan.check(algo)
    finally:
        plan.destroy()
    return algo


