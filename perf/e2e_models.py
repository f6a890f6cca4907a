"""Decoder models for the end-to-end benchmark (perf/bench_e2e.py), built from a transformers
config with random weights (nothing is downloaded), and the calls whose spelling differs
across transformers versions.

Sizes: hidden size, heads, KV heads, head dim and attention biases come from
autotune_cache/presets.py; :data:`SIZES` adds what a whole model needs beyond its attention
projections (MLP width, layer count, vocabulary, RoPE base), from each model's published
``config.json``.

Version differences are looked up from signatures, not version numbers, so that one code path
serves transformers 4.4x and 5.x: the cache keyword of ``forward`` (``past_key_values``, or
``cache`` since 5.x), whether ``forward`` takes ``cache_position`` (4.x: the static cache
writes there; 5.x: the cache keeps its own position), ``logits_to_keep`` or its older name
``num_logits_to_keep``, and ``StaticCache``'s constructor (batch size, device and dtype up
front in 4.x; allocated on first use in 5.x). ``transformers`` is imported on first use: it
is a test dependency, not one of the package's.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn

from hybridgemm.autotune_cache.presets import get_preset
from hybridgemm.fp8_modules import SCALE_NAMES


@dataclass(frozen=True)
class ModelSizes:
    family: str  # "llama", "qwen2" or "qwen3" (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
    intermediate: int  # MLP width (gate, up: hidden -> intermediate; down: back)
    layers: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int


SIZES: dict[str, ModelSizes] = {
    "qwen2.5-7b": ModelSizes("qwen2", 18944, 28, 152064, 1e6, 1e-6, 32768),
    "llama3-8b": ModelSizes("llama", 14336, 32, 128256, 5e5, 1e-5, 8192),
    "llama3-70b": ModelSizes("llama", 28672, 80, 128256, 5e5, 1e-5, 8192),  # ~141 GB in bf16: tensor parallel only
    "qwen3-8b": ModelSizes("qwen3", 12288, 36, 151936, 1e6, 1e-6, 40960),  # q/k norms per head
}


def model_names() -> list[str]:
    return list(SIZES)


def canonical_name(name: str) -> str:
    """The benchmark's name for ``name`` (case and ``_``/``-`` do not matter, as for presets);
    ``ValueError`` naming the known models otherwise."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SIZES)}")
    return key


def hf_config(name: str, layers: int | None = None):
    """The transformers config of model ``name`` (see :data:`SIZES`), ``layers`` decoder
    layers (default: the model's own count). Untied LM head; q/k/v biases as the preset has
    them (Qwen2 hard-codes them; Llama's ``attention_bias`` is set from the preset)."""
    import transformers

    preset, sizes = get_preset(canonical_name(name)), SIZES[canonical_name(name)]
    if preset.hidden != preset.heads * preset.head_dim:
        raise ValueError(f"{name}: hidden {preset.hidden} != heads x head_dim; the config would need head_dim")
    kw = dict(hidden_size=preset.hidden, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
              intermediate_size=sizes.intermediate, num_hidden_layers=layers or sizes.layers,
              vocab_size=sizes.vocab, max_position_embeddings=sizes.max_positions, rms_norm_eps=sizes.rms_eps,
              rope_theta=sizes.rope_theta, tie_word_embeddings=False)
    if sizes.family == "qwen2":
        return transformers.Qwen2Config(**kw, use_sliding_window=False)
    if sizes.family == "qwen3":
        return transformers.Qwen3Config(**kw, head_dim=preset.head_dim, attention_bias=preset.qkv_bias,
                                        use_sliding_window=False)
    return transformers.LlamaConfig(**kw, attention_bias=preset.qkv_bias, mlp_bias=False)


