"""Attention projection shapes of well-known models, for the tuner, the perf harness and tests.

Every shape is a ``linear``: ``out = x @ W.T (+ b)`` with ``W`` of shape ``(n, k)``, so ``n``
is the number of output features and ``k`` the number of input features. Per model:

- ``q``:   n = heads * head_dim,                   k = hidden
- ``kv``:  n = kv_heads * head_dim (one of k or v), k = hidden
- ``qkv``: n = (heads + 2 * kv_heads) * head_dim,  k = hidden (the fused projection)
- ``o``:   n = hidden,                             k = heads * head_dim

``bias`` follows the model: BERT and GPT-2 have biases everywhere; Llama 3 and Mistral
have none; Qwen2.5 has q/k/v biases but no output-projection bias.

Under tensor parallelism each rank runs smaller GEMMs: ``hybridgemm.parallel.sharding``
derives one rank's shapes from a preset with the same split rules that shard a model.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class ProjectionShape:
    name: str
    n: int  # output features (rows of W)
    k: int  # input features
    bias: bool
    activation: str = "none"  # the GEMM's epilogue activation (kernels/epilogue.Activation's value)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    # Beyond attention (None where unknown): the dense MLP's width (gate/up: hidden ->
    # intermediate, down: back; None for a mixture of experts, below), the vocabulary (LM head
    # rows), the decoder layer count.
    intermediate: int | None = None
    vocab: int | None = None
    layers: int | None = None
    mlp_bias: bool = False
    tied_lm_head: bool = False  # the LM head shares the input embedding's weight
    # Mixture of experts (0 experts: a dense model): every decoder layer's MLP is ``experts``
    # gated MLPs of width ``expert_intermediate``, ``experts_per_token`` of them run per token.
    # Their weights are stacked per expert (transformers' MixtralExperts, Qwen3MoeExperts) and
    # run in hybridgemm's grouped MoE kernels (fusion/experts.py), not as dispatched GEMMs the
    # table tunes, so such a preset has no ``intermediate``: no dense MLP shape is its.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int | None = None
    # The norm before the MLP, which the fused decode step runs in the gated kernel's prologue
    # (autotune_cache/tune_glu.py NORM_OPS): "x" (a norm weight of x's dtype, Llama's), "fp32"
    # (a Gemma norm's 1 + w), None (none: OLMo 2 normalises the MLP's output instead; StableLM's
    # and Cohere's LayerNorms run as modules).
    mlp_norm: str | None = "x"
    # The parts of each decoder layer that hybridgemm.parallelize leaves whole on every rank
    # ("attention", "mlp"): the layers of families it does not split (Phi-3's pre-fused
    # projections, GPT-NeoX's and Falcon's), whose GEMMs a rank runs at their full size.
    tp_whole: tuple[str, ...] = ()

    def __post_init__(self):
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.expert_intermediate
                                 and self.intermediate is None):
            raise ValueError(f"{self.name}: a mixture-of-experts preset needs 1..{self.experts} experts per token, "
                             "an expert width and no dense MLP width (intermediate=None)")
        if not set(self.tp_whole) <= {"attention", "mlp"}:
            raise ValueError(f"{self.name}: tp_whole names 'attention' and 'mlp' only, got {self.tp_whole!r}")
        if self.mlp_norm not in (None, "x", "fp32"):
            raise ValueError(f"{self.name}: mlp_norm must be None, 'x' or 'fp32', got {self.mlp_norm!r}")

    @property
    def moe(self) -> bool:
        """Is every decoder layer's MLP a mixture of experts?"""
        return self.experts > 0

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
# num_key_value_heads, head_dim, attention bias; for the gated-MLP decoders also
# intermediate_size, vocab_size, num_hidden_layers; Mistral's and Mixtral's are v0.1's; the
# mixture-of-experts models' expert counts and width: num_experts or num_local_experts,
# num_experts_per_tok, moe_intermediate_size or Mixtral's intermediate_size). BERT and GPT-2
# leave the MLP out: theirs is not the gate/up/down layout that tensor parallelism splits.
# Qwen3-30B-A3B's attention is wider than its hidden size (32 heads of 128 over 2048).
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("bert-base", 768, 12, 12, 64, qkv_bias=True, o_bias=True, tp_whole=("attention", "mlp")),
        ModelPreset("gpt2", 768, 12, 12, 64, qkv_bias=True, o_bias=True, tp_whole=("attention", "mlp")),
        ModelPreset("llama3-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=14336, vocab=128256, layers=32),
        ModelPreset("llama3-70b", 8192, 64, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=28672, vocab=128256, layers=80),
        ModelPreset("qwen2.5-7b", 3584, 28, 4, 128, qkv_bias=True, o_bias=False,
                    intermediate=18944, vocab=152064, layers=28),
        ModelPreset("mistral-7b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=14336, vocab=32000, layers=32),
        ModelPreset("qwen3-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=12288, vocab=151936, layers=36),
        ModelPreset("granite-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=12800, vocab=49155, layers=40, tied_lm_head=True),
        ModelPreset("phi3-mini", 3072, 32, 32, 96, qkv_bias=False, o_bias=False,
                    intermediate=8192, vocab=32064, layers=32, tp_whole=("attention", "mlp")),
        ModelPreset("gemma-7b", 3072, 16, 16, 256, qkv_bias=False, o_bias=False,
                    intermediate=24576, vocab=256000, layers=28, mlp_norm="fp32"),
        ModelPreset("gemma2-9b", 3584, 16, 8, 256, qkv_bias=False, o_bias=False,
                    intermediate=14336, vocab=256000, layers=42, mlp_norm="fp32"),
        ModelPreset("gemma3-4b", 2560, 8, 4, 256, qkv_bias=False, o_bias=False,
                    intermediate=10240, vocab=262208, layers=34, mlp_norm="fp32"),
        ModelPreset("olmo2-7b", 4096, 32, 32, 128, qkv_bias=False, o_bias=False,
                    intermediate=11008, vocab=100352, layers=32, mlp_norm=None),
        ModelPreset("olmo3-7b", 4096, 32, 32, 128, qkv_bias=False, o_bias=False,
                    intermediate=11008, vocab=100278, layers=32, mlp_norm=None),
        ModelPreset("ministral-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=12288, vocab=131072, layers=36),
        ModelPreset("phi4-mini", 3072, 24, 8, 128, qkv_bias=False, o_bias=False, intermediate=8192, vocab=200064,
                    layers=32, tied_lm_head=True, tp_whole=("attention", "mlp")),
        ModelPreset("smollm3-3b", 2048, 16, 4, 128, qkv_bias=False, o_bias=False, intermediate=11008, vocab=128256,
                    layers=36, tied_lm_head=True),
        ModelPreset("ministral3-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False, intermediate=14336,
                    vocab=131072, layers=34),
        ModelPreset("glm4-9b", 4096, 32, 2, 128, qkv_bias=True, o_bias=False, intermediate=13696, vocab=151552,
                    layers=40, tp_whole=("mlp",)),
        ModelPreset("glm4-9b-0414", 4096, 32, 2, 128, qkv_bias=True, o_bias=False, intermediate=13696,
                    vocab=151552, layers=40, tp_whole=("mlp",)),
        ModelPreset("ernie4.5-0.3b", 1024, 16, 2, 128, qkv_bias=False, o_bias=False, intermediate=3072,
                    vocab=103424, layers=18, tied_lm_head=True),
        # StableLM: LayerNorms, which the fused step runs as modules (no norm prologue)
        ModelPreset("stablelm-2-1.6b", 2048, 32, 32, 64, qkv_bias=True, o_bias=False,
                    intermediate=5632, vocab=100352, layers=24, mlp_norm=None),
        ModelPreset("stablelm-3b", 2560, 32, 32, 80, qkv_bias=False, o_bias=False,
                    intermediate=6912, vocab=50304, layers=32, mlp_norm=None),
        # Cohere (Aya 23 8B): a mean-centred LayerNorm, which the fused step runs as its module
        ModelPreset("aya-23-8b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False,
                    intermediate=14336, vocab=256000, layers=32, tied_lm_head=True, mlp_norm=None),
        # GPT-NeoX (Pythia 6.9B): LayerNorms as modules; its MLP is not gated (no gate/up width)
        ModelPreset("pythia-6.9b", 4096, 32, 32, 128, qkv_bias=True, o_bias=True, vocab=50432, layers=32,
                    mlp_norm=None, tp_whole=("attention", "mlp")),
        # Falcon 7B: multi-query (one KV head), LayerNorms as modules; its MLP is not gated
        ModelPreset("falcon-7b", 4544, 71, 1, 64, qkv_bias=False, o_bias=False, vocab=65024, layers=32, mlp_norm=None,
                    tp_whole=("attention", "mlp")),
        ModelPreset("qwen3-30b-a3b", 2048, 32, 4, 128, qkv_bias=False, o_bias=False, vocab=151936, layers=48,
                    experts=128, experts_per_token=8, expert_intermediate=768),
        ModelPreset("mixtral-8x7b", 4096, 32, 8, 128, qkv_bias=False, o_bias=False, vocab=32000, layers=32,
                    experts=8, experts_per_token=2, expert_intermediate=14336),
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


# --- shapes from a Hugging Face ``config.json`` -------------------------------------------

_HF_CONFIG_MAX_BYTES = 16 * 1024 * 1024  # real config.json files are a few KiB
_HF_DIM_LIMIT = 2**31 - 1  # GEMM dimensions are 32-bit in every backend

# Field names for one quantity across model families, tried in order.
_HF_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HF_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HF_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_HF_HEAD_DIM = ("head_dim", "d_kv")
_HF_INTERMEDIATE = ("intermediate_size",)
# a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the experts, per token, and their width
# (Mixtral's experts are intermediate_size wide)
_HF_EXPERTS = ("num_experts", "num_local_experts")
_HF_EXPERTS_PER_TOKEN = ("num_experts_per_tok",)
_HF_EXPERT_WIDTH = ("moe_intermediate_size",)
_HF_VOCAB = ("vocab_size",)
_HF_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
# A field that switches every attention bias (q, k, v and o) on or off.
_HF_BIAS = ("attention_bias", "bias", "use_bias", "enable_bias")

# (q/k/v bias, o bias) of families whose configs carry no bias field: the attention layers
# hard-code it.
_HF_BIAS_BY_MODEL_TYPE: dict[str, tuple[bool, bool]] = {
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"),
                    (True, False)),
    **dict.fromkeys(("gpt2", "bert", "roberta", "xlm-roberta", "distilbert", "gpt_neox", "gpt_bigcode",
                     "opt", "bloom", "phi"), (True, True)),
    **dict.fromkeys(("llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3",
                     "qwen3", "qwen3_moe", "gptj", "t5"), (False, False)),
}


# Families whose MLP is not gate/up/down (one activated linear, then one back): their
# ``intermediate_size`` is no gated MLP's width, and the config's fields alone give no shape of it.
_HF_UNGATED_MLP_MODEL_TYPES = frozenset(("gpt_neox", "falcon", "gpt2", "gpt_bigcode", "gpt_neo", "gptj", "opt", "bloom",
                                         "phi", "persimmon", "nemotron", "biogpt", "bert", "roberta", "xlm-roberta",
                                         "distilbert", "starcoder2"))


def _show(value: object, limit: int = 60) -> str:
    """``repr`` of a value, cut short, so an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show_path(path: str) -> str:
    """``path`` as an error message shows it (its repr where it holds unprintable characters)."""
    return path if path.isprintable() else repr(path)


def read_hf_config(path: str | os.PathLike) -> tuple[str, object]:
    """Return (the config file's path, its parsed JSON); every failure is a one-line ValueError."""
    try:
        raw = os.fspath(path)
    except TypeError:
        raise ValueError(f"Hugging Face config path must be a str or path, got {_show(path)}") from None
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    shown = show_path(raw)
    if not raw:
        raise ValueError("Hugging Face config path is empty")
    in_dir = False
    try:
        st = os.stat(raw)
        if stat.S_ISDIR(st.st_mode):
            in_dir, raw = True, os.path.join(raw, "config.json")
            shown = show_path(raw)
            st = os.stat(raw)
    except FileNotFoundError:
        missing = "no config.json in this directory" if in_dir else "no such file"
        raise ValueError(f"{shown}: {missing}") from None
    except OSError as e:
        raise ValueError(f"{shown}: cannot read: {e.strerror or e}") from None
    except ValueError:  # os.stat's answer to an embedded NUL byte
        raise ValueError(f"{shown}: not a usable file path") from None
    # Refuse FIFOs, sockets and devices before opening: reading one could block forever or
    # never end.
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{shown}: not a regular file")
    if st.st_size > _HF_CONFIG_MAX_BYTES:
        raise ValueError(f"{shown}: {st.st_size} bytes, too large for a config.json "
                         f"(limit {_HF_CONFIG_MAX_BYTES})")
    # O_NONBLOCK: should the path be swapped for a FIFO after the stat, open still returns
    # at once, and the fstat below rejects it.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(raw, flags)
    except OSError as e:
        raise ValueError(f"{shown}: cannot open: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{shown}: not a regular file")
        chunks, total = [], 0
        while total <= _HF_CONFIG_MAX_BYTES:
            chunk = os.read(fd, min(1 << 20, _HF_CONFIG_MAX_BYTES + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise ValueError(f"{shown}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if total > _HF_CONFIG_MAX_BYTES:
        raise ValueError(f"{shown}: too large for a config.json (limit {_HF_CONFIG_MAX_BYTES} bytes)")
    try:
        text = b"".join(chunks).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{shown}: not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        return raw, json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{shown}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError(f"{shown}: not usable JSON: nested too deeply") from None


def _safe_name(text: object) -> str:
    """Lowercase ``[a-z0-9._-]`` name from a Hub id or path: its last component."""
    if not isinstance(text, str):
        return ""
    last = text.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^a-z0-9._-]+", "-", last.lower())
    return name.strip("-._")[:64].strip("-._")


def preset_from_hf_config(path: str | os.PathLike) -> ModelPreset:
    """Attention projection shapes of any model, from its Hugging Face ``config.json``.

    ``path`` is a ``config.json`` file or a local model directory holding one; the file is
    read with the standard library (``transformers`` is not needed, and nothing is fetched).
    Multimodal configs with a ``text_config`` are read from that sub-config. Field names of
    the common families are understood (``hidden_size``/``n_embd``/``d_model``,
    ``num_attention_heads``/``n_head``/``num_heads``, ``num_key_value_heads``/``num_kv_heads``
    with ``multi_query`` meaning one KV head, ``head_dim``). Attention bias comes from an
    ``attention_bias``/``bias``/``qkv_bias`` field, else from the ``model_type``. Optional, for
    the tensor-parallel shapes (:meth:`ModelPreset.tp_projections`): ``intermediate_size``,
    ``vocab_size``, ``num_hidden_layers``/``n_layer``/``num_layers``, ``mlp_bias`` (absent:
    false) and ``tie_word_embeddings`` (absent: an untied LM head); a family whose MLP is not
    gate/up/down (GPT-NeoX, Falcon, GPT-2, BERT, ...) has no dense MLP width. A mixture of experts
    (``num_experts``/``num_local_experts``, with ``num_experts_per_tok`` and
    ``moe_intermediate_size``, else ``intermediate_size``, as the experts' width) has no dense
    MLP width: its experts run in the MoE kernels. The preset's
    ``name`` is the last component of ``_name_or_path``, else the ``model_type``, else the
    name of the file's directory, lowercased to ``[a-z0-9._-]``.

    Every problem (unreadable file, bad JSON, missing or invalid field) raises a one-line
    ``ValueError`` that names the file and the field.
    """
    file, top = read_hf_config(path)
    shown = show_path(file)
    if not isinstance(top, dict):
        raise ValueError(f"{shown}: expected a JSON object at the top level, got {type(top).__name__}")
    cfg, prefix = top, ""
    nested = top.get("text_config")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"{shown}: text_config: expected a JSON object, got {type(nested).__name__}")
        cfg, prefix = nested, "text_config."

    def pick(names: tuple[str, ...]) -> tuple[str, object]:
        """The first of ``names`` set (not null) in the config, as (field, value)."""
        for key in names:
            if cfg.get(key) is not None:
                return key, cfg[key]
        return names[0], None

    def positive_int(names: tuple[str, ...], what: str, required: bool = True) -> int | None:
        key, value = pick(names)
        if value is None:
            if not required:
                return None
            raise ValueError(f"{shown}: {prefix}{key}: missing ({what}; also looked for "
                             f"{', '.join(prefix + n for n in names[1:])})")
        # bool is an int subclass in Python; true/false is never a size.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{shown}: {prefix}{key}: expected a positive integer ({what}), got {_show(value)}")
        if value <= 0 or value > _HF_DIM_LIMIT:
            raise ValueError(f"{shown}: {prefix}{key}: expected a positive integer below 2**31 ({what}), "
                             f"got {value}")
        return value

    def flag(key: str) -> bool | None:
        value = cfg.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise ValueError(f"{shown}: {prefix}{key}: expected true or false, got {_show(value)}")

    hidden = positive_int(_HF_HIDDEN, "hidden size")
    heads_key, _ = pick(_HF_HEADS)
    heads = positive_int(_HF_HEADS, "attention heads")

    # Falcon and GPT-BigCode: multi_query means one shared K/V head, unless Falcon's
    # new_decoder_architecture is set, which uses num_kv_heads instead.
    if flag("multi_query") and not flag("new_decoder_architecture"):
        kv_key, kv_heads = "multi_query", 1
    else:
        kv_key, _ = pick(_HF_KV_HEADS)
        kv_heads = positive_int(_HF_KV_HEADS, "key/value heads", required=False)
        if kv_heads is None:
            kv_heads = heads
    if heads % kv_heads:
        raise ValueError(f"{shown}: {prefix}{kv_key}: {heads} attention heads ({prefix}{heads_key}) "
                         f"are not a multiple of {kv_heads} key/value heads")

    head_dim = positive_int(_HF_HEAD_DIM, "per-head size", required=False)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{shown}: {prefix}{heads_key}: hidden size {hidden} is not divisible by "
                             f"{heads} heads, and there is no {prefix}head_dim")
        head_dim = hidden // heads
    if (heads + 2 * kv_heads) * head_dim > _HF_DIM_LIMIT:
        raise ValueError(f"{shown}: {prefix}head_dim: {heads} heads of {head_dim} give projections wider "
                         "than 2**31 - 1")

    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else top.get("model_type")
    bias_key = next((k for k in _HF_BIAS if cfg.get(k) is not None), None)
    both = flag(bias_key) if bias_key else None
    # a q/k/v-only switch: "qkv_bias", StableLM's "use_qkv_bias"
    qkv_only = next((flag(k) for k in ("qkv_bias", "use_qkv_bias") if cfg.get(k) is not None), None)
    default = _HF_BIAS_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if both is not None:
        qkv_bias, o_bias = both, both
    elif default is not None:
        qkv_bias, o_bias = default
    elif qkv_only is not None:
        qkv_bias, o_bias = qkv_only, False  # a q/k/v-only switch: the output projection has none
    else:
        raise ValueError(f"{shown}: {prefix}attention_bias: missing, and model_type {_show(model_type)} is not "
                         "one whose attention bias is known; add \"attention_bias\": true or false")
    if qkv_only is not None:
        qkv_bias = qkv_only

    intermediate = positive_int(_HF_INTERMEDIATE, "MLP width", required=False)
    if model_type in _HF_UNGATED_MLP_MODEL_TYPES:
        intermediate = None
    experts = positive_int(_HF_EXPERTS, "experts per MoE layer", required=False) or 0
    moe = {}
    if experts:  # the MLPs are experts, run by the MoE kernels: no dense MLP shape is the model's
        moe = dict(experts=experts, experts_per_token=positive_int(_HF_EXPERTS_PER_TOKEN, "experts per token"),
                   expert_intermediate=positive_int(_HF_EXPERT_WIDTH, "expert width", required=False) or intermediate)
        if moe["experts_per_token"] > experts:
            raise ValueError(f"{shown}: {prefix}num_experts_per_tok: {moe['experts_per_token']} is more than the "
                             f"{experts} experts")
        if moe["expert_intermediate"] is None:
            raise ValueError(f"{shown}: {prefix}moe_intermediate_size: missing (the experts' width; also looked for "
                             f"{prefix}intermediate_size)")
        intermediate = None
    vocab = positive_int(_HF_VOCAB, "vocabulary size", required=False)
    layers = positive_int(_HF_LAYERS, "decoder layers", required=False)
    mlp_bias = bool(flag("mlp_bias"))
    # A multimodal config may keep the flag at the top level rather than in text_config.
    tied = flag("tie_word_embeddings")
    if tied is None and prefix and isinstance(top.get("tie_word_embeddings"), bool):
        tied = top["tie_word_embeddings"]

    name = next((n for n in (_safe_name(top.get("_name_or_path")), _safe_name(top.get("model_type")),
                             _safe_name(cfg.get("model_type")),
                             _safe_name(os.path.basename(os.path.dirname(os.path.abspath(file)))))
                 if n), "hf-config")
    family = model_type if isinstance(model_type, str) else ""
    # (see mlp_norm: OLMo 2 has no norm before its MLP, StableLM's and Cohere's run as modules)
    mlp_norm = "fp32" if family.startswith("gemma") else None if family in ("olmo2", "stablelm", "cohere") else "x"
    return ModelPreset(name, hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, o_bias=o_bias,
                       intermediate=intermediate, vocab=vocab, layers=layers, mlp_bias=mlp_bias,
                       tied_lm_head=bool(tied), mlp_norm=mlp_norm, **moe)
