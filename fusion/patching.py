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
Fused Q/K/V: the fused weight and bias are new parameters; ``named_parameters()`` lists
``...qkv_proj.weight``/``.bias`` in place of the q/k/v ones, so build the optimizer after
patching (an optimizer's state dict then fits only a model patched the same way). The
original ``nn.Linear`` parameters are re-pointed at slices of them, so memory is not
doubled, and on unpatch they get the current (possibly trained, moved or cast) values in
storage of their own.

Checkpoints. A patched model's ``state_dict()`` has the stock keys, in the stock order, with
the stock values, so ``save_pretrained``/``torch.save`` write a stock checkpoint and a stock
checkpoint loads into a patched model. Saving: each :class:`QKVSlice` writes its rows of the
fused parameters under its stock name (``q_proj.weight``, ...; views, not copies, as a stock
state dict aliases the parameters) and :class:`FusedQKV` writes nothing. Loading: a
load-state-dict pre-hook on the attention module concatenates the stock q/k/v entries into
``qkv_proj.weight``/``.bias`` before torch loads the fused module, so ``strict``,
``assign=True`` and missing/unexpected/size-mismatch reports (under the stock names) behave
as they do for the stock module; a state dict with ``qkv_proj`` keys loads too. State-dict
hooks rather than parameters that are views of the fused weight: a view of a parameter is
not a leaf, so gradients and optimizer state must live on the one fused parameter that the
GEMM reads. :class:`HybridConv1D`'s state dict holds a contiguous copy of its weight (the
parameter is stored transposed while patched; safetensors refuses non-contiguous tensors).

Tied weights. Fusing copies Q, K and V into one new parameter, which would untie weights
that are shared. So Q/K/V are not fused (each linear is swapped on its own, which keeps
every parameter object, hence every tie; the report says why) when one of the q/k/v linears,
or one of their parameters, is registered in more than one place under the patched root
(``k_proj is q_proj``, ``k_proj.weight is q_proj.weight``, a weight shared with another layer).
A tie to a module outside the patched root cannot be seen: patch the model that holds both.

Bookkeeping. Each change is recorded on the module it changed (the swapped module, or the
attention module whose children were replaced), so :func:`unpatch` of any module undoes
every patch applied anywhere under it, whichever module ``patch`` was called on, most
recent first. Patching an already patched module changes nothing (the report lists it in
``already_patched``). TorchScript modules (``torch.jit.script``/``trace``) are compiled
code that cannot be changed in place: ``patch`` refuses one, and skips one found inside an
eager model.
"""

from __future__ import annotations

import itertools
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
_SEQ = itertools.count()  # orders undo records across modules and patch calls


@dataclass
class PatchReport:
    """What :func:`patch` did: ``patched`` lists every module name it changed (an attention
    module whose Q/K/V were fused is listed once, also in ``fused_qkv``); ``skipped`` holds
    ``(name, reason)`` for attention-like modules it left alone or did not fuse;
    ``already_patched`` lists what an earlier :func:`patch` had changed (left as it is)."""

    patched: list[str] = field(default_factory=list)
    fused_qkv: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    already_patched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.patched)

    def summary(self) -> str:
        if not self.patched:
            why = [f"{n or '(root)'}: {r}" for n, r in self.skipped]
            if self.already_patched:
                shown = ", ".join(self.already_patched[:4]) + (", ..." if len(self.already_patched) > 4 else "")
                why.append(f"{len(self.already_patched)} modules already patched by an earlier hybridgemm.patch "
                           f"({shown}); call hybridgemm.unpatch first to patch them again")
            return f"hybridgemm.patch: nothing patched ({'; '.join(why) or 'no attention projections found'})"
        return (f"hybridgemm.patch: patched {len(self.patched)} modules ({len(self.fused_qkv)} with fused QKV)"
                + (f", skipped {len(self.skipped)}" if self.skipped else "")
                + (f", {len(self.already_patched)} already patched" if self.already_patched else ""))


class FusedQKV(nn.Module):
    """One weight for Q, K and V (rows stacked in that order) and the one-GEMM cache that
    the three :class:`QKVSlice` modules share (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, sizes: tuple[int, int, int],
                 originals: tuple[nn.Linear, ...] = (), names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.sizes = tuple(sizes)
        self.names = tuple(names)  # the slices' attribute names on the attention module (state-dict keys)
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
            _repoint(lin, "weight", wi)
            if bi is not None:
                _repoint(lin, "bias", bi)

    def _apply(self, fn, *args, **kwargs):
        # model.to()/.half()/.cuda() give the fused parameters new storage; re-point the
        # originals, or they would keep the old storage (and memory) alive.
        out = super()._apply(fn, *args, **kwargs)
        self.alias_originals()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the slices save the fused parameters' rows under the stock q/k/v names

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Its own keys are optional: checkpoints carry the stock q/k/v names, which the
        # attention module's pre-hook (_load_stock_qkv) turns into these keys, reporting
        # absent ones as missing under their stock names.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, [], unexpected_keys, error_msgs)
        self.alias_originals()  # assign=True or swapped tensors give the parameters new storage

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


def _repoint(lin: nn.Linear, name: str, t: Tensor) -> None:
    """``lin.<name>.data = t``; where torch refuses that (meta -> real device, as after
    ``load_state_dict(assign=True)`` or ``to_empty``) a new parameter takes the old one's place."""
    p = lin._parameters[name]
    try:
        p.data = t
    except RuntimeError:
        lin._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)


