"""``hybridgemm.patch(model)``: run a model's attention projections through hybridgemm;
``hybridgemm.unpatch(model)``: put the original modules back.

What is patched (found by structure, never by model name, so any architecture with the
same layout is covered; ``transformers`` is never imported here):

* a module with exact ``nn.Linear`` children ``q_proj/k_proj/v_proj`` (Llama, Qwen2,
  Mistral, ...) or ``query/key/value`` (BERT, ViT, ...): Q, K and V are *fused* into one
  GEMM (below); the output projection (``o_proj``/``out_proj`` child, or BERT/ViT's
  sibling ``output.dense``) becomes a :class:`~hybridgemm.HybridLinear`.
* GPT-2 style ``c_attn``/``c_proj`` (transformers' ``Conv1D``, ``x @ W + b`` with W stored
  (in, out)): each becomes a :class:`HybridConv1D`. ``c_attn`` is already one fused QKV GEMM.
* ``nn.MultiheadAttention``: becomes :class:`~hybridgemm.attention.HybridMultiheadAttention`.

How Q/K/V are fused without re-implementing any attention forward: the module's
``q_proj``, ``k_proj``, ``v_proj`` are replaced by three :class:`QKVSlice` modules backed by
one :class:`FusedQKV` (registered as ``qkv_proj`` on the attention module). The first
slice called with an input ``x`` runs ONE GEMM for all of Q, K and V and keeps the other
two slices; the next calls with the *same tensor object* (and the same version counter,
so an in-place change of ``x`` in between is detected) get their slice without a GEMM,
each slice handed out once. A call with any other input runs the fused GEMM for that
input. So the attention code works unchanged and can never get a slice of another
input's projection; cross-attention modules are not fused (their K/V read another input),
only their linears are swapped. Fine print: a record whose slices are not all taken (an
attention forward that skips V) keeps that one GEMM output alive until the module's next
call; concurrent forwards of one module stay correct (a slice only ever comes from the
record of the same input) but may redo the GEMM; under ``torch.compile`` only the
identity check applies (Dynamo cannot read version counters).

Parameters. ``HybridLinear``/``HybridMultiheadAttention`` are the *same* module objects
with their class swapped: parameters, state-dict keys, optimizer state all unchanged.
Fused Q/K/V: the fused weight is a new parameter (``...qkv_proj.weight``/``.bias``
replace the q/k/v keys in the state dict while patched: build the optimizer after
patching, save checkpoints after unpatching); the original ``nn.Linear`` parameters are
re-pointed at slices of it, so memory is not doubled, and on unpatch they get the current
(possibly trained, moved or cast) values in storage of their own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .attention import HybridMultiheadAttention
from .linear_layer import HybridLinear, linear

_QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
_OUT_NAMES = ("o_proj", "out_proj")
_UNDO_ATTR = "_hybridgemm_undo"
_FUSED_NAME = "qkv_proj"


@dataclass
class PatchReport:
    """What :func:`patch` did: ``patched`` lists every module name it changed (an attention
    module whose Q/K/V were fused is listed once, also in ``fused_qkv``); ``skipped`` holds
    ``(name, reason)`` for attention-like modules it left alone."""

    patched: list[str] = field(default_factory=list)
    fused_qkv: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.patched)

    def summary(self) -> str:
        if not self.patched:
            why = "; ".join(f"{n}: {r}" for n, r in self.skipped) or "no attention projections found"
            return f"hybridgemm.patch: nothing patched ({why})"
        return (f"hybridgemm.patch: patched {len(self.patched)} modules ({len(self.fused_qkv)} with fused QKV)"
                + (f", skipped {len(self.skipped)}" if self.skipped else ""))


class FusedQKV(nn.Module):
    """One weight for Q, K and V (rows stacked in that order) and the one-GEMM cache that
    the three :class:`QKVSlice` modules share (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, sizes: tuple[int, int, int],
                 originals: tuple[nn.Linear, ...] = ()):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.sizes = tuple(sizes)
        self._rec = None  # (x, x._version, [q, k, v] with handed-out slots set to None)
        object.__setattr__(self, "_originals", tuple(originals))  # not submodules
        self.alias_originals()

    def alias_originals(self) -> None:
        """Point the replaced linears' parameters at slices of the fused ones (no second
        copy of the weights while patched; someone holding an original still sees current
        values)."""
        if not self._originals:
            return
        ws = self.weight.detach().split(self.sizes)
        bs = self.bias.detach().split(self.sizes) if self.bias is not None else (None,) * 3
        for lin, wi, bi in zip(self._originals, ws, bs):
            lin.weight.data = wi
            if bi is not None:
                lin.bias.data = bi

    def _apply(self, fn, *args, **kwargs):
        # model.to()/.half()/.cuda() give the fused parameters new storage; re-point the
        # originals, or they would keep the old storage (and memory) alive.
        out = super()._apply(fn, *args, **kwargs)
        self.alias_originals()
        return out

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return linear(x, self.weight, self.bias).split_with_sizes(self.sizes, dim=-1)

    def part(self, x: Tensor, idx: int) -> Tensor:
        rec = self._rec  # read once: the checks and the slice come from the same record
        if rec is not None and rec[0] is x and rec[2][idx] is not None and _same_version(rec[1], x):
            out, rec[2][idx] = rec[2][idx], None
            if all(p is None for p in rec[2]):
                self._rec = None  # everything handed out: keep no reference to x or y
            return out
        parts = list(self.forward(x))
        out, parts[idx] = parts[idx], None
        self._rec = (x, _version(x), parts)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, sizes={self.sizes}, bias={self.bias is not None}"


