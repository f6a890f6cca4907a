"""Several ``nn.Linear`` children of one module that read the same input, run as ONE GEMM over
their stacked weights: Q/K/V of an attention module (``qkv_proj``), gate/up of a gated MLP
(``gate_up_proj``). Used by :func:`hybridgemm.patch` (fusion/models/patching.py, fusion/mlp.py).

The children are replaced by :class:`FusedSlice` modules backed by one :class:`FusedLinears`
(registered under the fused name on the parent). The first slice called with an input ``x``
runs the one GEMM and keeps the other parts; the next calls with the *same tensor object*
(and the same version counter, so an in-place change of ``x`` in between is detected) get
their part without a GEMM, each part handed out once. A call with any other input runs the
fused GEMM for that input. Code that calls the children one by one works unchanged and can
never get a part of another input's projection. Fine print: a record whose parts are not all
taken keeps that one GEMM output alive until the next call; concurrent forwards of one module
stay correct (a part only ever comes from the record of the same input) but may redo the
GEMM; under ``torch.compile`` only the identity check applies (Dynamo cannot read version
counters).

Parameters and checkpoints: the fused weight and bias are new parameters (the replaced
linears' parameters are re-pointed at their rows, so memory is not doubled). The state dict
keeps the stock keys: each slice writes its rows under its stock name and the fused module
writes nothing; a load-state-dict pre-hook on the parent concatenates the stock entries into
the fused ones before torch loads them. Hooks rather than parameters that are views of the
fused weight: a view of a parameter is not a leaf, so gradients and optimizer state must live
on the one fused parameter that the GEMM reads.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor, nn

from .linear_layer import linear

UNDO_ATTR = "_hybridgemm_undo"
SEQ = itertools.count()  # orders undo records across modules and patch calls


def qual(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def records(mod: nn.Module) -> list:
    return mod.__dict__.get(UNDO_ATTR) or []


def record(mod: nn.Module, rec: tuple) -> None:
    """Note a change on the module it changed, for ``unpatch`` (rec[0] kind, rec[1] order)."""
    mod.__dict__.setdefault(UNDO_ATTR, []).append(rec)


class FusedLinears(nn.Module):
    """One weight for several projections of the same input (rows stacked in ``names``
    order) and the one-GEMM cache that their :class:`FusedSlice` modules share."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, sizes: tuple[int, ...],
                 originals: tuple[nn.Linear, ...] = (), names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.sizes = tuple(sizes)
        self.names = tuple(names)  # the slices' attribute names on the parent module (state-dict keys)
        self._rec = None  # (x, x._version, [parts] with handed-out slots set to None)
        object.__setattr__(self, "_originals", tuple(originals))  # not submodules
        self.alias_originals()

    def alias_originals(self) -> None:
        """Point the replaced linears' parameters at slices of the fused ones (no second
        copy of the weights while patched; someone holding an original still sees current
        values)."""
        if not self._originals:
            return
        ws = self.weight.detach().split(self.sizes)
        bs = self.bias.detach().split(self.sizes) if self.bias is not None else (None,) * len(self.sizes)
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
        pass  # the slices save the fused parameters' rows under the stock names

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Its own keys are optional: checkpoints carry the stock names, which the parent's
        # pre-hook (load_stock_parts) turns into these keys, reporting absent ones as missing
        # under their stock names.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, [], unexpected_keys, error_msgs)
        self.alias_originals()  # assign=True or swapped tensors give the parameters new storage

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return linear(x, self.weight, self.bias).split_with_sizes(self.sizes, dim=-1)

    def part(self, x: Tensor, idx: int) -> Tensor:
        rec = self._rec  # read once: the checks and the part come from the same record
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


class FusedSlice(nn.Module):
    """Stands where one of the fused linears stood; holds no parameters of its own.
    ``weight``/``bias`` are views of the fused parameters' rows (differentiable, and writes
    through them land in the fused storage), for code that inspects or reads them."""

    def __init__(self, fused: FusedLinears, idx: int):
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
        return f"{self.fused.names[self.idx]} of a fused projection, out_features={self.out_features}"


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