def _version(x: Tensor) -> int:
    # Dynamo cannot read version counters (it makes them data-dependent symbols), so under
    # torch.compile only the identity check applies; eager calls check both.
    return -1 if torch.compiler.is_compiling() else x._version


def _same_version(v: int, x: Tensor) -> bool:
    return v == _version(x)


def _load_stock_qkv(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                    error_msgs) -> None:
    """Load-state-dict pre-hook of an attention module whose Q/K/V are fused: replaces the
    stock ``q_proj.weight``/``k_proj.weight``/``v_proj.weight`` entries (and biases) of
    ``state_dict`` by one ``qkv_proj.weight`` (``.bias``) that torch then loads into the
    fused parameter. A part that is absent is reported missing and keeps its current value;
    a part of the wrong shape is reported as torch reports one, under its stock name."""
    fused = module._modules.get(_FUSED_NAME)
    if not isinstance(fused, FusedQKV):
        return
    for attr in ("weight", "bias"):
        current = getattr(fused, attr)
        if current is None:
            continue  # stock bias keys stay: the slices report them unexpected, as a bias-less Linear would
        keys = [f"{prefix}{n}.{attr}" for n in fused.names]
        present = [k in state_dict for k in keys]
        if not any(present):
            if strict and f"{prefix}{_FUSED_NAME}.{attr}" not in state_dict:
                missing_keys.extend(keys)
            continue
        parts, ok = [], True
        for key, here, cur in zip(keys, present, current.detach().split(fused.sizes)):
            if not here:
                if strict:
                    missing_keys.append(key)
                parts.append(cur)
                continue
            t = state_dict.pop(key)
            if not isinstance(t, Tensor):
                error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor from checkpoint '
                                  f"but received {type(t)}")
                ok = False
            elif t.shape != cur.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {t.shape} from checkpoint, "
                                  f"the shape in current model is {cur.shape}.")
                ok = False
            parts.append(t)
        if ok:
            device = next(t.device for t, here in zip(parts, present) if here)
            state_dict[f"{prefix}{_FUSED_NAME}.{attr}"] = torch.cat([t.to(device) for t in parts])


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

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in ("weight", "bias"):
            t = self._rows(getattr(self.fused, name))
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()

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
        self.store_transposed()

    def store_transposed(self) -> None:
        """Give W the (in, out)-shaped, transposed-in-memory layout (a copy unless it has it)."""
        if self.weight.dim() == 2 and not self.weight.t().is_contiguous():
            self.weight.data = self.weight.data.t().contiguous().t()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # the stock layout: safetensors and .view() need a contiguous tensor
            destination[prefix + "weight"] = self.weight.detach().contiguous()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.store_transposed()  # assign=True puts the checkpoint's (contiguous) tensor in place

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


