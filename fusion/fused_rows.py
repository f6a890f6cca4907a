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
keeps the stock keys: each slice writes a copy of its rows under its stock name (a tensor of
its own, as safetensors' ``save_model`` requires; a state dict thus holds the fused tensors
twice while it lives; ``keep_vars=True`` gives the rows themselves) and the fused module
writes nothing; a load-state-dict pre-hook on the parent concatenates the stock entries into
the fused ones before torch loads them. Hooks rather than parameters that are views of the
fused weight: a view of a parameter is not a leaf, so gradients and optimizer state must live
on the one fused parameter that the GEMM reads. Code that reaches a part's ``weight`` by its
stock name gets its rows (:class:`FusedRows`); assigning a part's ``weight`` or ``bias`` (as
transformers' loader does for a model patched before its weights arrive) copies into them.
PEFT's LoRA layers wrap a slice like any ``nn.Linear``: the base GEMM stays the fused one.
Which fused tensors are saved and loaded that way, and how a part is stored, is the fused
module's to say (:attr:`FusedLinears.STOCK_TENSORS`, :meth:`~FusedLinears.stock_part`,
:meth:`~FusedLinears.from_stock`): an FP8 fused weight (fusion/fp8_modules.py) adds its
scales, each part's in its checkpoint's layout. A slice may hold tensors of its own (an FP8
checkpoint's activation scales), saved and loaded as usual.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor, nn

from hybridgemm.kernels.fp8 import BLOCK

from .linear_layer import linear

UNDO_ATTR = "_hybridgemm_undo"
SEQ = itertools.count()  # orders undo records across modules and patch calls
# Instance attribute of an nn.Linear that holds an FP8 checkpoint's weight while patch() runs
# (fusion/models/fp8_checkpoints.py): its scales' granularity decides whether it can be fused.
FP8_SOURCE = "_hybridgemm_fp8_source"


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

    # The fused tensors that checkpoints hold per part, under the parts' stock names.
    STOCK_TENSORS: tuple[str, ...] = ("weight", "bias")

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

    # ----------------------------------------------------- checkpoints, part by part
    def part_rows(self, attr: str, t: Tensor) -> tuple[Tensor, ...]:
        """The fused tensor ``t`` (the fused ``attr``) split into the parts' rows (views)."""
        return t.split(self.sizes)

    def stock_name(self, attr: str, idx: int) -> str:
        """The name part ``idx`` stores ``attr`` under in a checkpoint."""
        return attr

    def stock_part(self, attr: str, idx: int) -> Tensor | None:
        """Part ``idx`` of the fused ``attr`` as its checkpoint stores it (a view of the rows
        where the layouts agree, as a stock state dict aliases its parameters)."""
        t = getattr(self, attr)
        return None if t is None else self.part_rows(attr, t)[idx]

    def from_stock(self, attr: str, idx: int, t: Tensor) -> Tensor:
        """A checkpoint's part ``idx`` of ``attr`` (checked by :meth:`stock_error`) in the fused
        layout, to be concatenated with the other parts."""
        return t

    def stock_error(self, attr: str, idx: int, key: str, t) -> str | None:
        """Why the checkpoint's ``t`` cannot be part ``idx`` of ``attr`` (None: it can), in
        the words torch uses for a stock module."""
        if not isinstance(t, Tensor):
            return f'While copying the parameter named "{key}", expected torch.Tensor from checkpoint but received ' \
                   f"{type(t)}"
        want = self.stock_part(attr, idx).shape
        if t.shape != want:
            return (f"size mismatch for {key}: copying a param with shape {t.shape} from checkpoint, the shape in "
                    f"current model is {want}.")
        return None

    def set_part(self, attr: str, idx: int, value: Tensor) -> None:
        """``<part>.<stock name> = value``, as transformers' loader sets each weight of a model
        patched before its weights arrive: ``value`` is checked as a checkpoint's part would be
        and copied into the part's rows. A fused tensor of another device or dtype (one still
        on the meta device, above all) is first made anew on ``value``'s, the other parts'
        rows converted (zeros where they are still meta), as assigning a new tensor would
        move a stock linear's."""
        key = f"{self.names[idx]}.{self.stock_name(attr, idx)}"
        current = getattr(self, attr)
        if current is None:
            raise ValueError(f"hybridgemm: cannot set {key}: the fused {'/'.join(self.names)} have no {attr}")
        why = self.stock_error(attr, idx, key, value)
        if why is not None:
            raise ValueError(f"hybridgemm: {why}")
        part = self.from_stock(attr, idx, value.detach())
        if (current.device, current.dtype) != (part.device, part.dtype) and not part.is_meta:
            made = torch.zeros(current.shape, dtype=part.dtype, device=part.device)
            if not current.is_meta:
                made.copy_(current.detach())
            if attr in self._parameters:
                self._parameters[attr] = nn.Parameter(made, requires_grad=current.requires_grad)
            else:
                self._buffers[attr] = made
        with torch.no_grad():
            self.part_rows(attr, getattr(self, attr).detach())[idx].copy_(part)
        self.alias_originals()

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


class FusedRows(Tensor):
    """A part's rows of a fused parameter, as its slice's ``weight``/``bias`` hands them out: a
    view (differentiable; in-place writes land in the fused storage) that passes for a
    parameter (``isinstance(t, nn.Parameter)``, so ``get_parameter("...q_proj.weight")``
    finds it). ``t.data = new`` copies into the rows, as assigning a stock parameter's data
    replaces its values (PEFT's safe merge does so). ``requires_grad`` is the fused
    parameter's, for all its parts at once: changing it through one part raises, naming
    what to do instead. Operations on it give plain tensors."""

    _is_param = True  # read by nn.Parameter's isinstance check
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self).as_subclass(Tensor)

    @data.setter
    def data(self, value: Tensor) -> None:
        if not isinstance(value, Tensor) or value.shape != self.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"hybridgemm: {self._name()} takes data of shape {tuple(self.shape)} (its rows of a fused "
                             f"parameter), got {got}")
        with torch.no_grad():
            self.data.copy_(value)

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> FusedRows:
        fused, _ = self.part_of
        if bool(requires_grad) != fused.weight.requires_grad:
            raise ValueError(
                f"hybridgemm: {self._name()} is rows of one parameter fused from {'/'.join(fused.names)} "
                f"(named_parameters() lists it): set requires_grad on that parameter (all of its parts), or "
                "patch the model with fuse_qkv=False (Q/K/V) or mlp=False (gate/up) to keep separate parameters")
        return self

    def _name(self) -> str:
        fused, idx = self.part_of
        return f"{fused.names[idx]}.{'weight' if self.dim() == 2 else 'bias'}"


