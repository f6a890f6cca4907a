"""Tensor parallelism over ``torch.distributed``: :func:`parallelize` shards a model's
attention heads, MLP columns and vocabulary rows (``tensor_parallel``), the split rules and
one rank's GEMM shapes (``sharding``) and the decode-sized sums (``collectives``).
``tensor_parallel`` (which loads torch's functional collectives) is imported on first use of
one of its names, so ``hybridgemm.parallel.sharding`` alone loads neither it nor Triton.
"""

import importlib

_TENSOR_PARALLEL = ("ParallelReport", "RowParallelLinear", "Shard", "VocabParallelLinear", "load_full_state_dict",
                    "parallelize", "split_parts")


def __getattr__(name: str):
    if name in _TENSOR_PARALLEL:
        return getattr(importlib.import_module("hybridgemm.parallel.tensor_parallel"), name)
    raise AttributeError(f"module 'hybridgemm.parallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_TENSOR_PARALLEL})


__all__ = list(_TENSOR_PARALLEL)