def rope_theta(config) -> float | None:
    """The RoPE base of ``config``: ``rope_theta`` (4.x) or ``rope_parameters["rope_theta"]`` (5.x)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return theta


def build_model(config, dtype: torch.dtype, device) -> nn.Module:
    """A causal LM of ``config`` with random weights (transformers' own init, from the global
    torch seed), created directly on ``device`` in ``dtype`` (no full-size copy in another
    dtype or on the host first), SDPA attention, eval mode. RoPE's inverse frequencies stay
    fp32, as from_pretrained leaves them."""
    import transformers

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    if any(p.dtype != dtype for p in model.parameters()):  # a version that picks the dtype itself
        model.to(dtype)
    return model.eval()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: a tensor subclass that flattens into inner tensors (torchao's
    quantized weights: data, scales, zero points) counts theirs, whatever dtype it reports."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (shared ones once),
    and the FP8 scales of weights ``patch(weights="fp8")`` quantized (their buffers,
    fusion/fp8_modules.SCALE_NAMES), except the input embedding table, of which a step reads
    one row per token, unless the LM head is tied to it (then the head streams all of it)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = set()
    if emb is not None and not (head is not None and head.weight is emb.weight):
        skip.add(id(emb.weight))
    tensors = {id(p): p for p in model.parameters() if id(p) not in skip}
    tensors.update({id(b): b for name, b in model.named_buffers() if name.rpartition(".")[2] in SCALE_NAMES})
    return sum(tensor_bytes(t) for t in tensors.values())


@dataclass(frozen=True)
class ForwardApi:
    cache_kw: str  # "cache" (transformers 5) or "past_key_values"
    cache_position: bool  # forward takes cache_position (transformers 4)
    keep_kw: str | None  # "logits_to_keep", "num_logits_to_keep" or None


def forward_api(model: nn.Module) -> ForwardApi:
    params = inspect.signature(model.forward).parameters
    return ForwardApi(cache_kw="cache" if "cache" in params else "past_key_values",
                      cache_position="cache_position" in params,
                      keep_kw=next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None))


def static_cache(model: nn.Module, batch: int, max_len: int):
    """A ``StaticCache`` for ``model``, ``batch`` sequences of up to ``max_len`` tokens, in the
    model's dtype and on its device (arguments the installed version does not take are left out)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    p = next(model.parameters())
    kw = {"config": model.config, "max_cache_len": max_len}
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", p.device), ("dtype", p.dtype)):
        if name in params and not (name == "batch_size" and "max_batch_size" in kw):
            kw[name] = value
    return StaticCache(**kw)


def cached_forward(model: nn.Module, api: ForwardApi, ids: torch.Tensor, cache, positions: torch.Tensor):
    """Logits of ``model(ids)`` appending to ``cache``; ``positions``: the 1-D positions of
    ``ids``' tokens (a device tensor, the same for every sequence)."""
    kw = {api.cache_kw: cache, "use_cache": True, "position_ids": positions.view(1, -1)}
    if api.cache_position:
        kw["cache_position"] = positions
    return model(input_ids=ids, **kw).logits


def full_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of ``ids``, no cache."""
    return model(input_ids=ids, use_cache=False).logits


def decode_logits(model: nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits (fp32) of the positions ``prompt_len - 1 .. T - 2`` of ``ids`` (B, T) as a decode
    loop computes them: the first ``prompt_len`` tokens prefilled into a ``StaticCache``, then
    one token per forward, each the next of ``ids`` (teacher forced, so every model compared
    is fed the same tokens). (B, T - prompt_len, V): the prompt's last logits, then those of
    every one-token step but the last token's."""
    api, (batch, total) = forward_api(model), ids.shape
    if not 0 < prompt_len < total:
        raise ValueError(f"decode_logits: prompt_len {prompt_len} must be in 1 .. {total - 1}")
    cache = static_cache(model, batch, -(-total // 64) * 64)
    device = ids.device
    out = [cached_forward(model, api, ids[:, :prompt_len], cache, torch.arange(prompt_len, device=device))[:, -1:]]
    for p in range(prompt_len, total - 1):
        out.append(cached_forward(model, api, ids[:, p:p + 1], cache, torch.arange(p, p + 1, device=device)))
    return torch.cat([o.float() for o in out], dim=1)


def prefill_forward(model: nn.Module, api: ForwardApi, ids: torch.Tensor) -> torch.Tensor:
    """One forward of a prompt as ``generate`` runs it: logits of the last position only
    (where the installed version can skip the others), no cache kept."""
    kw = {api.keep_kw: 1} if api.keep_kw else {}
    return model(input_ids=ids, use_cache=False, **kw).logits


def generate(model: nn.Module, ids: torch.Tensor, new_tokens: int, streamer=None) -> torch.Tensor:
    """HF ``generate``, greedy, exactly ``new_tokens`` new tokens (an end-of-sequence token
    does not stop it early), default (dynamic) cache; ``streamer`` as HF takes one."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=streamer)


class TokenClock:
    """An HF streamer that notes the host clock as each new token reaches the host (generate
    copies every token to the CPU for its streamer, which waits for the step's GPU work): the
    gaps between new tokens are the decode steps' wall times, the prompt's forward excluded."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt, before any forward
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def ms_per_step(self) -> float:
        """Mean ms between consecutive new tokens (needs at least two)."""
        if len(self.stamps) < 2:
            raise ValueError(f"{len(self.stamps)} new tokens were streamed; a step time needs at least 2")
        return (self.stamps[-1] - self.stamps[0]) * 1e3 / (len(self.stamps) - 1)