class FusedSlice(nn.Linear):
    """Stands where one of the fused linears stood; holds no parameters of its own.
    ``weight``/``bias`` are views of the fused parameters' rows (differentiable, and writes
    through them land in the fused storage), for code that inspects or reads them; assigning
    them copies into those rows (:meth:`FusedLinears.set_part`). An ``nn.Linear`` to code that
    looks for one (PEFT wraps it in a LoRA layer whose base GEMM stays the fused one; an
    initializer writes into its rows), though it never holds the parameters
    ``nn.Linear.__init__`` makes."""

    def __init__(self, fused: FusedLinears, idx: int):
        nn.Module.__init__(self)
        object.__setattr__(self, "fused", fused)  # not a submodule: no duplicate state-dict keys
        self.idx = idx
        self.out_features = fused.sizes[idx]
        self.in_features = fused.weight.shape[1]

    def __setattr__(self, name: str, value) -> None:
        fused = self.__dict__.get("fused")
        attr = _stock_attr(fused, self.__dict__.get("idx"), name) if fused is not None else None
        if attr is None:
            super().__setattr__(name, value)
        elif value is None:
            raise ValueError(f"hybridgemm: cannot remove {name} of {fused.names[self.idx]}, one part of a fused "
                             f"projection ({'/'.join(fused.names)}); hybridgemm.unpatch restores separate linears")
        elif isinstance(value, Tensor):
            fused.set_part(attr, self.idx, value)
            if getattr(value, "_is_hf_initialized", False):
                # transformers' loader marks what it loaded; its initializer then leaves this module alone
                self.__dict__["_is_hf_initialized"] = True
        else:
            raise TypeError(f"hybridgemm: cannot assign {type(value).__name__} as {fused.names[self.idx]}.{name} "
                            "(torch.Tensor expected)")

    def _rows(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        start = sum(self.fused.sizes[: self.idx])
        rows = t[start:start + self.out_features].as_subclass(FusedRows)
        rows.part_of = (self.fused, self.idx)
        return rows

    @property
    def weight(self) -> Tensor:
        return self._rows(self.fused.weight)

    @property
    def bias(self) -> Tensor | None:
        return self._rows(self.fused.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        fused, own = self.fused, {}
        for attr in fused.STOCK_TENSORS:
            t = fused.stock_part(attr, self.idx)
            if t is not None:
                # keep_vars: the rows' differentiable view; else a copy of its own, as safetensors'
                # save_model/load_model refuse a state-dict tensor that covers part of its storage
                own[fused.stock_name(attr, self.idx)] = t if keep_vars else t.detach().clone()
        super()._save_to_state_dict(own, "", keep_vars)  # tensors of the slice's own (none for a stock linear)
        save_in_order(destination, prefix, own, self.__dict__.get("key_order"))

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.part(x, self.idx)

    def extra_repr(self) -> str:
        return f"{self.fused.names[self.idx]} of a fused projection, out_features={self.out_features}"


def _stock_attr(fused: FusedLinears, idx, name: str) -> str | None:
    """The fused tensor that a slice's attribute ``name`` is a part of (None: no such part)."""
    if idx is None:
        return None
    return next((a for a in fused.STOCK_TENSORS if fused.stock_name(a, idx) == name), None)


def save_in_order(destination, prefix: str, tensors: dict, order) -> None:
    """Write ``tensors`` (local name -> tensor) into ``destination`` under ``prefix``, in the
    order of the names in ``order`` (a replaced module's state-dict order; None: as they
    are), names not in it last."""
    order = tuple(order or ())
    for name in sorted(tensors, key=lambda n: order.index(n) if n in order else len(order)):
        destination[prefix + name] = tensors[name]


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
    replaces the stock ``<name>.weight`` entries (biases, and the scales of an FP8 weight:
    :attr:`FusedLinears.STOCK_TENSORS`) of ``state_dict`` by one ``<fused_name>.weight``
    (``.bias``, ...) that torch then loads into the fused module. A part that is absent is
    reported missing and keeps its current value; a part that does not fit (shape, or the
    fused module's own checks) is reported as torch reports one, under its stock name."""
    fused = module._modules.get(fused_name)
    if not isinstance(fused, FusedLinears):
        return
    for attr in fused.STOCK_TENSORS:
        current = getattr(fused, attr)
        if current is None:
            continue  # stock bias keys stay: the slices report them unexpected, as a bias-less Linear would
        keys = [f"{prefix}{n}.{fused.stock_name(attr, i)}" for i, n in enumerate(fused.names)]
        present = [k in state_dict for k in keys]
        if not any(present):
            if strict and f"{prefix}{fused_name}.{attr}" not in state_dict:
                missing_keys.extend(keys)
            continue
        parts, ok = [], True
        for i, (key, here, cur) in enumerate(zip(keys, present, fused.part_rows(attr, current.detach()))):
            if not here:
                if strict:
                    missing_keys.append(key)
                parts.append(cur)
                continue
            t = state_dict.pop(key)
            why = fused.stock_error(attr, i, key, t)
            if why is not None:
                error_msgs.append(why)
                ok = False
                continue
            parts.append(fused.from_stock(attr, i, t))
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
    return _why_not_fuse_fp8(lins, what)


def _why_not_fuse_fp8(lins: list[nn.Linear], what: str) -> str | None:
    """An FP8 checkpoint's linears fuse when their scales are of one granularity and, per
    128 x 128 block, every part holds whole blocks of rows (a block then lies in one part)."""
    sources = [lin.__dict__.get(FP8_SOURCE) for lin in lins]
    if all(src is None for src in sources):
        return None
    if any(src is None for src in sources):
        return f"some of {what} are FP8 and some not"
    kinds = [src.granularity for src in sources]
    if len(set(kinds)) > 1:
        return f"their FP8 scales are of different granularities ({', '.join(kinds)})"
    if kinds[0] == "block128" and any(lin.out_features % BLOCK for lin in lins):
        return f"their FP8 scales are per {BLOCK}x{BLOCK} block and not every part holds whole blocks of rows"
    return None


def _get(m: nn.Module, name: str):
    return m._modules.get(name)


def adapter_base(mod: nn.Module | None) -> nn.Module | None:
    """The module an adapter layer wraps (PEFT's LoRA layers hold it as ``base_layer`` and run
    it, adding their own term), or None for anything else."""
    base = mod._modules.get("base_layer") if isinstance(mod, nn.Module) else None
    return base if base is not None and callable(getattr(mod, "get_base_layer", None)) else None


def stock_slot(parent: nn.Module, name: str) -> tuple[str, nn.Module | None]:
    """Where ``parent``'s linear ``name`` lives: (``name``, the module), or for one that an
    adapter layer wraps, (``name.base_layer``, the wrapped linear): patching that base keeps
    the adapter running on top of it."""
    mod = _get(parent, name)
    base = adapter_base(mod)
    return (f"{name}.base_layer", base) if base is not None else (name, mod)


def _set_child(parent: nn.Module, path: str, child: nn.Module) -> None:
    owner_path, _, attr = path.rpartition(".")
    setattr(parent.get_submodule(owner_path) if owner_path else parent, attr, child)


def fuse(mod: nn.Module, names, lins: list[nn.Linear], fused_name: str) -> FusedLinears:
    """Replace ``mod``'s linears ``names`` (paths below ``mod``: ``q_proj``, or
    ``q_proj.base_layer`` under an adapter, :func:`stock_slot`) by slices of one
    :class:`FusedLinears` registered as ``fused_name``; recorded on ``mod`` for :func:`unfuse`."""
    sizes = tuple(lin.out_features for lin in lins)
    rg = lins[0].weight.requires_grad
    with torch.no_grad():
        w = nn.Parameter(torch.cat([lin.weight for lin in lins]), requires_grad=rg)
        b = nn.Parameter(torch.cat([lin.bias for lin in lins]), requires_grad=rg) \
            if lins[0].bias is not None else None
    fused = FusedLinears(w, b, sizes, tuple(lins), tuple(names))
    mod.add_module(fused_name, fused)
    for i, n in enumerate(names):
        _set_child(mod, n, FusedSlice(fused, i))
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
            _set_child(mod, n, lin)
    fused._rec = None
    object.__setattr__(fused, "_originals", ())
