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

Parameters. Each slice keeps its stock parameters (``q_proj.weight``, ``q_proj.bias``: the
replaced linear's own parameter objects), and each is a leaf of its own (:class:`FusedPart`:
its own ``requires_grad``, ``.grad`` and optimizer state) whose storage is its rows of one
stacked tensor, the fused module's ``stacked_weight`` (``stacked_bias``; a tensor attribute,
not a parameter or buffer), which the GEMM reads. So ``named_parameters()``,
``get_parameter``, freezing by name and optimizers built before or after patching see the
stock parameters, and memory is not doubled. Where autograd needs it, the stacked tensor
enters the graph through :class:`_StackedParts`, whose backward hands each part its rows of
the gradient (a frozen part gets none). ``part.data = t`` of the part's own shape, dtype and
device copies into its rows. Whatever gives a part storage of its own through torch's or
hybridgemm's API (``model.to()``, a ``.data`` of another dtype or device, a new part
parameter put in place, as accelerate's loaders and ``register_parameter`` do) makes the fused
module stack the parts anew before its next GEMM (``.to()`` at once; inside a compiled graph
the check is not traced: there the next eager call restacks). Tensors that are not parameters
put in the parts' places for one call (``torch.func.functional_call``) are stacked for that
call only, as are the values of a part parametrized after patching (``torch.nn.utils.parametrize``:
the GEMM reads what the parametrization computes; ``unpatch`` moves the parametrization to the
restored linear). An in-place change of a part between a forward and its backward raises, as for a
stock weight. A part's ``set_`` (as ``remove_parametrizations(leave_parametrized=True)`` calls it)
counts as a move, and so does ``torch.utils.swap_tensors`` of a part (which it calls under
``torch.__future__.set_swap_module_params_on_conversion(True)``: the part's class changes); a swap
of a part's storage alone, by hand, is not seen.

Checkpoints. The state dict keeps the stock keys: each slice writes its parameters under
their stock names as copies of their own (safetensors' ``save_model`` refuses a state-dict
tensor that covers part of its storage; a state dict thus holds the fused tensors twice
while it lives; ``keep_vars=True`` gives the parameters themselves) and the fused module
writes nothing. Loading copies each stock entry into its rows (with ``assign=True`` too: the
parameter objects stay), so ``strict`` and missing/unexpected/size-mismatch reports behave as
for the stock module;
a load-state-dict pre-hook on the parent splits fused-layout entries (``qkv_proj.weight``)
into the stock ones. Assigning a part's ``weight`` or ``bias`` (as transformers' loader does
for a model patched before its weights arrive) copies into its rows. PEFT's LoRA layers
wrap a slice like any ``nn.Linear``: the base GEMM stays the fused one. Fused tensors other
than the parts' parameters are the fused module's to save and load per part, under the
parts' stock names (:attr:`FusedLinears.STOCK_TENSORS`, :meth:`~FusedLinears.stock_part`,
:meth:`~FusedLinears.from_stock`): an FP8 fused weight (fusion/fp8_modules.py) adds its
scales, each part's in its checkpoint's layout. A slice may hold tensors of its own (an FP8
checkpoint's activation scales), saved and loaded as usual.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from hybridgemm.kernels.fp8 import BLOCK

from .linear_layer import linear

UNDO_ATTR = "_hybridgemm_undo"
SEQ = itertools.count()  # orders undo records across modules and patch calls
# Instance attribute of an nn.Linear that holds an FP8 checkpoint's weight while patch() runs
# (fusion/models/fp8_checkpoints.py): its scales' granularity decides whether it can be fused.
FP8_SOURCE = "_hybridgemm_fp8_source"
_DATA = torch._C.TensorBase.data  # a tensor's own .data descriptor (FusedPart overrides the setter)
# Bumped by whatever may give a part storage outside its rows (a part's .data set, a new part
# parameter, a slice moved, cast or loaded): a fused module checks its parts' places again
# only when it changed since its last check, so a GEMM's weight lookup stays a few attribute reads.
_EPOCH = [0]


def _moved() -> None:
    _EPOCH[0] += 1


def qual(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def records(mod: nn.Module) -> list:
    return mod.__dict__.get(UNDO_ATTR) or []


def record(mod: nn.Module, rec: tuple) -> None:
    """Note a change on the module it changed, for ``unpatch`` (rec[0] kind, rec[1] order)."""
    mod.__dict__.setdefault(UNDO_ATTR, []).append(rec)


def replaced_class(mod: nn.Module) -> type | None:
    """The class ``patch`` swapped out of ``mod`` (its ``("class", order, cls)`` record), None
    where there is none."""
    return next((rec[2] for rec in records(mod) if rec[0] == "class"), None)


class _StackedParts(torch.autograd.Function):
    """The stacked tensor as a function of its parts: the forward hands out the stacked tensor
    (the parts' own storage, no copy); the backward gives each part its rows of the gradient."""

    @staticmethod
    def forward(ctx, stacked: Tensor, sizes: tuple[int, ...], *parts: Tensor) -> Tensor:
        ctx.sizes = sizes
        # saved for their version counters only: an in-place change of a part between the
        # forward and the backward (an optimizer step) then raises, as it does for a stock weight
        ctx.save_for_backward(*parts)
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.saved_tensors  # noqa: B018 (the version check)
        return (None, None, *grad.split(ctx.sizes))


class FusedLinears(nn.Module):
    """The one GEMM of several projections of the same input (rows stacked in ``names``
    order) and the one-GEMM cache that their :class:`FusedSlice` modules share. ``weight`` and
    ``bias`` are the stacked tensors the GEMM reads (see the module docstring)."""

    # The stacked tensors whose parts are the slices' own parameters.
    PART_TENSORS: tuple[str, ...] = ("weight", "bias")
    # Other fused tensors that checkpoints hold per part, under the parts' stock names.
    STOCK_TENSORS: tuple[str, ...] = ()

    def __init__(self, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...],
                 originals: tuple[nn.Linear, ...] = (), names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")):
        super().__init__()
        # Plain attributes, not buffers: derived from the parts, they are no model state for
        # code that saves, moves or materialises buffers (transformers' loader makes every
        # non-persistent buffer anew); torch.compile treats a module's tensor attributes as
        # static inputs, as it does its parameters.
        self.stacked_weight = weight
        self.stacked_bias = bias
        self.sizes = tuple(sizes)
        self.names = tuple(names)  # the slices' attribute names on the parent module (state-dict keys)
        self._rec = None  # (x, x._version, [parts] with handed-out slots set to None)
        object.__setattr__(self, "_originals", tuple(originals))  # not submodules
        object.__setattr__(self, "slices", ())  # the FusedSlice modules, set by fuse() (not submodules)
        self._checked = -1  # the _EPOCH value at which every part was last found in its rows
        self._seen_parts: dict[str, tuple] = {}  # the part objects that check found there

    # ----------------------------------------------------------------- the stacked tensors
    @property
    def weight(self) -> Tensor:
        return self._for_gemm("weight")

    @property
    def bias(self) -> Tensor | None:
        return self._for_gemm("bias")

    def _for_gemm(self, attr: str) -> Tensor | None:
        t = self.__dict__["stacked_" + attr]
        if t is None:
            return None
        parts = self.parts(attr)
        compiling = torch.compiler.is_compiling()
        if compiling or not self._seen(attr, parts):  # (eager: the identity check first, it is the common case)
            if not all(isinstance(p, nn.Parameter) for p in parts):
                # tensors put in the slices' places for a call (torch.func.functional_call) or a
                # parametrization's values (traced too under torch.compile): stacked for this call,
                # differentiably; nothing of the module's changes
                return torch.cat(parts)
            if not compiling:
                self.check_rows()
                t, parts = self.__dict__["stacked_" + attr], self.parts(attr)
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return _StackedParts.apply(t, self.sizes, *parts)
        return t

    def _seen(self, attr: str, parts: list[Tensor]) -> bool:
        """Are ``parts`` the objects of the last check, with nothing moved since (:data:`_EPOCH`)?"""
        seen = (self.__dict__.get("_seen_parts") or {}).get(attr)
        # (the class too: torch.utils.swap_tensors, which remove_parametrizations calls under
        # torch.__future__.set_swap_module_params_on_conversion(True), swaps a part's contents and
        # class in place, keeping the object)
        return self._checked == _EPOCH[0] and seen is not None \
            and all(p is q and p.__class__ is FusedPart for p, q in zip(parts, seen))

    def stacked(self, attr: str) -> Tensor | None:
        """The stacked ``attr`` (a part tensor: stacked anew first where a part parameter no
        longer lies in its rows; any other: the buffer itself), without autograd."""
        if attr not in self.PART_TENSORS:
            return self._buffers.get(attr)
        t = self.__dict__["stacked_" + attr]
        if t is None or torch.compiler.is_compiling() or self._seen(attr, self.parts(attr)):
            return t
        self.check_rows()
        return self.__dict__["stacked_" + attr]

    def check_rows(self) -> None:
        """Stack anew every part tensor one of whose part parameters no longer lies in its rows.
        A part tensor some of whose parts are not parameters (a call's own tensors,
        torch.func.functional_call; a parametrization's values) is no state of the module: left
        as it is, and checked again once they are (the other part tensors are checked now)."""
        seen = {}
        for attr in self.PART_TENSORS:
            t = self.__dict__["stacked_" + attr]
            if t is None:
                continue
            parts = self.parts(attr)
            if not all(isinstance(p, nn.Parameter) for p in parts):
                continue
            if not self._in_rows(attr, t):
                self.restack(attr)
            seen[attr] = tuple(self.parts(attr))
        self._seen_parts = seen
        self._checked = _EPOCH[0]  # after its own restacks' bumps

    def parts(self, attr: str) -> list[Tensor]:
        """The slices' parameters ``attr`` (the parts of the stacked ``attr``), in row order; a
        slice whose ``attr`` is parametrized (``torch.nn.utils.parametrize``) gives its computed
        value, a tensor of no rows of the module's, so the GEMM stacks the parts per call."""
        return [s._parameters[attr] if attr in s._parameters else getattr(s, attr) for s in self.slices]

    def _in_rows(self, attr: str, t: Tensor) -> bool:
        if t.is_meta:
            return all(p.is_meta for p in self.parts(attr))
        ptr, row = t.data_ptr(), t.stride(0) * t.element_size()
        for p, n in zip(self.parts(attr), self.sizes):
            if p.data_ptr() != ptr or p.dtype != t.dtype:
                return False
            ptr += n * row
        return True

    def restack(self, attr: str) -> Tensor:
        """Stack the parts' current values into a new tensor and give each part its rows of it."""
        parts = self.parts(attr)
        if len({(p.device, p.dtype) for p in parts}) > 1:
            where = ", ".join(f"{n}.{attr}: {p.dtype} on {p.device}" for n, p in zip(self.names, parts))
            raise RuntimeError(f"hybridgemm: the parts of a fused projection must share one dtype and device to run "
                               f"as one GEMM ({where}); move or cast the module that holds them as a whole")
        with torch.no_grad():
            t = torch.cat([p.detach() for p in parts])
        self.set_stacked(attr, t)
        return t

    def set_stacked(self, attr: str, t: Tensor, requires_grad: bool | None = None) -> None:
        """Make ``t`` the stacked ``attr``: each part's parameter becomes a view of its rows
        (the same parameter objects where torch allows; ``requires_grad`` as given, else kept)."""
        if attr not in self.PART_TENSORS:
            self._buffers[attr] = t
            return
        self.__dict__["stacked_" + attr] = t
        _moved()
        for idx, rows in enumerate(self.part_rows(attr, t.detach())):
            piece = self.slices[idx]
            p = piece._parameters[attr]
            grad = p.requires_grad if requires_grad is None else requires_grad
            try:
                _DATA.__set__(p, rows)
            except RuntimeError:  # meta -> a real device: torch refuses to re-point; a new parameter takes its place
                p = nn.Parameter(rows, requires_grad=grad)
                for key in ("_is_hf_initialized",):
                    if key in piece._parameters[attr].__dict__:
                        p.__dict__[key] = piece._parameters[attr].__dict__[key]
            p.requires_grad_(grad and rows.is_floating_point() and rows.element_size() > 1)
            self._own(p, idx, attr)

    def _own(self, p: Tensor, idx: int, attr: str) -> None:
        """``p`` becomes part ``idx`` of ``attr``: a :class:`FusedPart` registered on its slice
        and on the replaced linear (which keeps it for unpatch)."""
        if not isinstance(p, FusedPart):
            p.__class__ = FusedPart
        p.part_of = (self, idx)
        self.slices[idx]._parameters[attr] = p
        if idx < len(self._originals):
            self._originals[idx]._parameters[attr] = p

    def restack_if_moved(self) -> None:
        """After a slice's ``_apply``: once every part has the same new dtype/device, stack
        them there (the old stacked tensor is then released). A parametrized part has no rows
        to re-point (its values are computed per call): its parametrization moved itself."""
        _moved()
        for attr in self.PART_TENSORS:
            t = self.__dict__.get("stacked_" + attr)
            if t is None or any(attr not in s._parameters for s in self.slices):
                continue
            parts = self.parts(attr)
            if len({(p.device, p.dtype) for p in parts}) == 1 and not self._in_rows(attr, t):
                self.restack(attr)

    def part_apply(self, piece: nn.Module, fn):
        """The ``fn`` of ``Module._apply`` that ``piece`` (one of the slices) applies to its
        tensors: ``fn`` itself (an FP8 fused module keeps its parts' e4m3)."""
        return fn

    def _apply(self, fn, *args, **kwargs):
        # The stacked tensors follow their parts (the slices convert those; converting them on
        # their own would hold a second copy of every weight).
        out = super()._apply(fn, *args, **kwargs)
        self.restack_if_moved()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the slices save their parameters and their rows of the other fused tensors

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Its own keys (STOCK_TENSORS) are optional: checkpoints carry the stock names, which the
        # parent's pre-hook (load_stock_parts) turns into these keys, reporting absent ones as
        # missing under their stock names.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, [], unexpected_keys, error_msgs)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.own_parts(self.stacked_output(x).split_with_sizes(self.sizes, dim=-1))

    def stacked_output(self, x: Tensor) -> Tensor:
        """The one GEMM's output, the parts' columns side by side (what :meth:`forward` splits)."""
        return linear(x, self.weight, self.bias)

    def own_parts(self, parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The GEMM output's ``parts`` (views of it), or copies of them where autograd records
        them and the owner's forward changes each in place: OLMo's and OLMoE's clamp Q, K and V
        to ``config.clip_qkv`` where it is set (``clamps_config``, the owner's config, read per
        call), which autograd refuses on views of one output and, on views of one storage,
        would change what it saved of another part."""
        config = self.__dict__.get("clamps_config")
        if config is not None and parts[0].requires_grad and getattr(config, "clip_qkv", None) is not None:
            return tuple(p.clone() for p in parts)
        return parts

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
        t = self.stacked(attr)
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
        current = self.stacked(attr)
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
            self.set_stacked(attr, made)
        with torch.no_grad():
            self.part_rows(attr, self.stacked(attr).detach())[idx].copy_(part)

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
        return f"in_features={self.stacked_weight.shape[1]}, sizes={self.sizes}, bias={self.stacked_bias is not None}"


def _rebuild_part(data: Tensor, requires_grad: bool, state: dict) -> FusedPart:
    p = FusedPart(data, requires_grad)
    p.__dict__.update(state)
    return p


class FusedPart(nn.Parameter):
    """One part's parameter of a fused projection (``q_proj.weight``, ...): a leaf of its own
    whose storage is its rows of the stacked tensor (see the module docstring).
    ``part.data = t`` of its own shape, dtype and device copies ``t`` into the rows, as PEFT's
    safe merge and other code that replaces a parameter's values expect; of another shape it
    raises (the fused GEMM's rows are fixed); of another dtype or device it gives the part
    storage of its own until the fused module stacks the parts anew."""

    def __new__(cls, data=None, requires_grad=True):
        _moved()  # a new part object (one put in a slice's place, as accelerate's loaders do)
        return super().__new__(cls, data, requires_grad)

    @property
    def data(self) -> Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        _moved()
        current = _DATA.__get__(self)
        if not isinstance(value, Tensor) or value.shape != current.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"hybridgemm: {self._name()} takes data of shape {tuple(current.shape)} (its rows of a "
                             f"fused projection), got {got}")
        if (value.dtype, value.device) != (current.dtype, current.device) or current.is_meta:
            _DATA.__set__(self, value)
        elif value.data_ptr() != current.data_ptr():
            with torch.no_grad():
                current.copy_(value)

    def set_(self, *args, **kwargs):
        # storage of its own (remove_parametrizations(leave_parametrized=True) puts the computed
        # values in place so): the fused module stacks the parts anew before its next GEMM
        _moved()
        return super().set_(*args, **kwargs)

    def _name(self) -> str:
        fused, idx = self.__dict__.get("part_of", (None, None))
        if fused is None:
            return "a fused projection's part"
        return f"{fused.names[idx]}.{'weight' if self.dim() == 2 else 'bias'}"

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        # the tensor's own deepcopy keeps storage shared with the copied stacked tensor (memo by
        # storage; copy.deepcopy keeps the temporary .data alive, so its id cannot be reused)
        out = FusedPart(copy.deepcopy(_DATA.__get__(self), memo), self.requires_grad)
        memo[id(self)] = out
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return out

    def __reduce_ex__(self, proto):
        return _rebuild_part, (_DATA.__get__(self), self.requires_grad, dict(self.__dict__))


class FusedSlice(nn.Linear):
    """Stands where one of the fused linears stood, holding that linear's parameters (parts of
    the fused module's stacked tensors, see the module docstring); its forward hands out its
    rows of the one GEMM. Assigning its ``weight``/``bias`` copies into those rows
    (:meth:`FusedLinears.set_part`). An ``nn.Linear`` to code that looks for one (PEFT wraps it
    in a LoRA layer whose base GEMM stays the fused one; an initializer writes into its rows)."""

    def __init__(self, fused: FusedLinears, idx: int, lin: nn.Linear):
        nn.Module.__init__(self)
        object.__setattr__(self, "fused", fused)  # not a submodule: no duplicate state-dict keys
        self.idx = idx
        self.out_features = fused.sizes[idx]
        self.in_features = lin.in_features
        self._parameters["weight"] = lin._parameters["weight"]
        self._parameters["bias"] = lin._parameters.get("bias")

    def __setattr__(self, name: str, value) -> None:
        fused = self.__dict__.get("fused")
        attr = _stock_attr(fused, self.__dict__.get("idx"), name) if fused is not None else None
        if attr is None or parametrize.is_parametrized(self, name):  # (the parametrization's setter)
            super().__setattr__(name, value)
        elif value is None:
            raise ValueError(f"hybridgemm: cannot remove {name} of {fused.names[self.idx]}, one part of a fused "
                             f"projection ({'/'.join(fused.names)}); hybridgemm.unpatch restores separate linears")
        elif isinstance(value, Tensor):
            fused.set_part(attr, self.idx, value)
            if getattr(value, "_is_hf_initialized", False):
                # transformers' loader marks what it loaded; its initializer then leaves this module alone
                self.__dict__["_is_hf_initialized"] = True
                if attr in fused.PART_TENSORS:
                    self._parameters[attr]._is_hf_initialized = True
        else:
            raise TypeError(f"hybridgemm: cannot assign {type(value).__name__} as {fused.names[self.idx]}.{name} "
                            "(torch.Tensor expected)")

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(self.fused.part_apply(self, fn), *args, **kwargs)
        self.fused.restack_if_moved()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        fused, own = self.fused, {}
        super()._save_to_state_dict(own, "", keep_vars)  # its parameters (the parts) and tensors of its own
        for attr in fused.PART_TENSORS:
            if attr in own and not keep_vars:
                # a copy of its own: safetensors' save_model/load_model refuse a state-dict tensor
                # that covers part of its storage
                own[attr] = own[attr].clone()
        for attr in fused.STOCK_TENSORS:
            t = fused.stock_part(attr, self.idx)
            if t is not None:
                own[fused.stock_name(attr, self.idx)] = t if keep_vars else t.detach().clone()
        save_in_order(destination, prefix, own, self.__dict__.get("key_order"))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The parts are checked as the fused module checks a part (an FP8 part: e4m3 data)
        # before torch copies them into their rows.
        refused = set()
        for attr in self.fused.PART_TENSORS:
            key = prefix + attr
            if key in state_dict and self._parameters.get(attr) is not None:
                refuse(state_dict, key, self.fused.stock_error(attr, self.idx, key, state_dict[key]), error_msgs,
                       refused)
        missing = []
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected_keys,
                                      error_msgs)
        _moved()  # swapped or assigned tensors: checked before the next GEMM
        missing_keys.extend(m for m in missing if m not in refused)

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.part(x, self.idx)

    def extra_repr(self) -> str:
        return f"{self.fused.names[self.idx]} of a fused projection, out_features={self.out_features}"


def _stock_attr(fused: FusedLinears, idx, name: str) -> str | None:
    """The fused tensor that a slice's attribute ``name`` is a part of (None: no such part)."""
    if idx is None:
        return None
    if name in fused.PART_TENSORS:
        return name
    return next((a for a in fused.STOCK_TENSORS if fused.stock_name(a, idx) == name), None)


def refuse(state_dict: dict, key: str, why: str | None, error_msgs: list, refused: set) -> None:
    """In a ``_load_from_state_dict``: with a reason ``why``, report it and take ``key`` out of
    ``state_dict`` (torch then neither copies it nor reports it missing: ``refused`` notes it)."""
    if why is not None:
        error_msgs.append(why)
        state_dict.pop(key, None)
        refused.add(key)


def save_in_order(destination, prefix: str, tensors: dict, order) -> None:
    """Write ``tensors`` (local name -> tensor) into ``destination`` under ``prefix``, in the
    order of the names in ``order`` (a replaced module's state-dict order; None: as they
    are), names not in it last."""
    order = tuple(order or ())
    for name in sorted(tensors, key=lambda n: order.index(n) if n in order else len(order)):
        destination[prefix + name] = tensors[name]


def _version(x: Tensor) -> int:
    # Dynamo cannot read version counters (it makes them data-dependent symbols) and inference
    # tensors have none, so under torch.compile and torch.inference_mode only the identity
    # check applies; other eager calls check both.
    return -1 if torch.compiler.is_compiling() or x.is_inference() else x._version


def _same_version(v: int, x: Tensor) -> bool:
    return v == _version(x)


def load_stock_parts(fused_name: str, module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre-hook (bound to ``fused_name``) of a module whose linears are fused.
    Entries in the fused layout (``<fused_name>.weight``, ``.bias``) are split into the parts'
    stock entries, which the slices load. The stock entries of the other fused tensors
    (:attr:`FusedLinears.STOCK_TENSORS`: an FP8 weight's scales) are replaced by one
    ``<fused_name>.<attr>`` that torch then loads into the fused module. A part that is
    absent is reported missing and keeps its current value; a part that does not fit (shape,
    or the fused module's own checks) is reported as torch reports one, under its stock name."""
    fused = module._modules.get(fused_name)
    if not isinstance(fused, FusedLinears):
        return
    for attr in fused.PART_TENSORS:
        key = f"{prefix}{fused_name}.{attr}"
        t = state_dict.get(key)
        fits = isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == sum(fused.sizes)
        if fits and fused.stacked(attr) is not None:
            del state_dict[key]
            for name, rows in zip(fused.names, t.split(fused.sizes)):
                state_dict.setdefault(f"{prefix}{name}.{attr}", rows)
    for attr in fused.STOCK_TENSORS:
        current = fused.stacked(attr)
        if current is None:
            continue
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
    :class:`FusedLinears` registered as ``fused_name``; recorded on ``mod`` for :func:`unfuse`.
    The linears' parameter objects become the slices' (views of the stacked rows)."""
    sizes = tuple(lin.out_features for lin in lins)
    with torch.no_grad():
        w = torch.cat([lin.weight.detach() for lin in lins])
        b = torch.cat([lin.bias.detach() for lin in lins]) if lins[0].bias is not None else None
    fused = FusedLinears(w, b, sizes, tuple(lins), tuple(names))
    mod.add_module(fused_name, fused)
    object.__setattr__(fused, "slices", tuple(FusedSlice(fused, i, lin) for i, lin in enumerate(lins)))
    for attr, t in (("weight", w), ("bias", b)):
        if t is not None:
            fused.set_stacked(attr, t)
    for n, piece in zip(names, fused.slices):
        _set_child(mod, n, piece)
    hook = mod.register_load_state_dict_pre_hook(functools.partial(load_stock_parts, fused_name))
    record(mod, ("fused", next(SEQ), tuple(names), tuple(lins), hook, fused_name))
    return fused


def restored_class(mod: nn.Module, cls: type) -> type:
    """The class ``mod`` takes when ``unpatch`` gives it back its class ``cls``: ``cls`` itself,
    or, where ``torch.nn.utils.parametrize`` parametrized ``mod`` after ``patch`` (its class is
    then parametrize's subclass of the patched class, holding the parametrized tensors'
    properties), that subclass made anew over ``cls``: the parametrizations stay in force."""
    now = type(mod)
    if not parametrize.is_parametrized(mod) or len(now.__bases__) != 1 or now.__bases__[0] is cls:
        return cls
    members = {k: v for k, v in vars(now).items() if k not in ("__dict__", "__weakref__", "__qualname__")}
    return type(f"Parametrized{cls.__name__}", (cls,), members)


def _own_storage(p: Tensor) -> None:
    """A part parameter out of the stacked rows: storage of its own, an ``nn.Parameter`` again."""
    _DATA.__set__(p, p.detach().clone())
    p.__class__ = nn.Parameter
    p.__dict__.pop("part_of", None)


def unfuse(mod: nn.Module, rec: tuple) -> None:
    """Undo :func:`fuse`: the original linears come back holding their parameters (the same
    objects, with their current values) in storage of their own; a slice's parametrizations
    (``torch.nn.utils.parametrize``, registered after ``patch``) move to its linear."""
    _, _, names, lins, hook, fused_name = rec
    hook.remove()
    fused = mod._modules.pop(fused_name)
    with torch.no_grad():
        for n, lin, piece in zip(names, lins, fused.slices):
            for attr in fused.PART_TENSORS:
                p = piece._parameters.get(attr)
                if p is None:
                    continue
                _own_storage(p)
                lin._parameters[attr] = p
            if parametrize.is_parametrized(piece):
                for p in piece.parametrizations.parameters():
                    if isinstance(p, FusedPart):  # a part the parametrization holds as its original
                        _own_storage(p)
                for attr in piece.parametrizations:
                    lin._parameters.pop(attr, None)
                lin.__class__ = restored_class(piece, type(lin))
                lin._modules["parametrizations"] = piece._modules.pop("parametrizations")
            _set_child(mod, n, lin)
    fused._rec = None
    object.__setattr__(fused, "_originals", ())
    object.__setattr__(fused, "slices", ())