def _qual(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _check_module(model, who: str) -> None:
    """TypeError unless ``model`` is an initialised eager ``nn.Module``."""
    if isinstance(model, torch.jit.ScriptModule):
        if who.endswith("unpatch"):
            raise TypeError(f"{who}: got a TorchScript module ({type(model).__name__}); hybridgemm.patch never "
                            "patches one, so there is nothing to undo: unpatch the eager nn.Module it was made from")
        raise TypeError(f"{who}: got a TorchScript module ({type(model).__name__}, made by torch.jit.script or "
                        "torch.jit.trace); its forward is compiled TorchScript, which cannot be patched in place. "
                        "Patch the eager nn.Module instead (a patched model runs under torch.compile)")
    if not isinstance(model, nn.Module):
        if isinstance(model, type) and issubclass(model, nn.Module):
            got = f"the class {model.__name__} (pass an instance)"
        else:
            got = "None" if model is None else type(model).__name__
        raise TypeError(f"{who}: expected an nn.Module, got {got}")
    if not isinstance(model.__dict__.get("_modules"), dict):
        raise TypeError(f"{who}: this {type(model).__name__} is not an initialised nn.Module (its __init__ must "
                        "call super().__init__() first)")


def _records(mod: nn.Module) -> list:
    return mod.__dict__.get(_UNDO_ATTR) or []


def _record(mod: nn.Module, rec: tuple) -> None:
    mod.__dict__.setdefault(_UNDO_ATTR, []).append(rec)


def _record_name(name: str, rec: tuple) -> str:
    """The module name a record stands for, given the name of the module that holds it."""
    return _qual(name, rec[2]) if rec[0] == "conv1d" else (name or "(root)")


def patch(model: nn.Module, fuse_qkv: bool = True, strict: bool = False) -> PatchReport:
    """Patch ``model`` in place (see the module docstring); returns a :class:`PatchReport`.

    ``fuse_qkv=False`` swaps each q/k/v linear on its own (state-dict keys unchanged).
    Nothing to patch: a warning and an empty report, or ``ValueError`` with ``strict=True``.
    What an earlier patch changed is left as it is (``report.already_patched``); only what
    is new gets patched. :func:`unpatch` of ``model`` or of any module above it undoes it all.
    ``TypeError`` for anything but an eager ``nn.Module`` (TorchScript modules included).
    """
    _check_module(model, "hybridgemm.patch")
    report = PatchReport()
    done: set[str] = set()  # module names handled as part of a parent
    modules = dict(model.named_modules())

    # Where each module and parameter object is registered (tied weights, shared modules).
    owners: dict[int, list[str]] = {}
    for mname, m in modules.items():
        if isinstance(m, torch.jit.ScriptModule):
            continue
        for slot, obj in (*m._modules.items(), *m._parameters.items()):
            if obj is not None:
                owners.setdefault(id(obj), []).append(_qual(mname, slot))

    def subtree(name: str):
        prefix = _qual(name, "")
        return (n for n in modules if n.startswith(prefix))

    def swap(name: str, mod: nn.Module, cls) -> None:
        if _records(mod):
            return  # a module registered under several names: swapped once
        _record(mod, ("class", next(_SEQ), type(mod)))
        mod.__class__ = cls
        report.patched.append(name or "(root)")
        done.add(name)

    for name, mod in modules.items():
        if name in done:
            continue
        if isinstance(mod, torch.jit.ScriptModule):
            report.skipped.append((name, f"TorchScript module ({type(mod).__name__}): compiled code, cannot be "
                                         "patched in place"))
            done.update(subtree(name))
            continue
        recs = _records(mod)
        if recs:  # changed by an earlier patch
            report.already_patched.extend(_record_name(name, rec) for rec in recs)
            if isinstance(mod, nn.MultiheadAttention):
                done.update(subtree(name))
            continue
        if type(mod) is nn.MultiheadAttention:
            swap(name, mod, HybridMultiheadAttention)
            done.update(subtree(name))
            continue
        c_attn = _get(mod, "c_attn")
        if c_attn is not None and _is_conv1d(c_attn):
            for child in ("c_attn", "c_proj"):
                conv = _get(mod, child)
                if conv is not None and _is_conv1d(conv):
                    new = HybridConv1D(conv)
                    _record(mod, ("conv1d", next(_SEQ), child, conv, new))
                    setattr(mod, child, new)
                    report.patched.append(_qual(name, child))
                    done.add(_qual(name, child))
            continue
        names = next((t for t in _QKV_NAMES if all(_get(mod, n) is not None for n in t)), None)
        if names is None:
            continue
        lins = [_get(mod, n) for n in names]
        if all(_records(lin) for lin in lins):
            continue  # swapped one by one by an earlier patch (listed in already_patched)
        if not all(type(lin) is nn.Linear for lin in lins):
            kinds = ", ".join(type(lin).__name__ for lin in lins)
            report.skipped.append((name, f"{'/'.join(names)} are {kinds}, not plain nn.Linear"))
            continue
        why_not = _why_not_fuse(name, mod, names, lins, owners) if fuse_qkv else "fuse_qkv=False"
        if why_not is None:
            _fuse(mod, names, lins)
            report.patched.append(name or "(root)")
            report.fused_qkv.append(name or "(root)")
        else:
            if fuse_qkv:
                report.skipped.append((name, f"q/k/v not fused: {why_not}; swapped one by one"))
            for n, lin in zip(names, lins):
                swap(_qual(name, n), lin, HybridLinear)
        done.update(_qual(name, n) for n in names)
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


def _why_not_fuse(name: str, mod: nn.Module, names, lins: list[nn.Linear], owners: dict) -> str | None:
    if getattr(mod, "is_cross_attention", False) or "Cross" in type(mod).__name__:
        return "cross-attention (K/V read another input)"
    if _get(mod, _FUSED_NAME) is not None or _FUSED_NAME in mod.__dict__:
        return f"the module already has an attribute {_FUSED_NAME!r}"
    # A fused copy of a shared module or parameter would untie it from its other uses.
    for n, lin in zip(names, lins):
        here = _qual(name, n)
        others = [o for o in owners.get(id(lin), ()) if o != here]
        if others:
            return f"{here} is the same nn.Linear as {others[0]} (shared weights; fusing would untie them)"
        for pname, p in lin._parameters.items():
            here_p = _qual(here, pname)
            others = [o for o in owners.get(id(p), ()) if o != here_p] if p is not None else []
            if others:
                return f"{here_p} is tied to {others[0]} (the same parameter; fusing would untie them)"
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


def _fuse(mod: nn.Module, names, lins: list[nn.Linear]) -> None:
    sizes = tuple(lin.out_features for lin in lins)
    rg = lins[0].weight.requires_grad
    with torch.no_grad():
        w = nn.Parameter(torch.cat([lin.weight for lin in lins]), requires_grad=rg)
        b = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=rg) \
            if lins[0].bias is not None else None
    fused = FusedQKV(w, b, sizes, tuple(lins), tuple(names))
    mod.add_module(_FUSED_NAME, fused)
    for i, n in enumerate(names):
        setattr(mod, n, QKVSlice(fused, i))
    hook = mod.register_load_state_dict_pre_hook(_load_stock_qkv)
    _record(mod, ("fused", next(_SEQ), tuple(names), tuple(lins), hook))


def unpatch(model: nn.Module) -> list[str]:
    """Undo every :func:`patch` applied to ``model`` or to any module under it (whichever
    module ``patch`` was called on); returns the names (relative to ``model``) of the
    restored modules, most recently patched first, empty if nothing was patched. Restored
    modules are the original objects; their parameters hold the current (possibly trained,
    moved or cast) values. ``TypeError`` for anything but an eager ``nn.Module``."""
    _check_module(model, "hybridgemm.unpatch")
    found = []
    for name, mod in model.named_modules():
        for rec in mod.__dict__.pop(_UNDO_ATTR, None) or ():
            found.append((rec[1], name, mod, rec))
    found.sort(key=lambda item: item[0], reverse=True)
    restored = []
    for _, name, mod, rec in found:
        restored.append(_record_name(name, rec))
        kind = rec[0]
        if kind == "class":
            mod.__class__ = rec[2]
        elif kind == "conv1d":
            _, _, child, conv, new = rec
            with torch.no_grad():
                conv.weight = new.weight
                conv.bias = new.bias
                conv.weight.data = conv.weight.data.contiguous()
            setattr(mod, child, conv)
        elif kind == "fused":
            _, _, names, lins, hook = rec
            hook.remove()
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
