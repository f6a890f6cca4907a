"""The tensor-parallel split rules: what each of ``tp`` ranks holds of a model's heads, MLP
width and vocabulary. One set of rules for the code that shards a model
(:func:`hybridgemm.parallelize`, fusion/parallel/tensor_parallel.py) and for the shapes one
rank runs (:func:`rank_projections`, which ``hybridgemm autotune --tp N`` tunes), so the two
cannot disagree.
"""

from __future__ import annotations

from dataclasses import replace

from hybridgemm.autotune_cache.presets import ModelPreset, ProjectionShape


def _check_tp(tp: object) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        shown = repr(tp) if len(repr(tp)) <= 60 else repr(tp)[:57] + "..."
        raise ValueError(f"the tensor-parallel degree must be a positive integer, got {shown}")
    return tp


def tp_local_heads(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) that each of ``tp`` ranks holds.

    Every rank takes ``heads / tp`` consecutive query heads, so ``tp`` must divide ``heads``,
    and the KV heads those query heads read: ``kv_heads / tp`` whole GQA groups when ``tp``
    divides ``kv_heads``; when ``kv_heads`` divides ``tp`` instead, a rank's query heads all
    fall in one group and it holds that group's single KV head (a copy of it sits on
    ``tp / kv_heads`` ranks). Any other ``kv_heads`` would leave some rank's query heads
    spread over part of a group: ``ValueError``.
    """
    _check_tp(tp)
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide the {heads} attention heads")
    if kv_heads % tp == 0:
        return heads // tp, kv_heads // tp
    if tp % kv_heads == 0:
        return heads // tp, 1
    raise ValueError(f"tp={tp} does not fit the {kv_heads} key/value heads: tp must divide them (whole GQA "
                     "groups per rank) or be a multiple of them (each rank keeps a copy of one KV head)")


def tp_split(size: int, tp: int, what: str) -> int:
    """``size / tp``, the even share of each rank; ``ValueError`` naming ``what`` otherwise."""
    _check_tp(tp)
    if size % tp:
        raise ValueError(f"tp={tp} does not divide the {what} {size}")
    return size // tp


def tp_vocab_rows(vocab: int, tp: int) -> int:
    """Rows of the LM head each rank holds: ``ceil(vocab / tp)``. A vocabulary ``tp`` does not
    divide is not an error: the last rank holds fewer rows and its logits are padded to this
    width for the gather, then cut off. ``ValueError`` when a rank would hold none."""
    _check_tp(tp)
    rows = -(-vocab // tp)
    if rows * (tp - 1) >= vocab:
        raise ValueError(f"a vocabulary of {vocab} is too small to split over tp={tp} ranks "
                         f"({rows} rows each would leave the last rank none)")
    return rows


def rank_projections(preset: ModelPreset, tp: int) -> tuple[ProjectionShape, ...]:
    """The GEMM shapes one of ``tp`` ranks runs after :func:`hybridgemm.parallelize`.

    Attention: ``q``, ``kv``, ``qkv`` with the rank's heads (:func:`tp_local_heads`) and the
    row-parallel ``o`` (input width: the rank's heads). Only rank 0 adds a row-parallel
    layer's bias, so with a bias and ``tp > 1`` the other ranks' bias-less GEMM is listed
    too (``o_nobias``). Where the preset knows them: the MLP's gate and up projections, one
    shape ``gate_up`` (n = intermediate / tp: ``hybridgemm.gated_linear`` runs them as two
    dispatched GEMMs of that shape above M = 64, and its Triton gated kernel, which the
    table does not choose, below), the row-parallel ``down`` (k = intermediate / tp;
    ``down_nobias`` as for o), and the vocab-parallel ``lm_head`` (n = the rank's rows,
    :func:`tp_vocab_rows`; the whole vocabulary when the head is tied to the embedding,
    which stays replicated). A mixture-of-experts preset has no dense MLP (``intermediate`` is
    None): its experts run in the grouped MoE kernels, not as dispatched GEMMs, and
    ``parallelize`` leaves them whole; its ``router`` (n = the experts) is a dispatched GEMM.
    The parts in the preset's ``tp_whole`` (a family whose layers ``parallelize`` does not
    split) keep their full shapes on every rank. ``tp=1`` gives the unsharded shapes of all of them.
    ``ValueError`` naming the preset when the model cannot be split ``tp`` ways.
    """
    try:
        attention_tp = 1 if "attention" in preset.tp_whole else tp
        heads, kv_heads = tp_local_heads(preset.heads, preset.kv_heads, attention_tp)
        shapes = list(replace(preset, heads=heads, kv_heads=kv_heads).projections)
        if attention_tp > 1 and preset.o_bias:
            shapes.append(ProjectionShape("o_nobias", preset.hidden, heads * preset.head_dim, False))
        if preset.intermediate is not None:
            mlp_tp = 1 if "mlp" in preset.tp_whole else tp
            width = tp_split(preset.intermediate, mlp_tp, "intermediate size")
            shapes += [ProjectionShape("gate_up", width, preset.hidden, preset.mlp_bias),
                       ProjectionShape("down", preset.hidden, width, preset.mlp_bias)]
            if mlp_tp > 1 and preset.mlp_bias:
                shapes.append(ProjectionShape("down_nobias", preset.hidden, width, False))
        if preset.moe:  # the router's logits (replicated, as parallelize leaves the block whole)
            shapes.append(ProjectionShape("router", preset.experts, preset.hidden, False))
        if preset.vocab is not None:
            rows = preset.vocab if preset.tied_lm_head else tp_vocab_rows(preset.vocab, tp)
            shapes.append(ProjectionShape("lm_head", rows, preset.hidden, False))
    except ValueError as e:
        raise ValueError(f"{preset.name}: {e}") from None
    return tuple(shapes)


__all__ = ["rank_projections", "tp_local_heads", "tp_split", "tp_vocab_rows"]
