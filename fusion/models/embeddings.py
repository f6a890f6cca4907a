"""The LM head across ``resize_token_embeddings``: transformers resizes the vocabulary by
making a new plain ``nn.Linear`` head (then tying it again where the model ties), which
would drop the patched one. :func:`hybridgemm.patch` gives each model whose LM head it
patched a ``resize_token_embeddings`` of its own (an instance attribute, removed by
``unpatch``): transformers' method, then the new head patched as the old one was (the same
object, its class swapped, so a tie to the new embedding holds)."""

from __future__ import annotations

from torch import nn

from hybridgemm.fp8_modules import is_fp8
from hybridgemm.fused_rows import SEQ, record
from hybridgemm.linear_layer import HybridLinear

RESIZE = "resize_token_embeddings"


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()`` where the model has one (transformers' models), else None."""
    get = getattr(model, "get_output_embeddings", None)
    if not callable(get):
        return None
    try:
        head = get()
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, nn.Module) else None


def resizes_embeddings(model: nn.Module) -> bool:
    """Has ``model`` transformers' ``resize_token_embeddings`` (and no replacement of it yet)?"""
    return callable(getattr(type(model), RESIZE, None)) and RESIZE not in model.__dict__


class ResizeKeepingHead:
    """``model.resize_token_embeddings`` of a patched model (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        if is_fp8(output_embeddings(model)):
            raise ValueError("hybridgemm: resize_token_embeddings of a model whose LM head patch(weights='fp8', "
                             "quantize_lm_head=True) quantized: resize the embeddings before patching")
        out = getattr(type(model), RESIZE)(model, *args, **kwargs)
        head = output_embeddings(model)
        if type(head) is nn.Linear:
            record(head, ("class", next(SEQ), nn.Linear))
            head.__class__ = HybridLinear
        return out


__all__ = ["RESIZE", "ResizeKeepingHead", "output_embeddings", "resizes_embeddings"]
