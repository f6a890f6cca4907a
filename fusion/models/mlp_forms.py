"""The forwards of the MLP modules :func:`hybridgemm.patch` swaps for its own (fusion/mlp.py),
statement by statement. A module with the children and activation of one of those MLPs whose
forward computes anything more (a clamp, a scale, a norm, a dropout, Gemma 3n's activation
sparsity, Falcon-H1's multipliers) keeps its own forward, and the report says why: a gated,
prefused-gated or two-layer MLP's linears are dispatched one by one, a BERT intermediate or a
GPT-2 MLP is left as it is."""

from __future__ import annotations

import functools
import inspect

from torch import nn

from .source_forms import body_statements

# Each form's statements (source_forms.body_statements), ``{x}`` standing for the forward's one
# input parameter, whatever its name.
GATED_FORMS = (  # Llama's and most gated MLPs'; Qwen2's and Idefics' one statement
    ("down_proj=self.down_proj(self.act_fn(self.gate_proj({x}))*self.up_proj({x}))", "returndown_proj"),
    ("returnself.down_proj(self.act_fn(self.gate_proj({x}))*self.up_proj({x}))",),
)
# Seed-OSS's: the first of GATED_FORMS, its output then through a dropout of the module's
# residual_dropout (the identity in eval); HybridGatedMLP applies it where OUTPUT_DROPOUT is set
GATED_DROPOUT_FORMS = (
    (GATED_FORMS[0][0], "down_proj=nn.functional.dropout(down_proj,p=self.residual_dropout,training=self.training)",
     "returndown_proj"),
)
PREFUSED_GATED_FORMS = (  # Phi-3's, GLM's: gate and up one linear
    ("up_states=self.gate_up_proj({x})", "gate,up_states=up_states.chunk(2,dim=-1)",
     "up_states=up_states*self.activation_fn(gate)", "returnself.down_proj(up_states)"),
)
TWO_LAYER_FORMS = (  # GPT-NeoX's and Persimmon's, Falcon's, GPT-NeoX-Japanese's
    ("{x}=self.dense_h_to_4h({x})", "{x}=self.act({x})", "{x}=self.dense_4h_to_h({x})", "return{x}"),
    ("{x}=self.act(self.dense_h_to_4h({x}))", "{x}=self.dense_4h_to_h({x})", "return{x}"),
    ("intermediate=self.dense_h_to_4h({x})", "intermediate=self.act(intermediate)",
     "output=self.dense_4h_to_h(intermediate)", "returnoutput"),
)
INTERMEDIATE_FORMS = (("{x}=self.dense({x})", "{x}=self.intermediate_act_fn({x})", "return{x}"),)  # BERT's
CONV_FORMS = (  # GPT-2's, OpenAI GPT's
    ("{x}=self.c_fc({x})", "{x}=self.act({x})", "{x}=self.c_proj({x})", "{x}=self.dropout({x})", "return{x}"),
    ("h=self.act(self.c_fc({x}))", "h2=self.c_proj(h)", "returnself.dropout(h2)"),
)


def why_not_form(mod: nn.Module, forms: tuple, kind: str) -> str | None:
    """Why ``mod``'s forward is none of ``forms`` (None: it is one), for the report: ``kind``
    names what hybridgemm would compute in its place."""
    if _computes(type(mod), forms):
        return None
    return f"{type(mod).__name__}.forward computes more than the {kind} hybridgemm fuses (its own forward runs)"


@functools.lru_cache(maxsize=256)
def _computes(cls: type, forms: tuple) -> bool:
    # read once per class (a model's many layers, a list of experts, share one)
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return False
    statements = body_statements(cls.forward)
    return len(params) == 2 and statements is not None \
        and any(statements == [s.format(x=params[1]) for s in form] for form in forms)


__all__ = ["CONV_FORMS", "GATED_DROPOUT_FORMS", "GATED_FORMS", "INTERMEDIATE_FORMS", "PREFUSED_GATED_FORMS",
           "TWO_LAYER_FORMS", "why_not_form"]
