"""Hugging Face model patching: :func:`patch` finds a model's projections, norms and decoder
layers by structure and swaps in hybridgemm's modules; the fused decoder layer and its decode
step live here (``decoder_layer``, ``decode_step``)."""

from .patching import PatchReport, patch, unpatch

__all__ = ["PatchReport", "patch", "unpatch"]
