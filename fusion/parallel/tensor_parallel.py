"""``hybridgemm.parallel.parallelize(model, group)``: tensor parallelism for decoder models
whose layers have the Llama/Qwen2/Mistral layout, on ``torch.distributed``.

Every rank builds the same full model (same weights), then calls :func:`parallelize` with
the same process group (or 1-D ``DeviceMesh``); each rank then keeps its share of the
weights, in place. Inputs must be the same on every rank; outputs are the same on every
rank. What is split (found by structure, never by model name; ``transformers`` is never
imported here), with ``tp`` ranks and this process's rank ``r`` in the group:

* attention (a module with exact ``nn.Linear`` children ``q_proj/k_proj/v_proj/o_proj``),
  column-parallel then row-parallel: rank ``r`` keeps query heads ``r*H/tp .. (r+1)*H/tp``
  and the KV heads they read (:func:`~hybridgemm.parallel.sharding.tp_local_heads`:
  whole GQA groups when ``tp`` divides the KV heads, else a copy of its group's one KV head).
  q/k/v keep those rows (weights and biases) and stay plain ``nn.Linear``, so
  ``hybridgemm.patch`` fuses them into one GEMM as usual. ``o_proj`` keeps the input
  columns of those heads and becomes a :class:`RowParallelLinear`, whose output is summed
  over the ranks. The module's head-count attributes (``num_key_value_groups``, and
  ``num_heads``/``num_key_value_heads`` where a transformers version has them) are set to
  the local counts; the attention forward takes the head count from the weight
  (``view(..., -1, head_dim)``). The model's ``config`` is left as it is: it describes the
  whole model (caches size themselves from the key/value tensors they are given).
* MLP (exact ``nn.Linear`` children ``gate_proj/up_proj/down_proj``): gate and up keep
  ``intermediate/tp`` rows (plain ``nn.Linear``), ``down_proj`` the matching columns as a
  :class:`RowParallelLinear`. The intermediate size must divide by ``tp``.
* LM head (an exact ``nn.Linear`` child ``lm_head``): vocab-parallel, a
  :class:`VocabParallelLinear` holding ``ceil(V/tp)`` rows (the last rank fewer when ``tp``
  does not divide ``V``) whose logits are gathered, in rank order, into the full ``(..., V)``.
  A head tied to the input embedding is left whole on every rank (sharding it would untie
  it, and a vocab-parallel embedding is not provided); the report says so.

A row-parallel layer adds its bias on rank 0 only, in the GEMM's epilogue (the other ranks
pass ``bias=None``), so the sum over ranks holds it exactly once. In a decoder layer that
``hybridgemm.patch`` fuses, the residual of its O and down projections is added once too, by
one of two means (``project_add`` in fusion/models/decode_step.py;
:attr:`RowParallelLinear.sums_residual`):

* with torch's one-shot kernel (``one_shot_kernel="torch"``, the default) rank 0's GEMM adds
  it in the same epilogue as the bias, and the sum adds nothing: no extra kernel, but rank
  0's partial is rounded to the model's dtype with the residual in it and the sum is rounded
  again, two roundings at the residual stream's magnitude per projection where one model on
  one GPU has one;
* with the push kernel (``one_shot_kernel="push"``) the sum itself adds it: the partials are
  summed in fp32, the residual is added, and the result is rounded once, in the same one
  kernel. Where the push kernel cannot take a sum (gloo, a message too large), the same
  arithmetic runs as separate steps (an fp32 sum over the ranks, the add, the rounding), with
  the same bits for two ranks.

Every rank must take the same path through a fused layer (same hooks, mode and autocast). The
bias parameter stays on every rank (same state-dict keys everywhere); only rank 0's is read.

Everything else (embeddings, norms, rotary tables) stays whole on every rank, as does any
attention/MLP module that cannot be split (the report lists it with the reason): such a
module computes its full result on every rank, which is correct, only not divided.

Collectives: on an NCCL group, row-parallel sums that fit ``one_shot_bytes`` go through a
one-shot symmetric-memory all-reduce (:mod:`hybridgemm.parallel.collectives`, one kernel, the same bits
on every rank): torch's, or hybridgemm's push kernel. Other sums: eager calls use
``torch.distributed.all_reduce`` (in place) and ``all_gather``; under ``torch.compile`` the
functional collectives
(``torch.distributed._functional_collectives``) are called, which is what Dynamo turns the
in-place calls into anyway (with torch 2.13 both compile with ``fullgraph=True``). The
collectives are outside autograd: this is for inference, and a backward pass through a
sharded model raises.

State dicts keep the stock keys, each rank's tensors being its shards.
:func:`load_full_state_dict` loads a full (unsharded) stock state dict into a sharded model,
cutting every tensor with the same :class:`Shard` rules that :func:`parallelize` applied
(recorded on the modules it changed).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from hybridgemm.linear_layer import PartialSumLinear, linear
from hybridgemm.models.patching import PatchReport, _check_module
from hybridgemm.models.patching import patch as _patch

from .collectives import (
    ONE_SHOT_KERNELS,
    ONE_SHOT_MAX_BYTES,
    enable_one_shot,
    fits_one_shot,
    one_shot_capacity,
    push_fits,
    tp_sum,
    tp_sum_residual,
)
from .sharding import tp_local_heads, tp_split, tp_vocab_rows

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HEAD = "lm_head"
_RECORD = "_hybridgemm_tp"  # on each module whose children were sharded: {"child.param": Shard}


@dataclass(frozen=True)
class Shard:
    """The part of a full tensor that one rank holds: entries ``start`` to ``stop`` along
    ``dim`` (0: rows, 1: columns) of a tensor that has ``full`` entries there."""

    dim: int
    start: int
    stop: int
    full: int

    def take(self, t: Tensor, name: str = "tensor") -> Tensor:
        """This rank's part of the full tensor ``t``, in storage of its own (so the full
        tensor can be freed); ``ValueError`` when ``t`` is not full-sized along ``dim``."""
        if t.dim() <= self.dim or t.shape[self.dim] != self.full:
            raise ValueError(f"{name}: expected the full (unsharded) tensor, with {self.full} entries along dim "
                             f"{self.dim}; got shape {tuple(t.shape)}")
        return t.detach().narrow(self.dim, self.start, self.stop - self.start).clone()


@dataclass
class ParallelReport:
    """What :func:`parallelize` did on this rank: the attention and MLP modules and LM heads
    it split, ``skipped`` as ``(name, reason)`` for those it left whole on every rank, and
    the :class:`~hybridgemm.PatchReport` of the ``hybridgemm.patch`` that followed (None
    with ``patch=False``)."""

    tp: int
    rank: int
    attention: list[str] = field(default_factory=list)
    mlp: list[str] = field(default_factory=list)
    lm_head: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    patch: PatchReport | None = None
    all_reduce: str = "none"  # how row-parallel outputs are summed: "one-shot ..." or "nccl ..."

    def summary(self) -> str:
        parts = [f"{len(self.attention)} attention", f"{len(self.mlp)} MLP", f"{len(self.lm_head)} LM head"]
        text = f"hybridgemm.parallelize: rank {self.rank} of {self.tp}: sharded {', '.join(parts)}"
        if self.tp > 1:
            text += f"; sums: {self.all_reduce}"
        if self.skipped:
            text += "; left whole: " + "; ".join(f"{n or '(root)'}: {r}" for n, r in self.skipped)
        return text


class RowParallelLinear(PartialSumLinear):
    """``y = sum over ranks of (x_r @ W_r.T) + b``: a linear layer whose input features are
    split over the ranks of ``group``. Each rank holds ``weight`` (N, K/tp), its columns of
    the full weight, and gets ``x_r``, its part of the input (what the column-parallel layers
    before it produce locally); :func:`hybridgemm.linear` computes the partial product and
    an all-reduce sums it. ``bias`` (N,) is the full bias on every rank, added by rank 0's
    GEMM epilogue only, so it is counted once."""

    def __init__(self, lin: nn.Linear, group: dist.ProcessGroup, rank: int, tp: int):
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.out_features, self.in_features = lin.weight.shape
        self.adds_bias = rank == 0
        self.rank, self.tp = rank, tp
        self.group = group
        self.group_name = group.group_name  # a str: what torch.compile reads without tracing the group
        self.one_shot = False  # parallelize sets it where the group's one-shot all-reduce is enabled
        # parallelize sets it with one_shot_kernel="push": a fused decoder layer then hands the
        # residual to sum_parts_residual instead of rank 0's GEMM (see the module docstring)
        self.sums_residual = False

    def sum_parts(self, y: Tensor) -> Tensor:
        """``y`` summed over the ranks (one-shot or NCCL, see the module docstring)."""
        return _sum_over_ranks(y, self.group, self.group_name, self.one_shot)

    def sum_parts_residual(self, y: Tensor, residual: Tensor) -> Tensor:
        """``residual`` + ``y`` summed over the ranks, in fp32, rounded once to y's dtype: the
        push kernel where it takes ``y``, else the same steps apart (the same bits for two
        ranks). Inference only."""
        if self.one_shot and push_fits(y, self.group_name):
            return tp_sum_residual(y, residual, self.group_name)
        total = _sum_over_ranks(y.float(), self.group, self.group_name, self.one_shot)
        return (total + residual.float()).to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.in_features * self.tp}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, tp={self.tp}")


class VocabParallelLinear(nn.Module):
    """An LM head whose output rows are split over the ranks of ``group``: rank ``r`` holds
    rows ``r*rows .. min(V, (r+1)*rows)`` of the full (V, H) weight (``rows`` = ceil(V/tp)),
    computes its logits with :func:`hybridgemm.linear` and all-gathers them in rank order
    into the full ``(..., V)`` logits (a shorter last shard is padded for the gather and the
    padding cut off)."""

    def __init__(self, lin: nn.Linear, group: dist.ProcessGroup, rank: int, tp: int, vocab: int, rows: int):
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.out_features, self.in_features = lin.weight.shape
        self.vocab, self.rows = vocab, rows
        self.rank, self.tp = rank, tp
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, self.bias)
        if y.shape[-1] != self.rows:
            y = F.pad(y, (0, self.rows - y.shape[-1]))
        logits = _gather_last_dim(y, self.group, self.tp)
        return logits if self.rows * self.tp == self.vocab else logits[..., : self.vocab]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (of {self.vocab}), "
                f"bias={self.bias is not None}, rank={self.rank}, tp={self.tp}")


class _Collective(torch.autograd.Function):
    """Runs a collective (``run``, which returns a new tensor) on a tensor that autograd
    tracks, with a backward that refuses: the collectives here are outside autograd, and a
    gradient through them would be silently wrong (nothing would sum the gradients of the
    replicated activations over the ranks)."""

    @staticmethod
    def forward(ctx, y: Tensor, run) -> Tensor:
        return run(y)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("hybridgemm.parallel: a model sharded by parallelize is for inference: its collectives "
                           "have no backward (gradients are not reduced over the ranks)")


def _sum_over_ranks(y: Tensor, group: dist.ProcessGroup, group_name: str, one_shot: bool) -> Tensor:
    if one_shot and fits_one_shot(y, group_name):
        if y.requires_grad and torch.is_grad_enabled():
            return _Collective.apply(y, lambda t: tp_sum(t, group_name))
        return tp_sum(y, group_name)
    if torch.compiler.is_compiling():
        return funcol.all_reduce(y, "sum", group)
    if y.requires_grad and torch.is_grad_enabled():
        # autograd's output may not be changed in place: reduce a copy
        return _Collective.apply(y, lambda t: _sum_over_ranks(t.clone(), group, group_name, False))
    dist.all_reduce(y, group=group)
    return y


def _gather_last_dim(y: Tensor, group: dist.ProcessGroup, tp: int) -> Tensor:
    """The ranks' ``y`` concatenated along the last dim, in rank order."""
    if torch.compiler.is_compiling():
        # Gathered along dim 0, then the rank dim moved next to the last: Dynamo in torch 2.11
        # cannot trace a gather along another dim (pytorch/pytorch#179722); torch 2.13 traces both.
        g = funcol.all_gather_tensor(y.contiguous(), 0, group).view(tp, *y.shape)
        return g.movedim(0, -2).reshape(*y.shape[:-1], tp * y.shape[-1])
    if y.requires_grad and torch.is_grad_enabled():
        return _Collective.apply(y, lambda t: _gather_last_dim(t, group, tp))
    y = y.contiguous()
    parts = [torch.empty_like(y) for _ in range(tp)]
    dist.all_gather(parts, y, group=group)
    return torch.cat(parts, dim=-1)


