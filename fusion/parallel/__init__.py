"""Tensor parallelism over ``torch.distributed``: :func:`parallelize` shards a model's
attention heads, MLP columns and vocabulary rows (``tensor_parallel``), the per-rank shape
arithmetic (``sharding``) and the decode-sized sums (``collectives``). Imported on first use
of ``hybridgemm.parallelize`` (it loads torch's functional collectives)."""

from .tensor_parallel import (
    ParallelReport,
    RowParallelLinear,
    Shard,
    VocabParallelLinear,
    load_full_state_dict,
    parallelize,
)

__all__ = ["ParallelReport", "RowParallelLinear", "Shard", "VocabParallelLinear", "load_full_state_dict",
           "parallelize"]
