"""The attention functions of Falcon's attention in transformers 5.8-5.24, for the fused decode
step's calls that do not take the decode attention kernel. That attention calls no registry of
attention functions: with ``sdpa`` it calls ``scaled_dot_product_attention`` itself, otherwise it
computes the scores inline. :data:`FUNCTIONS` stands in for the registry its 5.25 form reads
(``get_interface``), with functions of the registry's signature that compute what those
branches compute (checked statement by statement: checked_forms ``_LEGACY_FALCON_ATTENTION_BODY``).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn


def sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """Its ``sdpa`` branch: SDPA over [B, heads, S, hd] queries and the cache's [B, kv_heads, L,
    hd] keys and values as they are (one KV head broadcasts), SDPA's own scale (1 / sqrt(hd));
    returns ``([B, S, heads, hd], None)`` as the registry's functions do."""
    is_causal = module.is_causal and attention_mask is None and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                         is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def eager_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, Tensor]:
    """Its other branch: the scores divided by sqrt(head_dim) in the activations' dtype, the mask
    added, softmax in that dtype; returns ``([B, S, heads, hd], scores)``."""
    scores = query @ key.transpose(-1, -2)
    scores /= math.sqrt(module.head_dim)
    if attention_mask is not None:  # (the model always passes one; a caller without gets unmasked scores)
        scores = scores + attention_mask
    scores = F.softmax(scores, dim=-1, dtype=query.dtype)
    return (scores @ value).transpose(1, 2).contiguous(), scores


class _Functions:
    """What the attention computes for an attention implementation, in the registry's terms."""

    @staticmethod
    def get_interface(implementation: str, default):
        return sdpa_attention if implementation == "sdpa" else eager_attention


FUNCTIONS = _Functions()

__all__ = ["FUNCTIONS", "eager_attention", "sdpa_attention"]