# --- finding what to shard --------------------------------------------------------------

@dataclass
class _Job:
    """One module to shard: ``rules`` maps ``"child.param"`` to this rank's :class:`Shard`;
    ``attrs`` holds attributes of ``module`` to set to their local values."""

    kind: str  # "attention", "mlp" or "lm_head"
    name: str
    module: nn.Module
    rules: dict[str, Shard]
    attrs: dict[str, int] = field(default_factory=dict)
    rows: int = 0  # lm_head: rows per rank

    @property
    def label(self) -> str:
        """The name the report gives: the module's, or the LM head's own."""
        return _qual(self.name, _HEAD) if self.kind == "lm_head" else self.name or "(root)"


def _qual(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """Every name under which each module and parameter object is registered."""
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules():
        for slot, obj in (*m._modules.items(), *m._parameters.items()):
            if obj is not None:
                owners.setdefault(id(obj), []).append(_qual(mname, slot))
    return owners


def _children(name: str, mod: nn.Module, names: tuple[str, ...], owners: dict) -> tuple[list, str | None]:
    """The children ``names`` of ``mod`` and why they cannot be sharded (None if they can):
    each must be an exact ``nn.Linear`` registered, with its parameters, in this one place."""
    lins = [mod._modules.get(n) for n in names]
    if any(isinstance(lin, (RowParallelLinear, VocabParallelLinear)) for lin in lins):
        return lins, "already sharded by hybridgemm.parallelize"
    if not all(type(lin) is nn.Linear for lin in lins):
        kinds = ", ".join(type(lin).__name__ for lin in lins)
        return lins, (f"{'/'.join(names)} are {kinds}, not plain nn.Linear (for a patched model: "
                      "hybridgemm.unpatch, then parallelize, which patches afterwards)")
    for n, lin in zip(names, lins):
        here = _qual(name, n)
        for obj, where in ((lin, here), *((p, _qual(here, pn)) for pn, p in lin._parameters.items() if p is not None)):
            others = [o for o in owners.get(id(obj), ()) if o != where]
            if others:
                return lins, f"{where} is shared with {others[0]} (sharding it would untie them)"
    return lins, None


def _rows(start: int, count: int, full: int) -> Shard:
    return Shard(0, start, start + count, full)


def _linear_rules(child: str, lin: nn.Linear, shard: Shard) -> dict[str, Shard]:
    """The rules for a column-parallel ``lin`` (rows of its weight and bias) or, with a
    column shard, a row-parallel one (columns of its weight; its bias stays whole)."""
    rules = {f"{child}.weight": shard}
    if lin.bias is not None and shard.dim == 0:
        rules[f"{child}.bias"] = shard
    return rules


def _head_dim(mod: nn.Module) -> int | None:
    for source in (mod, getattr(mod, "config", None)):
        hd = getattr(source, "head_dim", None)
        if isinstance(hd, int) and not isinstance(hd, bool) and hd > 0:
            return hd
    return None


def _local_attrs(mod: nn.Module, values: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Of ``values`` (attribute: (full, local)), the int attributes ``mod`` has with the full value."""
    out = {}
    for attr, (full, local) in values.items():
        v = mod.__dict__.get(attr)
        if isinstance(v, int) and not isinstance(v, bool) and v == full:
            out[attr] = local
    return out


def _plan_attention(name: str, mod: nn.Module, rank: int, tp: int, owners: dict) -> _Job | str:
    lins, why = _children(name, mod, _ATTENTION, owners)
    if why:
        return why
    q, k, v, o = lins
    hd = _head_dim(mod)
    if hd is None:
        return "no head_dim attribute (on the module or its config): the head size is unknown"
    if (q.out_features % hd or k.out_features % hd or v.out_features != k.out_features
            or o.in_features != q.out_features or len({q.in_features, k.in_features, v.in_features}) > 1):
        return (f"projection widths (q {q.out_features}, k {k.out_features}, v {v.out_features}, o in "
                f"{o.in_features}) do not fit heads of {hd}")
    heads, kv_heads = q.out_features // hd, k.out_features // hd
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    try:
        h, kv = tp_local_heads(heads, kv_heads, tp)
    except ValueError as e:
        raise ValueError(f"hybridgemm.parallelize: {name}: {e}") from None
    q_rows = _rows(rank * h * hd, h * hd, heads * hd)
    kv_rows = _rows(rank * kv_heads // tp * hd, kv * hd, kv_heads * hd)  # the KV heads rank r's query heads read
    rules = {**_linear_rules("q_proj", q, q_rows), **_linear_rules("k_proj", k, kv_rows),
             **_linear_rules("v_proj", v, kv_rows),
             **_linear_rules("o_proj", o, Shard(1, q_rows.start, q_rows.stop, q_rows.full))}
    # Head counts some transformers versions keep on the module (and the attention width,
    # which older ones call hidden_size and reshape the heads' output with).
    attrs = _local_attrs(mod, {"num_heads": (heads, h), "num_attention_heads": (heads, h),
                               "num_key_value_heads": (kv_heads, kv), "hidden_size": (heads * hd, h * hd)})
    if "num_key_value_groups" in mod.__dict__:
        attrs["num_key_value_groups"] = h // kv
    return _Job("attention", name, mod, rules, attrs)


def _plan_mlp(name: str, mod: nn.Module, rank: int, tp: int, owners: dict) -> _Job | str:
    lins, why = _children(name, mod, _MLP, owners)
    if why:
        return why
    gate, up, down = lins
    width = gate.out_features
    if up.out_features != width or down.in_features != width or up.in_features != gate.in_features:
        return (f"gate_proj/up_proj/down_proj widths do not match (gate {gate.out_features}, up "
                f"{up.out_features}, down in {down.in_features})")
    try:
        local = tp_split(width, tp, "intermediate size")
    except ValueError as e:
        raise ValueError(f"hybridgemm.parallelize: {name}: {e}") from None
    cols = _rows(rank * local, local, width)
    rules = {**_linear_rules("gate_proj", gate, cols), **_linear_rules("up_proj", up, cols),
             **_linear_rules("down_proj", down, Shard(1, cols.start, cols.stop, width))}
    return _Job("mlp", name, mod, rules, _local_attrs(mod, {"intermediate_size": (width, local)}))


def _plan_head(name: str, mod: nn.Module, rank: int, tp: int, owners: dict) -> _Job | str:
    (head,), why = _children(name, mod, (_HEAD,), owners)
    if why:
        if type(head) is nn.Linear and "shared with" in why:
            return f"{why}; an LM head tied to the input embedding is left whole on every rank"
        return why
    vocab = head.out_features
    try:
        rows = tp_vocab_rows(vocab, tp)
    except ValueError as e:
        raise ValueError(f"hybridgemm.parallelize: {_qual(name, _HEAD)}: {e}") from None
    start = rank * rows
    return _Job("lm_head", name, mod, _linear_rules(_HEAD, head, _rows(start, min(rows, vocab - start), vocab)),
                rows=rows)


def _plan(model: nn.Module, rank: int, tp: int) -> tuple[list[_Job], list[tuple[str, str]]]:
    """Every module to shard, and the attention/MLP/head modules left whole (with why).
    Raises ``ValueError`` before anything is changed when a module cannot be split ``tp`` ways."""
    owners = _owners(model)
    jobs, skipped = [], []
    for name, mod in model.named_modules():
        for names, plan, label in ((_ATTENTION, _plan_attention, name), (_MLP, _plan_mlp, name),
                                   ((_HEAD,), _plan_head, _qual(name, _HEAD))):
            if any(mod._modules.get(n) is None for n in names):
                continue
            if _RECORD in mod.__dict__ and names[0] + ".weight" in mod.__dict__[_RECORD]:
                skipped.append((label, "already sharded by hybridgemm.parallelize"))
                continue
            job = plan(name, mod, rank, tp, owners)
            if isinstance(job, str):
                skipped.append((label, job))
            else:
                jobs.append(job)
    return jobs, skipped


def split_parts(model: nn.Module, tp: int) -> frozenset[str]:
    """Which of ``"attention"``, ``"mlp"`` and ``"lm_head"`` :func:`parallelize` splits ``tp``
    ways in ``model`` (an unpatched model, on any device, the meta one included): the kinds of
    module its plan shards; the others run whole on every rank. ``ValueError`` as
    :func:`parallelize` raises it when a module cannot be split ``tp`` ways."""
    jobs, _ = _plan(model, 0, tp)
    return frozenset(job.kind for job in jobs)


# --- sharding ---------------------------------------------------------------------------

def _apply(job: _Job, group: dist.ProcessGroup, rank: int, tp: int) -> None:
    mod = job.module
    for key, shard in job.rules.items():
        child, pname = key.rsplit(".", 1)
        lin = mod._modules[child]
        p = lin._parameters[pname]
        lin._parameters[pname] = nn.Parameter(shard.take(p, _qual(job.name, key)), requires_grad=p.requires_grad)
        lin.out_features, lin.in_features = lin.weight.shape
    for attr, value in job.attrs.items():
        setattr(mod, attr, value)
    mod.__dict__.setdefault(_RECORD, {}).update(job.rules)
    if job.kind == "attention":
        mod.o_proj = RowParallelLinear(mod.o_proj, group, rank, tp)
    elif job.kind == "mlp":
        mod.down_proj = RowParallelLinear(mod.down_proj, group, rank, tp)
    else:
        mod.lm_head = VocabParallelLinear(mod.lm_head, group, rank, tp, job.rules[f"{_HEAD}.weight"].full, job.rows)


def _resolve_group(group_or_mesh) -> dist.ProcessGroup:
    if group_or_mesh is not None and not isinstance(group_or_mesh, (DeviceMesh, dist.ProcessGroup)):
        raise TypeError(f"hybridgemm.parallelize: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or "
                        f"None (the default group), got {type(group_or_mesh).__name__}")
    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"hybridgemm.parallelize: expected a 1-D DeviceMesh (one tensor-parallel dimension), "
                             f"got a {group_or_mesh.ndim}-D mesh of shape {tuple(group_or_mesh.shape)}; pass the "
                             "tensor-parallel dimension, e.g. mesh['tp']")
        return group_or_mesh.get_group()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hybridgemm.parallelize: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first")
    return dist.group.WORLD if group_or_mesh is None else group_or_mesh


def parallelize(model: nn.Module, group_or_mesh: dist.ProcessGroup | DeviceMesh | None = None, *,
                patch: bool = True, one_shot_bytes: int = ONE_SHOT_MAX_BYTES, one_shot_kernel: str = "torch",
                **patch_kwargs) -> ParallelReport:
    """Shard ``model`` in place over the ranks of ``group_or_mesh`` (a ProcessGroup, a 1-D
    ``DeviceMesh``, or None for the default group); see the module docstring for what is
    split and how. Call it on every rank of the group, on identical models. With
    ``patch=True`` it then runs ``hybridgemm.patch(model, **patch_kwargs)`` (which fuses each
    rank's q/k/v). Returns a :class:`ParallelReport`.

    Row-parallel sums of up to ``one_shot_bytes`` use the one-shot symmetric-memory
    all-reduce on an NCCL group (:mod:`hybridgemm.parallel.collectives`; its buffer is allocated on
    the model's CUDA device, or the current one for a model not yet on a GPU, so call
    ``torch.cuda.set_device`` first); ``0`` keeps every sum on NCCL. ``one_shot_kernel``:
    ``"torch"`` (torch's op) or ``"push"`` (hybridgemm's, see :mod:`hybridgemm.parallel.collectives`),
    which also decides where a fused decoder layer adds its residual (the module docstring
    says how the two differ); ``"push"`` on a group without symmetric memory keeps that
    arithmetic over NCCL or gloo. A later call for the same group with other values replaces
    the buffer.
    ``report.all_reduce`` says which is used and, for NCCL, why.

    A group of one rank shards nothing (the patch still runs). ``TypeError`` for anything but
    an initialised eager ``nn.Module``, or a group of another type; ``ValueError`` for a mesh
    that is not 1-D, a process outside the group, or a model that cannot be split over the
    group's size (query heads ``tp`` does not divide, KV heads that are neither a multiple
    nor a divisor of ``tp``, an intermediate size ``tp`` does not divide, a vocabulary too
    small to give every rank rows), or an unknown ``one_shot_kernel``; nothing is changed
    when it raises.
    """
    _check_module(model, "hybridgemm.parallelize")
    if patch_kwargs and not patch:
        raise TypeError(f"hybridgemm.parallelize: {', '.join(patch_kwargs)} given with patch=False; they are "
                        "arguments of hybridgemm.patch")
    if one_shot_kernel not in ONE_SHOT_KERNELS:
        raise ValueError(f"hybridgemm.parallelize: one_shot_kernel must be one of {ONE_SHOT_KERNELS}, "
                         f"got {one_shot_kernel!r}")
    group = _resolve_group(group_or_mesh)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("hybridgemm.parallelize: this process is not a member of the given group")
    report = ParallelReport(tp=tp, rank=rank)
    if tp > 1:
        jobs, report.skipped = _plan(model, rank, tp)
        for job in jobs:
            _apply(job, group, rank, tp)
            getattr(report, job.kind).append(job.label)
        if not jobs:
            why = "; ".join(f"{n}: {r}" for n, r in report.skipped) or \
                "no q/k/v/o_proj, gate/up/down_proj or lm_head linears found"
            warnings.warn(f"hybridgemm.parallelize: nothing sharded ({why}); every rank runs the whole model",
                          stacklevel=2)
        if any(getattr(report, kind) for kind in ("attention", "mlp")):
            device = next((p.device for p in model.parameters() if p.is_cuda), None)
            why = enable_one_shot(group, one_shot_bytes, device, kernel=one_shot_kernel)
            report.all_reduce = (f"one-shot ({one_shot_kernel} kernel) through symmetric memory up to "
                                 f"{one_shot_capacity(group)} bytes, NCCL above" if why is None else f"nccl ({why})")
            for mod in model.modules():
                if isinstance(mod, RowParallelLinear) and mod.group_name == group.group_name:
                    mod.one_shot = why is None
                    mod.sums_residual = one_shot_kernel == "push"
    if patch:
        report.patch = _patch(model, **patch_kwargs)
    return report


def load_full_state_dict(model: nn.Module, state_dict, strict: bool = True, assign: bool = False):
    """Load a full (unsharded) stock state dict into a model :func:`parallelize` sharded:
    each tensor of a sharded parameter is cut with the rule ``parallelize`` applied to it
    (recorded on the modules, so this works on the model or on any module inside it);
    everything else loads as it is. Returns what ``model.load_state_dict`` returns
    (``strict``/``assign`` as there). ``ValueError`` naming the key when a tensor of a sharded
    parameter is not full-sized (an already sharded state dict, or another model's)."""
    _check_module(model, "hybridgemm.parallel.load_full_state_dict")
    rules = {}
    for name, mod in model.named_modules():
        for key, shard in mod.__dict__.get(_RECORD, {}).items():
            rules[_qual(name, key)] = shard
    out = OrderedDict()
    for key, t in state_dict.items():
        shard = rules.get(key)
        out[key] = shard.take(t, key) if shard is not None and isinstance(t, Tensor) else t
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return model.load_state_dict(out, strict=strict, assign=assign)


__all__ = ["ParallelReport", "RowParallelLinear", "Shard", "VocabParallelLinear", "load_full_state_dict",
           "parallelize", "split_parts"]