def _version(x: Tensor) -> int:
    # Dynamo cannot read version counters (it makes them data-dependent symbols), so under
    # torch.compile only the identity check applies; eager calls check both.
    return -1 if torch.compiler.is_compiling() else x._version


def _same_version(v: int, x: Tensor) -> bool:
    return v == _version(x)


class QKVSlice(nn.Module):
    """Stands where ``q_proj``/``k_proj``/``v_proj`` stood; holds no parameters of its own.
    ``weight``/``bias`` are views of the fused parameters' rows (differentiable, and writes
    through them land in the fused storage), for code that inspects or reads them."""

    def __init__(self, fused: FusedQKV, idx: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: no duplicate state-dict keys
        self.idx = idx
        self.out_features = fused.sizes[idx]
        self.in_features = fused.weight.shape[1]

    def _rows(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        start = sum(self.fused.sizes[: self.idx])
        return t[start:start + self.out_features]

    @property
    def weight(self) -> Tensor:
        return self._rows(self.fused.weight)

    @property
    def bias(self) -> Tensor | None:
        return self._rows(self.fused.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.part(x, self.idx)

    def extra_repr(self) -> str:
        return f"{'qkv'[self.idx]} of fused qkv_proj, out_features={self.out_features}"


class HybridConv1D(nn.Module):
    """Stand-in for transformers' ``Conv1D`` (``y = x @ W + b``, W stored (in, out)) with the
    same ``weight``/``bias`` parameters. While patched, W is stored transposed in memory
    (same shape and values, strides ``(1, in)``) so that ``W.T`` is a row-major (out, in)
    matrix the GEMM reads without a copy; unpatch makes it contiguous again."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.nf, self.nx = conv.weight.shape[1], conv.weight.shape[0]
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"


def _is_conv1d(m: nn.Module) -> bool:
    t = type(m)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers") and \
        isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2


def _get(m: nn.Module, name: str):
    return m._modules.get(name)


def patch(model: nn.Module, fuse_qkv: bool = True, strict: bool = False) -> PatchReport:
    """Patch ``model`` in place (see the module docstring); returns a :class:`PatchReport`.

    ``fuse_qkv=False`` swaps each q/k/v linear on its own (state-dict keys unchanged).
    Nothing to patch: a warning and an empty report, or ``ValueError`` with ``strict=True``.
    Patching twice patches only what is new; :func:`unpatch` undoes every patch.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hybridgemm.patch: expected an nn.Module, got {type(model).__name__}")
    report = PatchReport()
    undo = model.__dict__.setdefault(_UNDO_ATTR, [])
    done: set[str] = set()  # module names handled as part of a parent

    def qual(parent: str, child: str) -> str:
        return f"{parent}.{child}" if parent else child

    def swap(name: str, mod: nn.Module, cls) -> None:
        undo.append(("class", name or "(root)", mod, type(mod)))
        mod.__class__ = cls
        report.patched.append(name or "(root)")
        done.add(name)

    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if name in done:
            continue
        if type(mod) is nn.MultiheadAttention:
            swap(name, mod, HybridMultiheadAttention)
            done.update(n for n in modules if n.startswith(qual(name, "")))
            continue
        c_attn = _get(mod, "c_attn")
        if c_attn is not None and _is_conv1d(c_attn):
            for child in ("c_attn", "c_proj"):
                conv = _get(mod, child)
                if conv is not None and _is_conv1d(conv):
                    new = HybridConv1D(conv)
                    with torch.no_grad():
                        new.weight.data = new.weight.data.t().contiguous().t()
                    undo.append(("conv1d", qual(name, child), mod, child, conv, new))
                    setattr(mod, child, new)
                    report.patched.append(qual(name, child))
                    done.add(qual(name, child))
            continue
        names = next((t for t in _QKV_NAMES if all(_get(mod, n) is not None for n in t)), None)
        if names is None:
            continue
        lins = [_get(mod, n) for n in names]
        if not all(type(lin) is nn.Linear for lin in lins):
            kinds = ", ".join(type(lin).__name__ for lin in lins)
            report.skipped.append((name, f"{'/'.join(names)} are {kinds}, not plain nn.Linear"))
            continue
        why_not = _why_not_fuse(mod, lins) if fuse_qkv else "fuse_qkv=False"
        if why_not is None:
            _fuse(name or "(root)", mod, names, lins, undo)
            report.patched.append(name or "(root)")
            report.fused_qkv.append(name or "(root)")
        else:
            if fuse_qkv:
                report.skipped.append((name, f"q/k/v not fused: {why_not}; swapped one by one"))
            for n, lin in zip(names, lins):
                swap(qual(name, n), lin, HybridLinear)
        done.update(qual(name, n) for n in names)
        out_name, out = _output_projection(name, mod, modules)
        if out is not None and out_name not in done:
            swap(out_name, out, HybridLinear)

    if not report.patched:
        if strict:
            raise ValueError(report.summary())
        warnings.warn(report.summary(), stacklevel=2)
    return report


def _output_projection(name: str, mod: nn.Module, modules: dict):
    for n in _OUT_NAMES:
        out = _get(mod, n)
        if type(out) is nn.Linear:
            return (f"{name}.{n}" if name else n), out
    # BERT/ViT: q/k/v live in `<attn>.self` (or `.attention`), the output in `<attn>.output.dense`
    if name:
        parent_name = name.rpartition(".")[0]
        output = _get(modules[parent_name], "output")
        dense = _get(output, "dense") if output is not None else None
        if type(dense) is nn.Linear:
            return (f"{parent_name}.output.dense" if parent_name else "output.dense"), dense
    return None, None


def _why_not_fuse(mod: nn.Module, lins: list[nn.Linear]) -> str | None:
    if getattr(mod, "is_cross_attention", False) or "Cross" in type(mod).__name__:
        return "cross-attention (K/V read another input)"
    if _get(mod, _FUSED_NAME) is not None or _FUSED_NAME in mod.__dict__:
        return f"the module already has an attribute {_FUSED_NAME!r}"
    if len({lin.in_features for lin in lins}) > 1:
        return "different in_features"
    params = [p for lin in lins for p in (lin.weight, lin.bias) if p is not None]
    if len({(p.dtype, p.device) for p in params}) > 1:
        return "different dtypes or devices"
    if len({p.requires_grad for p in params}) > 1:
        return "mixed requires_grad"
    if len({lin.bias is None for lin in lins}) > 1:
        return "some of q/k/v have a bias and some not"
    return None


def _fuse(name: str, mod: nn.Module, names, lins: list[nn.Linear], undo: list) -> None:
    sizes = tuple(lin.out_features for lin in lins)
    rg = lins[0].weight.requires_grad
    with torch.no_grad():
        w = nn.Parameter(torch.cat([lin.weight for lin in lins]), requires_grad=rg)
        b = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=rg) \
            if lins[0].bias is not None else None
    fused = FusedQKV(w, b, sizes, tuple(lins))
    mod.add_module(_FUSED_NAME, fused)
    for i, n in enumerate(names):
        setattr(mod, n, QKVSlice(fused, i))
    undo.append(("fused", name, mod, tuple(names), tuple(lins)))


def unpatch(model: nn.Module) -> list[str]:
    """Undo every :func:`patch` of ``model``; returns the names of the restored modules (last
    patched first; empty if nothing was patched). Restored modules are the original objects;
    their parameters hold the current (possibly trained, moved or cast) values."""
    undo = model.__dict__.pop(_UNDO_ATTR, [])
    restored = []
    for rec in reversed(undo):
        kind, name = rec[0], rec[1]
        restored.append(name)
        if kind == "class":
            _, _, mod, cls = rec
            mod.__class__ = cls
        elif kind == "conv1d":
            _, _, parent, child, conv, new = rec
            with torch.no_grad():
                conv.weight = new.weight
                conv.bias = new.bias
                conv.weight.data = conv.weight.data.contiguous()
            setattr(parent, child, conv)
        elif kind == "fused":
            _, _, mod, names, lins = rec
            fused = mod._modules.pop(_FUSED_NAME)
            sizes = fused.sizes
            with torch.no_grad():
                ws = fused.weight.detach().split(sizes)
                bs = fused.bias.detach().split(sizes) if fused.bias is not None else (None,) * 3
                for n, lin, wi, bi in zip(names, lins, ws, bs):
                    lin.weight.data = wi.clone()
                    if bi is not None:
                        lin.bias.data = bi.clone()
                    lin.weight.requires_grad_(fused.weight.requires_grad)
                    setattr(mod, n, lin)
            fused._rec = None
            object.__setattr__(fused, "_originals", ())
    return restored


__all__ = ["FusedQKV", "HybridConv1D", "PatchReport", "QKVSlice", "patch", "unpatch"]
