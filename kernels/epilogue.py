"""The epilogue vocabulary shared by every backend, and the reference that checks them.

An epilogue is what happens to the fp32 accumulator of ``x @ W.T`` before it is stored:
an optional bias add along the output features, then an optional activation.

``Activation.GELU_TANH`` is the tanh approximation
``0.5 * z * (1 + tanh(sqrt(2/pi) * (z + 0.044715 z^3)))``, which is what cuBLASLt's
``GELU``/``GELU_BIAS`` epilogues compute and what ``F.gelu(approximate="tanh")`` computes.
``Activation.GELU`` is the exact erf form (``F.gelu`` default); cuBLASLt has no epilogue
for it, so only the Triton backend supports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Activation(str, enum.Enum):
    NONE = "none"
    RELU = "relu"
    GELU_TANH = "gelu_tanh"
    GELU = "gelu"  # exact (erf) GELU

    @classmethod
    def parse(cls, value: Activation | str | None) -> Activation:
        """Accept an Activation, its string value, or None (no activation)."""
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        names = ", ".join(repr(a.value) for a in cls)
        raise ValueError(f"unknown activation {value!r}; expected None or one of {names}")


@dataclass(frozen=True)
class Epilogue:
    """Bias add (along N) followed by an activation, applied to the fp32 accumulator."""

    activation: Activation = Activation.NONE
    bias: bool = False

    @property
    def name(self) -> str:
        """Stable, human-readable name used in table keys and CSV files."""
        parts = (["bias"] if self.bias else []) + (
            [self.activation.value] if self.activation is not Activation.NONE else []
        )
        return "+".join(parts) if parts else "none"

    @classmethod
    def from_name(cls, name: str) -> Epilogue:
        if name == "none":
            return cls()
        parts = name.split("+")
        bias = parts[0] == "bias"
        rest = parts[1:] if bias else parts
        if len(rest) > 1:
            raise ValueError(f"bad epilogue name {name!r}")
        act = Activation.parse(rest[0]) if rest else Activation.NONE
        epi = cls(act, bias)
        if epi.name != name:
            raise ValueError(f"bad epilogue name {name!r}")
        return epi

    def __str__(self) -> str:
        return self.name


ALL_EPILOGUES = tuple(Epilogue(a, b) for b in (False, True) for a in Activation)


# The gate activations of gated MLPs (``act(gate) * up``; SwiGLU, GeGLU), as PyTorch computes
# them: the Triton gated kernel's reference and hybridgemm.gated_linear's separate path.
GLU_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}


def apply_activation(z: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation is Activation.NONE:
        return z
    if activation is Activation.RELU:
        return torch.relu(z)
    if activation is Activation.GELU_TANH:
        return F.gelu(z, approximate="tanh")
    if activation is Activation.GELU:
        return F.gelu(z)
    raise AssertionError(activation)


def reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Activation | str | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``act(x @ W.T + b)`` computed in ``compute_dtype`` (fp64 by default) and returned in it.

    On the GPU fp64 GEMMs are slow but exact enough; tests on large shapes may pass
    ``torch.float32`` (with TF32 disabled by the caller) instead.
    """
    act = Activation.parse(activation)
    z = x.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        z = z + bias.to(compute_dtype)
    return apply_activation(z, act)