def load_stock_parts(fused_name: str, module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre-hook (bound to ``fused_name``) of a module whose linears are fused:
    replaces the stock ``<name>.weight`` entries (and biases) of ``state_dict`` by one
    ``<fused_name>.weight`` (``.bias``) that torch then loads into the fused parameter. A part
    that is absent is reported missing and keeps its current value; a part of the wrong shape
    is reported as torch reports one, under its stock name."""
    fused = module._modules.get(fused_name)
    if not isinstance(fused, FusedLinears):
        return
    for attr in ("weight", "bias"):
        current = getattr(fused, attr)
        if current is None:
            continue  # stock bias keys stay: the slices report them unexpected, as a bias-less Linear would
        keys = [f"{prefix}{n}.{attr}" for n in fused.names]
        present = [k in state_dict for k in keys]
        if not any(present):
            if strict and f"{prefix}{fused_name}.{attr}" not in state_dict:
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
            state_dict[f"{prefix}{fused_name}.{attr}"] = torch.cat([t.to(device) for t in parts])


def why_not_fuse(name: str, mod: nn.Module, names, lins: list[nn.Linear], owners: dict, fused_name: str,
                 what: str) -> str | None:
    """Why the linears ``names`` of ``mod`` cannot be fused (None: they can). ``owners`` maps
    id(module or parameter) to every name it is registered under in the patched model."""
    if _get(mod, fused_name) is not None or fused_name in mod.__dict__:
        return f"the module already has an attribute {fused_name!r}"
    # A fused copy of a shared module or parameter would untie it from its other uses.
    for n, lin in zip(names, lins):
        here = qual(name, n)
        others = [o for o in owners.get(id(lin), ()) if o != here]
        if others:
            return f"{here} is the same nn.Linear as {others[0]} (shared weights; fusing would untie them)"
        for pname, p in lin._parameters.items():
            here_p = qual(here, pname)
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
        return f"some of {what} have a bias and some not"
    return None


def _get(m: nn.Module, name: str):
    return m._modules.get(name)


def fuse(mod: nn.Module, names, lins: list[nn.Linear], fused_name: str) -> FusedLinears:
    """Replace ``mod``'s linears ``names`` by slices of one :class:`FusedLinears` registered
    as ``fused_name``; recorded on ``mod`` for :func:`unfuse`."""
    sizes = tuple(lin.out_features for lin in lins)
    rg = lins[0].weight.requires_grad
    with torch.no_grad():
        w = nn.Parameter(torch.cat([lin.weight for lin in lins]), requires_grad=rg)
        b = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=rg) \
            if lins[0].bias is not None else None
    fused = FusedLinears(w, b, sizes, tuple(lins), tuple(names))
    mod.add_module(fused_name, fused)
    for i, n in enumerate(names):
        setattr(mod, n, FusedSlice(fused, i))
    hook = mod.register_load_state_dict_pre_hook(functools.partial(load_stock_parts, fused_name))
    record(mod, ("fused", next(SEQ), tuple(names), tuple(lins), hook, fused_name))
    return fused


def unfuse(mod: nn.Module, rec: tuple) -> None:
    """Undo :func:`fuse`: the original linears come back holding the current fused values in
    storage of their own."""
    _, _, names, lins, hook, fused_name = rec
    hook.remove()
    fused = mod._modules.pop(fused_name)
    sizes = fused.sizes
    with torch.no_grad():
        ws = fused.weight.detach().split(sizes)
        bs = fused.bias.detach().split(sizes) if fused.bias is not None else (None,) * len(sizes)
        for n, lin, wi, bi in zip(names, lins, ws, bs):
            lin.weight.data = wi.clone()
            if bi is not None:
                lin.bias.data = bi.clone()
            lin.weight.requires_grad_(fused.weight.requires_grad)
            setattr(mod, n, lin)
    fused._rec = None
    object.__setattr__(fused, "_originals", ())
