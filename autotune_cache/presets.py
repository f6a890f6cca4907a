"""Attention projection shapes of well-known models, for the tuner, the perf harness and tests.

Every shape is a ``linear``: ``out = x @ W.T (+ b)`` with ``W`` of shape ``(n, k)``, so ``n``
is the number of output features and ``k`` the number of input features. Per model:

- ``q``:   n = heads * head_dim,                   k = hidden
- ``kv``:  n = kv_heads * head_dim (one of k or v), k = hidden
- ``qkv``: n = (heads + 2 * kv_heads) * head_dim,  k = hidden (the fused projection)
- ``o``:   n = hidden,                             k = heads * head_dim

``bias`` follows the model: BERT and GPT-2 have biases everywhere; Llama 3 and Mistral
have none; Qwen2.5 has q/k/v biases but no output-projection bias.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ProjectionShape:
    name: str
    n: int  # output features (rows of W)
    k: int  # input features
    bias: bool


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool

    @property
    def projections(self) -> tuple[ProjectionShape, ...]:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return (
            ProjectionShape("q", q, self.hidden, self.qkv_bias),
            ProjectionShape("kv", kv, self.hidden, self.qkv_bias),
            ProjectionShape("qkv", q + 2 * kv, self.hidden, self.qkv_bias),
            ProjectionShape("o", self.hidden, q, self.o_bias),
        )

    def projection(self, name: str) -> ProjectionShape:
        for p in self.projections:
            if p.name == name:
                return p
        names = ", ".join(p.name for p in self.projections)
        raise ValueError(f"{self.name} has no projection {name!r}; it has {names}")


# Figures from each model's published config.json (hidden_size, num_attention_heads,
# num_key_value_heads, head_dim, attention bias).
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("bert-base", 768, 12, 12, 64, qkv_bias=True, o_bias=True),
        ModelPreset("gpt2", 768, 12, 12, 64, qkv_bias=True, o_bias=True),
        ModelPreset("llama3-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False),
        ModelPreset("llama3-70b", 8192, 64, 8, 128, qkv_bias=False, o_bias=False),
        ModelPreset("qwen2.5-7b", 3584, 28, 4, 128, qkv_bias=True, o_bias=False),
        ModelPreset("mistral-7b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False),
    )
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelPreset:
    """Look a preset up by name; case and ``_`` vs ``-`` do not matter."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(PRESETS)}")
    return PRESETS[key]


_SHAPE_RE = re.compile(r"^\s*([0-9]+)\s*,\s*([0-9]+)\s*$")


def parse_shape(text: str, bias: bool = True) -> ProjectionShape:
    """Parse ``"N,K"`` (output features, input features) into a :class:`ProjectionShape`
    named ``"N,K"``."""
    m = _SHAPE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"bad shape {text!r}: expected 'N,K' (output, input features), "
                         "e.g. '6144,4096'")
    n, k = int(m.group(1)), int(m.group(2))
    if n <= 0 or k <= 0:
        raise ValueError(f"bad shape {text!r}: N and K must be positive")
    return ProjectionShape(f"{n},{k}", n, k, bias)
