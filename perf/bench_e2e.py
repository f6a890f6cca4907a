"""End to end: a whole decoder model, stock beside ``hybridgemm.patch``, as users run it.

    hybridgemm bench --e2e --model NAME [--layers N] [--batch 1 8] [--prefill 2048]
                     [--tokens 64] [--modes ...] [--rounds 3] [--out CSV] [--plot DIR]
                     [--weights fp8 [--granularity channel|block128] [--quantize-lm-head] [--no-peers]
                      [--fp8-activations]]
    python -m hybridgemm.perf.bench_e2e  (the same options)

The model (NAME: qwen2.5-7b, llama3-8b, llama3-70b, qwen3-8b, and the mixtures of experts
qwen3-30b-a3b and mixtral-8x7b) is the transformers causal LM of its family built from a config
of the real model's sizes (perf/e2e_models.py; ``--layers`` shortens it) with random weights,
bf16, on one CUDA GPU, in one process. Modes, each at every ``--batch`` (prefill at batch 1),
after a prompt of :data:`PROMPT_LEN` random tokens:

- ``eager_generate``: HF ``generate`` (greedy, default dynamic cache); ms/token = the host time
  from the first new token to the last, as each reaches generate's streamer, / (tokens - 1),
  which leaves out the prompt's forward.
- ``eager_static``: a greedy loop over a ``StaticCache``, one token per step, positions
  advancing on the device; wall time of ``--tokens`` steps (synchronised around) / tokens.
- ``compiled_static``: the same step under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` (CUDA graph trees), :data:`WARMUP` steps first (compilation, graph
  recording), then ``--tokens`` steps timed with CUDA events. Dynamo is reset before each
  batch size and after the mode.
- ``prefill``: one forward of a ``--prefill``-token prompt, logits of its last position only
  (as ``generate`` runs it), CUDA events; ms per prefill.
- ``logits_error``: ``||logits - ref|| / ||ref||`` over all positions of a fixed
  (:data:`LOGITS_SHAPE`) batch of tokens in one forward, for the bf16 stock and patched
  models, ``ref`` from an fp32 copy built from the same state dict (TF32 off), which is freed
  at once.
- ``decode_error``: the same error over the logits a decode loop computes
  (:func:`~hybridgemm.perf.e2e_models.decode_logits`: a :data:`DECODE_PROMPT`-token prompt
  into a ``StaticCache``, its last logits, then one token per eager forward, teacher forced
  with the fixed tokens of a :data:`DECODE_SHAPE` batch: 31 of the 32 positions compared),
  which is the path the patched model's fused decode kernels take (``logits_error``'s 128 rows
  and the prompt take the unfused one).

Stock and patched: two instances of the model with the same weights (the second built, loaded
with the first's state dict, then patched in place, as strictly as ``patch(strict=True)``: a
module the report lists fails the variant, but for the decoder layers and routers of a
mixture of experts, which ``patch`` leaves as they are beside the experts it patches; the log
says so). Keeping both is what lets the variants
alternate: each mode runs ``--rounds`` rounds and in each round both variants are timed, their
order swapped every round (ABBA...), so clock and thermal drift fall on both alike, and the
compiled step functions of both stay valid between rounds (patching one model back and forth
would invalidate the other's graphs and recompile each round). Reported: the median over the
rounds, ``spread_ms`` = max - min. After all timings the patched model is unpatched and its
state dict compared bit for bit with the stock one. Peak memory: the bf16 model and its fp32
copy during the error modes (~45 GB for Qwen2.5-7B at full depth), then two bf16 copies.

FP8 weights (``--weights fp8``): the patched variant (``hybridgemm_e4m3_channel`` or
``hybridgemm_e4m3_block128``) is ``patch(model, weights="fp8", granularity=...,
quantize_lm_head=...)`` of the second copy (with ``--quantize-lm-head`` the variant and
``run_weights`` get ``_head`` after the format), beside the stock bf16 model; where torchao is
installed (``pip install 'hybridgemm[bench]'``) two peers run beside them,
``torchao_float8_weight_only`` and ``torchao_int8_weight_only`` (perf/e2e_weights.py: torchao's
weight-only configs on fresh bf16 copies, the same projections quantized; ``--no-peers`` leaves
them out; without torchao the log says so once and there are no peer rows). Every variant
runs every mode, the compiled ones under the same torch.compile options. The FP8 model cannot
be unpatched (its bf16 weights are gone), so there is no unpatch check. The error modes
compare each variant with two fp32 references: the bf16 model's (``logits_rel_err_vs_bf16``:
what quantizing costs too) and one built from the dequantized FP8 weights
(``logits_rel_err`` of the FP8 rows: what the FP8 kernels add), and add the row
``dequant_bf16``: the stock model with the dequantized weights in bf16, unpatched (dequantize
-> bf16 F.linear), against the same two; ``error_ratio`` of the FP8 row = its error / that
row's (in a bf16 run: hybridgemm's / stock's). The peers' rows have the bf16 reference's only.
Peak memory of an FP8 run: the stock model, the FP8 one and an fp32 copy during the error modes
(~60 GB for Llama-3-8B), then the bf16 dequantized copy in place of the fp32 one.
``--fp8-activations``: the patched model is also ``patch(..., activations="fp8")`` (W8A8 past
the decode rows: the prefill GEMMs quantize x to e4m3 and run cuBLASLt's FP8 GEMM); its
variant and ``run_weights`` end in ``_w8a8``, and its error rows measure the activations'
rounding too (the references keep x as it is).

Rows (one CSV, upserted on gpu, model, layers, mode, batch, variant, run_weights, so runs of
several models or of single modes share a file; ``run_weights`` is empty in a bf16 run's rows
and names the FP8 format in every row of an FP8 run, whose default file is e2e_fp8_<gpu>.csv):
``ms_per_token`` (ms per decode step, each step one new token for every sequence of the
batch; for prefill, ms per prefill), ``tokens_per_s``,
``hbm_floor_ms`` = bytes of the weights a decode step reads (every parameter except the input
embedding table, of which a step reads a row per token; the LM head included) / the GPU's
HBM read rate (perf/read_ceiling.device_read_tbps: the H200's measured 4.23 TB/s, perf/timing.HBM_TBPS;
on another GPU, measured at the start; ``read_tbps``), ``fraction_of_floor`` = floor / ms_per_token
(decode only: prefill is compute-bound), both of the stock bf16 model's bytes (``weight_bytes``);
of a mixture of experts a step reads only the experts its tokens are routed to: the bytes count,
per layer, the expected number of distinct experts B tokens reach when each picks k of E at
random (uniform routing), E * (1 - (1 - k/E)^B) (B: the batch; prefill rows: the prompt's
tokens), which ``floor_assumes`` states (empty for a dense model: every weight read once);
``weights`` (the variant's format: bf16, e4m3_channel, e4m3_block128, int8_channel),
``variant_bytes`` (its model's bytes counted the same way: e4m3 projections and their fp32
scales, the bf16 rest), ``variant_floor_ms`` and ``fraction_of_variant_floor`` (of those
bytes), ``speedup`` = stock / variant, ``logits_rel_err``, ``logits_rel_err_vs_bf16``,
``error_ratio``,
``tokens`` (new tokens per timed run: ``--tokens``, or the prefill length), ``prompt_len``,
``rounds``, ``samples`` (timings behind the median: one a round, :data:`PREFILL_PER_ROUND` for
prefill), ``status`` (ok | error, the exception in ``note``; ``note`` also says when
torch.compile ran without CUDA graphs) and the environment columns.
A failing mode or variant records ``error`` and the run goes on; exit code 1 then (or when
unpatch is not bit-exact), 2 when it cannot run (no GPU, no transformers, bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import hybridgemm
from hybridgemm.models import decode_checks, layernorm_layers
from hybridgemm.models.patching import ATTENTION_NOT_FUSED
from hybridgemm.perf import csvio, read_ceiling
from hybridgemm.perf import e2e_models as hf
from hybridgemm.perf import e2e_weights as ew
from hybridgemm.perf.bench_msweep import git_commit, gpu_label
from hybridgemm.perf.plots_models import plot_e2e
from hybridgemm.perf.read_ceiling import hbm_floor_ms, read_rate_note
from hybridgemm.perf.timing import elapsed_ms
from hybridgemm.perf.weight_formats import (
    add_weight_options,
    resolve_weight_options,
    weight_format,
    weight_options_problem,
)

MODES = ("eager_generate", "eager_static", "compiled_static", "prefill", "logits_error", "decode_error")
DECODE_MODES = MODES[:3]
ERROR_MODES = MODES[4:]  # logits against an fp32 copy of the model; no timing
VARIANTS = ("stock", "hybridgemm")  # a bf16 run's; an FP8 run's: see variants()
DEQUANT = "dequant_bf16"  # FP8 runs' error modes: the stock model with the dequantized FP8 weights, bf16, unpatched
BATCHES, PREFILL, TOKENS, ROUNDS = (1, 8), 2048, 64, 3
PROMPT_LEN = 32  # context before the timed decode steps
WARMUP = 3  # decode steps before timing: compilation, then CUDA-graph warm-up and recording
PREFILL_PER_ROUND = 3
LOGITS_SHAPE = (2, 64)
# decode_error: 32 positions' logits, the 32-token prompt's last, then 31 one-token steps
DECODE_SHAPE, DECODE_PROMPT = (2, 64), 32
SEED = 0
COMPILE = {"mode": "reduce-overhead", "fullgraph": True}
KEY = ("gpu", "model", "layers", "mode", "batch", "variant")
ROW_KEY = (*KEY, "run_weights")  # an FP8 run's rows apart from a bf16 run's (bench_tp keeps KEY)
COLUMNS = (*KEY, "run_weights", "status", "weights", "ms_per_token", "spread_ms", "tokens_per_s", "hbm_floor_ms",
           "fraction_of_floor", "variant_floor_ms", "fraction_of_variant_floor", "read_tbps", "speedup",
           "logits_rel_err", "logits_rel_err_vs_bf16", "error_ratio", "tokens", "prompt_len", "rounds", "samples",
           "weight_bytes", "variant_bytes", "floor_assumes", "note", "date", "commit", "torch", "triton",
           "transformers", "torchao", "cublaslt", "nvmath", "hybridgemm", "host", "command")


@dataclass
class Run:
    """One benchmark run's settings. ``compile_options``: torch.compile's arguments for
    ``compiled_static`` (on the CPU, tests trace with ``backend="eager"``). ``granularity``:
    None for a bf16 run, else the FP8 run's scales (channel or block128), with
    ``quantize_lm_head`` and ``peers`` (the torchao peers, where torchao is installed)."""

    name: str
    config: object  # a transformers config
    device: torch.device
    batches: tuple[int, ...] = BATCHES
    tokens: int = TOKENS
    prefill: int = PREFILL
    rounds: int = ROUNDS
    modes: tuple[str, ...] = MODES
    dtype: torch.dtype = torch.bfloat16
    compile_options: dict = field(default_factory=lambda: dict(COMPILE))
    extra: dict = field(default_factory=dict)  # columns of every row (environment, command)
    log: Callable[[str], None] = lambda line: None
    granularity: str | None = None
    quantize_lm_head: bool = False
    peers: bool = True
    fp8_activations: bool = False  # patch(..., activations="fp8"): W8A8 past the decode rows

    @property
    def run_weights(self) -> str:
        """Every row's ``run_weights``: "" in a bf16 run, else the FP8 format (``_head`` added with
        ``quantize_lm_head``, ``_w8a8`` with ``fp8_activations``), so that runs of each kind keep
        their rows apart in a CSV."""
        if self.granularity is None:
            return ""
        return (weight_format(self.granularity) + ("_head" if self.quantize_lm_head else "")
                + ("_w8a8" if self.fp8_activations else ""))

    @property
    def patched_variant(self) -> str:
        """The patched model's variant name: ``hybridgemm``, or ``hybridgemm_<run_weights>``
        (the FP8 format, then ``_head`` and ``_w8a8`` where they apply)."""
        return "hybridgemm" if self.granularity is None else f"hybridgemm_{self.run_weights}"


@dataclass
class Result:
    rows: list[dict] = field(default_factory=list)
    unpatch_exact: bool | None = None

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if r["status"] != "ok"]


class Clock:
    """Milliseconds of a call: wall time with the device synchronised around it (what an eager
    caller waits, host overhead included), or CUDA events (stream time); wall time on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wall_ms(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def event_ms(self, fn) -> float:
        if not self.cuda:
            return self.wall_ms(fn)
        self.sync()
        return elapsed_ms(fn)


def tokens(batch: int, length: int, vocab: int, device, seed: int = SEED) -> torch.Tensor:
    """A fixed batch of random token ids (the same for every variant and run)."""
    g = torch.Generator().manual_seed(seed + 1000 * batch + length)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# ----------------------------------------------------------------------------- one round per mode


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, :].argmax(dim=-1, keepdim=True)


def decoder(run: Run, model, batch: int, compiled: bool) -> Callable[[int], None]:
    """``steps(n)``: n greedy decode steps over a fresh StaticCache holding the prompt, the
    last token and the position carried on the device from one call to the next."""
    api, vocab = hf.forward_api(model), model.config.vocab_size
    cap = PROMPT_LEN + WARMUP + run.rounds * run.tokens
    cache = hf.static_cache(model, batch, -(-cap // 64) * 64)
    prompt = tokens(batch, PROMPT_LEN, vocab, run.device)
    state = {"tok": _greedy(hf.cached_forward(model, api, prompt, cache, torch.arange(PROMPT_LEN, device=run.device)))}
    pos = torch.tensor([PROMPT_LEN], device=run.device)

    def step(tok, pos):
        return _greedy(hf.cached_forward(model, api, tok, cache, pos))

    fn = torch.compile(step, **run.compile_options) if compiled else step

    def steps(n: int) -> None:
        tok = state["tok"]
        for _ in range(n):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
                tok = fn(tok, pos).clone()  # the graph's output buffer is reused by its next replay
            else:
                tok = fn(tok, pos)
            pos.add_(1)
        state["tok"] = tok

    return steps


def make_round(run: Run, mode: str, model, batch: int, clock: Clock) -> Callable[[], list[float]]:
    """Set ``mode`` up for ``model`` at ``batch`` (warm-up included) and return one timed
    round: a list of ms per token (ms per prefill)."""
    if mode == "eager_generate":
        ids = tokens(batch, PROMPT_LEN, model.config.vocab_size, run.device)
        hf.generate(model, ids, 2)
        t = run.tokens

        def gen_round():
            stamps = hf.TokenClock()
            clock.sync()
            hf.generate(model, ids, t, streamer=stamps)
            return [stamps.ms_per_step()]

        return gen_round
    if mode in ("eager_static", "compiled_static"):
        compiled = mode == "compiled_static"
        steps = decoder(run, model, batch, compiled)
        steps(WARMUP)
        timer = clock.event_ms if compiled else clock.wall_ms
        return lambda: [timer(lambda: steps(run.tokens)) / run.tokens]
    if mode == "prefill":
        api = hf.forward_api(model)
        ids = tokens(1, run.prefill, model.config.vocab_size, run.device)
        for _ in range(2):
            hf.prefill_forward(model, api, ids)
        return lambda: [clock.event_ms(lambda: hf.prefill_forward(model, api, ids)) for _ in range(PREFILL_PER_ROUND)]
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def _cudagraph_skips() -> int:
    """How many times Inductor has declined CUDA graphs in this process (0 where torch keeps no count)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 (a torch without the counter)
        return 0


def time_mode(run: Run, mode: str, batch: int, models: dict) -> tuple[dict, dict]:
    """``({variant: [ms, ...] or the exception}, {variant: note})`` for ``mode`` at ``batch``;
    ``models`` maps each variant to its model (or to the exception that kept it from being
    built). Rounds alternate the variants, the order swapped every round. A note says when
    ``torch.compile`` ran a variant without CUDA graphs."""
    clock, results, rounds, notes = Clock(run.device), {}, {}, {}
    if mode == "compiled_static":
        torch._dynamo.reset()
    try:
        for v, model in models.items():
            if isinstance(model, BaseException):
                results[v] = model
                continue
            skips = _cudagraph_skips()
            try:
                rounds[v] = make_round(run, mode, model, batch, clock)
            except Exception as e:  # noqa: BLE001 (recorded in the row; the run goes on)
                results[v] = e.with_traceback(None)  # its frames would keep the mode's tensors alive
            if _cudagraph_skips() > skips:
                notes[v] = "torch.compile skipped CUDA graphs (TORCH_LOGS=perf_hints says why)"
                run.log(f"{mode} batch {batch} {v}: {notes[v]}")
        samples = {v: [] for v in rounds}
        for r in range(run.rounds):
            for v in list(rounds)[:: 1 if r % 2 == 0 else -1]:
                if v in results:
                    continue
                try:
                    samples[v] += rounds[v]()
                except Exception as e:  # noqa: BLE001
                    results[v] = e.with_traceback(None)
        return {v: results.get(v, samples.get(v)) for v in models}, notes
    finally:
        rounds.clear()
        if mode == "compiled_static":
            torch._dynamo.reset()
        _free(run.device)


# ----------------------------------------------------------------------------- rows


def mode_rows(run: Run, mode: str, batch: int, results: dict, weight_bytes: int,
              notes: dict | None = None, variant_bytes: dict | None = None,
              formats: dict | None = None, floor_assumes: str = "") -> list[dict]:
    """One row per variant from :func:`time_mode`'s results and notes. ``weight_bytes``: the
    stock model's (``hbm_floor_ms``); ``variant_bytes``, ``formats``: each variant's bytes
    (``variant_floor_ms``; default ``weight_bytes``) and weight format (default bf16);
    ``floor_assumes``: what those bytes assume of the routing (a mixture of experts), if anything."""
    floor = hbm_floor_ms(weight_bytes, device=run.device)
    ok = {v: statistics.median(s) for v, s in results.items() if isinstance(s, list) and s}
    rows = []
    for v, res in results.items():
        own_bytes = (variant_bytes or {}).get(v, weight_bytes)
        row = {**run.extra, "model": run.name, "layers": run.config.num_hidden_layers, "mode": mode, "batch": batch,
               "variant": v, "run_weights": run.run_weights, "weights": (formats or {}).get(v, "bf16"),
               "weight_bytes": weight_bytes, "variant_bytes": own_bytes, "rounds": run.rounds,
               **({"floor_assumes": floor_assumes} if floor_assumes else {}),
               "tokens": run.prefill if mode == "prefill" else run.tokens,
               "prompt_len": run.prefill if mode == "prefill" else PROMPT_LEN}
        if v not in ok:
            err = res if isinstance(res, BaseException) else RuntimeError("no samples")
            row.update(status="error", note=f"{type(err).__name__}: {err}"[:600])
        else:
            ms = ok[v]
            per_run = run.prefill if mode == "prefill" else batch
            row.update(status="ok", note=(notes or {}).get(v), ms_per_token=ms, spread_ms=max(res) - min(res),
                       samples=len(res),
                       tokens_per_s=per_run * 1e3 / ms if ms > 0 else math.nan,
                       speedup=ok["stock"] / ms if "stock" in ok and ms > 0 else None)
            if mode in DECODE_MODES:
                own = hbm_floor_ms(own_bytes, device=run.device)
                row.update(hbm_floor_ms=floor, fraction_of_floor=floor / ms if ms > 0 else math.nan,
                           read_tbps=read_ceiling.device_read_tbps(run.device)[0],
                           variant_floor_ms=own, fraction_of_variant_floor=own / ms if ms > 0 else math.nan)
        rows.append(row)
    return rows


def error_ids(mode: str, vocab: int, device) -> torch.Tensor:
    """The fixed tokens of error mode ``mode``."""
    return tokens(*(LOGITS_SHAPE if mode == "logits_error" else DECODE_SHAPE), vocab, device)


def error_logits(mode: str, model, ids: torch.Tensor) -> torch.Tensor:
    """The fp32 logits error mode ``mode`` compares: every position in one forward
    (``logits_error``) or each decode step's (``decode_error``)."""
    if mode == "logits_error":
        return hf.full_logits(model, ids).float()
    return hf.decode_logits(model, ids, DECODE_PROMPT)


def rel_error(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return ((logits - ref).norm() / ref.norm()).item()


@dataclass
class ErrorModels:
    """What an error mode compares (:func:`logits_rows`): ``models`` (variant: model, or the
    exception that kept it from being built), ``own`` (variant: the key of the fp32 reference
    of its own weights: ``bf16``, or ``dequantized`` for an FP8 variant; a variant without one
    is compared with the bf16 model's only), ``formats`` (variant: weights column) and
    ``compared`` ((variant, baseline): the first's row gets ``error_ratio``, its own-weights
    error / the baseline's)."""

    models: dict
    own: dict[str, str]
    formats: dict[str, str]
    compared: tuple[str, str]


def logits_rows(run: Run, mode: str, ids, cmp: ErrorModels, refs: dict[str, torch.Tensor | BaseException]
                ) -> list[dict]:
    """Error-mode ``mode`` rows, one per variant of ``cmp``: the relative error of its logits
    against ``refs[cmp.own[variant]]`` (``logits_rel_err``) and ``refs["bf16"]`` (the bf16
    model's fp32 logits: ``logits_rel_err_vs_bf16``)."""
    rows = {}
    base = {**run.extra, "model": run.name, "layers": run.config.num_hidden_layers, "mode": mode,
            "run_weights": run.run_weights, "batch": ids.shape[0],
            "prompt_len": ids.shape[1] if mode == "logits_error" else DECODE_PROMPT,
            "tokens": ids.shape[1] - (DECODE_PROMPT if mode == "decode_error" else 0)}
    for v, model in cmp.models.items():
        row = rows[v] = {**base, "variant": v, "weights": cmp.formats.get(v, "bf16")}
        try:
            wanted = {"logits_rel_err_vs_bf16": refs["bf16"]}
            if v in cmp.own:
                wanted["logits_rel_err"] = refs[cmp.own[v]]
            for ref in (*wanted.values(), model):
                if isinstance(ref, BaseException):
                    raise ref
            with torch.no_grad():
                logits = error_logits(mode, model, ids)
            row.update(status="ok", **{col: rel_error(logits, ref) for col, ref in wanted.items()})
        except Exception as e:  # noqa: BLE001
            row.update(status="error", note=f"{type(e).__name__}: {e}"[:600])
    v, baseline = cmp.compared
    if v in rows and baseline in rows:
        err, base_err = rows[v].get("logits_rel_err"), rows[baseline].get("logits_rel_err")
        if err is not None and base_err:
            what = "stock bf16's error" if baseline == "stock" else f"{baseline}'s error (dequantize -> bf16 F.linear)"
            rows[v].update(error_ratio=err / base_err, note=f"{err / base_err:.3f}x {what}")
    return list(rows.values())


def fp32_error_logits(run: Run, build: Callable[[], torch.nn.Module], jobs: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor | BaseException]:
    """Per error mode of ``jobs`` (mode: ids), the logits of the fp32 model ``build()`` makes,
    TF32 off, or the exception (the build's, for every mode); the model is freed after."""
    model = None
    try:
        try:
            model = build()
        except Exception as e:  # noqa: BLE001 (each mode's rows record it)
            return {mode: e.with_traceback(None) for mode in jobs}
        out: dict[str, torch.Tensor | BaseException] = {}
        for mode, ids in jobs.items():
            try:
                with torch.no_grad(), _no_tf32():
                    out[mode] = error_logits(mode, model, ids)
            except Exception as e:  # noqa: BLE001
                out[mode] = e.with_traceback(None)
        return out
    finally:
        model = None
        _free(run.device)


def fp32_logits(run: Run, stock, jobs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | BaseException]:
    """:func:`fp32_error_logits` of an fp32 copy of ``stock`` (its state dict)."""
    def copy():
        ref_model = hf.build_model(run.config, torch.float32, run.device)
        ref_model.load_state_dict(stock.state_dict())
        return ref_model

    return fp32_error_logits(run, copy, jobs)


def attention_skips(report) -> list[tuple[str, str]]:
    """The entries of ``report.skipped`` for decoder layers ``patch`` fused whose attention runs
    the module's own function over the fused Q/K/V (Gemma 2's softcapped attention): the layer
    is measured as patched, and the log lists them."""
    fused = set(report.fused_layers)
    return [(n, r) for n, r in report.skipped if n in fused and r.startswith(ATTENTION_NOT_FUSED)]


def norm_module_skips(report, model) -> list[tuple[str, str]]:
    """The entries of ``report.skipped`` for the norms of decoder layers ``patch`` fused that call
    them as the modules they are (StableLM's, Cohere's, GPT-NeoX's and Falcon's LayerNorms,
    ``decode_checks.NORMS_AS_MODULES``): the layer is measured as patched, and the log lists them."""
    names = {n: layernorm_layers.norm_names(model.get_submodule(n)) for n in report.fused_layers
             if decode_checks.norm_modules(model.get_submodule(n))}
    return [(n, r) for n, r in report.skipped if n.rpartition(".")[2] in names.get(n.rpartition(".")[0], ())]


def _patched(run: Run, stock) -> tuple[torch.nn.Module | BaseException, list[str]]:
    """A copy of ``stock`` patched as ``run`` asks (FP8 weights with a granularity), and the
    names of the modules ``patch`` quantized; or the exception that stopped it. As strict as
    ``patch(strict=True)`` (every module patch reports it left alone fails the variant) but
    for fused layers whose attention runs the module's function (:func:`attention_skips`) and
    the norms fused layers call as modules (:func:`norm_module_skips`), which the log lists."""
    try:
        patched = hf.build_model(run.config, run.dtype, run.device)
        patched.load_state_dict(stock.state_dict())
        fp8 = {} if run.granularity is None else dict(weights="fp8", granularity=run.granularity,
                                                       quantize_lm_head=run.quantize_lm_head,
                                                       activations="fp8" if run.fp8_activations else "same")
        report = hybridgemm.patch(patched, **fp8)
        partial, norms = attention_skips(report), norm_module_skips(report, patched)
        left = [s for s in report.skipped if s not in partial and s not in norms]
        if not report.patched or left:
            raise ValueError(f"{report.summary()}; {len(left)} modules left unpatched or unfused: "
                             + "; ".join(f"{n or '(root)'}: {r}" for n, r in left))
        run.log(report.summary() + (f"; {len(report.fp8)} projections quantized ({run.granularity})" if fp8 else ""))
        if norms:
            kinds = dict.fromkeys(type(patched.get_submodule(n)).__name__ for n, _ in norms)
            run.log(f"{len(norms)} norms of fused decoder layers run as their modules ({', '.join(kinds)})")
        if partial:
            reasons = dict.fromkeys(r for _, r in partial)
            run.log(f"{len(partial)} fused decoder layers run their attention module's function over the fused "
                    f"Q/K/V ({'; '.join(reasons)})")
        return patched, list(report.fp8)
    except Exception as e:  # noqa: BLE001 (the stock rows are still measured)
        run.log(f"patch failed: {type(e).__name__}: {e}")
        return e.with_traceback(None), []


def error_rows(run: Run, jobs: dict, bf16_refs: dict, stock, patched, names: list[str], peers: dict) -> list[dict]:
    """The rows of the error modes in ``jobs`` (mode: ids) for the stock, patched and peer
    models, ``bf16_refs`` (mode: the fp32 logits of the stock model, :func:`fp32_logits`); an
    FP8 run adds the dequantized fp32 reference and the dequantized bf16 model (built here and
    freed before returning)."""
    hyb = run.patched_variant
    refs = {"bf16": bf16_refs}
    models = {"stock": stock, hyb: patched, **peers}
    own = {"stock": "bf16", hyb: "bf16"}
    formats = {hyb: weight_format(run.granularity), **{v: ew.PEERS[v][1] for v in peers}}
    compared = (hyb, "stock")
    if run.granularity is not None:
        def build(dtype):
            if isinstance(patched, BaseException):
                raise patched
            return ew.dequantized_model(run.config, stock, patched, names, dtype, run.device)

        refs["dequantized"] = fp32_error_logits(run, lambda: build(torch.float32), jobs)
        try:
            models[DEQUANT] = build(run.dtype)
        except Exception as e:  # noqa: BLE001
            models[DEQUANT] = e.with_traceback(None)
        own.update({hyb: "dequantized", DEQUANT: "dequantized"})
        compared = (hyb, DEQUANT)
    rows = []
    try:
        for mode, ids in jobs.items():
            run.log(f"{mode} ...")
            rows += logits_rows(run, mode, ids, ErrorModels(models, own, formats, compared),
                                {k: r[mode] for k, r in refs.items()})
    finally:
        models.pop(DEQUANT, None)
        _free(run.device)
    return rows


def step_bytes(run: Run, model, tokens: int) -> int:
    """Bytes of ``model``'s weights one forward of ``tokens`` tokens reads (a decode step of
    batch ``tokens``): every weight, but of a mixture of experts only the experts uniform
    routing is expected to reach (:func:`hf.uniform_experts_read`)."""
    return hf.decode_weight_bytes(model, hf.uniform_experts_read(run.config, tokens))


def run_e2e(run: Run, on_rows: Callable[[list[dict]], None] | None = None) -> Result:
    """Every mode of ``run`` (see the module docstring); ``on_rows(rows so far)`` after each."""
    res = Result()

    def add(rows):
        res.rows += rows
        if on_rows is not None:
            on_rows(res.rows)

    torch.manual_seed(SEED)
    stock = hf.build_model(run.config, run.dtype, run.device)
    weight_bytes = step_bytes(run, stock, 1)
    if not hf.floor_assumption(run.config, 1):
        run.log(f"{run.name}, {run.config.num_hidden_layers} layers: {weight_bytes / 1e9:.2f} GB read per decode "
                f"step, HBM floor {hbm_floor_ms(weight_bytes, device=run.device):.3f} ms "
                f"at {read_rate_note(run.device)}")
    else:
        run.log(f"{run.name}, {run.config.num_hidden_layers} layers: {hf.decode_weight_bytes(stock) / 1e9:.2f} GB "
                "of weights, every expert included")
        for b in run.batches:
            nbytes = step_bytes(run, stock, b)
            run.log(f"batch {b}: {nbytes / 1e9:.2f} GB read per decode step, HBM floor "
                    f"{hbm_floor_ms(nbytes, device=run.device):.3f} ms at {read_rate_note(run.device)}; "
                    f"{hf.floor_assumption(run.config, b)}")
    jobs = {m: error_ids(m, run.config.vocab_size, run.device) for m in run.modes if m in ERROR_MODES}
    bf16_refs = fp32_logits(run, stock, jobs) if jobs else {}  # its fp32 copy beside the stock model only
    patched, names = _patched(run, stock)
    peers = ew.peer_models(run.config, stock, run.quantize_lm_head, run.device, run.log) \
        if run.granularity is not None and run.peers else {}
    models = {"stock": stock, run.patched_variant: patched, **peers}
    formats = {v: ew.PEERS[v][1] if v in ew.PEERS else weight_format(run.granularity) for v in models if v != "stock"}
    variant_bytes = {v: step_bytes(run, m, 1) for v, m in models.items() if not isinstance(m, BaseException)}
    at_one = " at batch 1" if hf.floor_assumption(run.config, 1) else ""
    for v, nbytes in variant_bytes.items():
        if v != "stock":
            run.log(f"{v}: {nbytes / 1e9:.2f} GB read per decode step{at_one}, HBM floor "
                    f"{hbm_floor_ms(nbytes, device=run.device):.3f} ms")
    if jobs:
        add(error_rows(run, jobs, bf16_refs, stock, patched, names, peers))
        bf16_refs = None
    tasks = [(m, b) for m in run.modes if m in DECODE_MODES for b in run.batches]
    tasks += [("prefill", 1)] if "prefill" in run.modes else []
    with torch.no_grad():
        for i, (mode, batch) in enumerate(tasks, 1):
            run.log(f"[{i}/{len(tasks)}] {mode} batch {batch} ...")
            results, notes = time_mode(run, mode, batch, models)
            routed = run.prefill if mode == "prefill" else batch  # the tokens one forward routes
            own = {v: step_bytes(run, m, routed) for v, m in models.items() if not isinstance(m, BaseException)}
            rows = mode_rows(run, mode, batch, results, own["stock"], notes, own, formats,
                             hf.floor_assumption(run.config, routed))
            run.log(f"[{i}/{len(tasks)}] {mode} batch {batch}: " + _brief(rows))
            add(rows)
    if run.granularity is None and not isinstance(patched, BaseException):
        hybridgemm.unpatch(patched)
        a, b = stock.state_dict(), patched.state_dict()
        res.unpatch_exact = list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        run.log(f"unpatch: state dict {'bit-exact with' if res.unpatch_exact else 'DIFFERS from'} the stock model's")
    return res


def _brief(rows: list[dict]) -> str:
    parts = []
    for r in rows:
        if r["status"] != "ok":
            parts.append(f"{r['variant']} ERROR {r.get('note', '')[:160]}")
            continue
        floor = f" ({r['fraction_of_floor']:.0%} of floor" if r.get("fraction_of_floor") else ""
        if floor and r.get("variant_bytes") != r.get("weight_bytes"):
            floor += f", {r['fraction_of_variant_floor']:.0%} of its own"
        sp = f", {r['speedup']:.3f}x" if r["variant"] != "stock" and r.get("speedup") else ""
        parts.append(f"{r['variant']} {r['ms_per_token']:.3f} ms{floor}{')' if floor else ''}{sp}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- files, summary


def upsert(path, rows: list[dict], columns: tuple[str, ...] = COLUMNS, key: tuple[str, ...] = ROW_KEY) -> None:
    """Write ``rows`` into the CSV at ``path`` (``columns``, default :data:`COLUMNS`), replacing
    earlier rows of the same ``key`` (default :data:`ROW_KEY`) and keeping the others."""
    merged = {tuple(str(r.get(c, "")) for c in key): r for r in csvio.read_rows(str(path))}
    for r in rows:
        merged[tuple(str(r.get(c, "")) for c in key)] = r
    csvio.write_csv(path, columns, merged.values())


def print_summary(res: Result, console=None) -> None:
    """Per (mode, batch), each variant's ms, its speedup over stock and its fractions of the HBM
    floor of the stock bf16 model's bytes and of its own; then the logits errors."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    tab = Table(title="end to end: ms per decode step (prefill: ms per prefill); speedup = stock / variant; "
                      "floors: the stock bf16 model's bytes and the variant's own")
    for col in ("mode", "batch", "variant", "weights", "ms", "speedup", "of bf16 floor", "of own floor"):
        tab.add_column(col, justify="left" if col in ("mode", "variant", "weights") else "right")

    def num(r, col, fmt):
        if r["status"] != "ok":
            return "error"
        v = r.get(col)
        return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"

    for r in res.rows:
        if r["mode"] not in ERROR_MODES:
            tab.add_row(r["mode"], str(r["batch"]), r["variant"], r.get("weights", "bf16"),
                        num(r, "ms_per_token", ".3f"), num(r, "speedup", ".3f") if r["variant"] != "stock" else "",
                        num(r, "fraction_of_floor", ".1%"), num(r, "fraction_of_variant_floor", ".1%"))
    if tab.row_count:
        console.print(tab)
    for r in res.rows:
        if r["mode"] in ERROR_MODES:
            what = "logits" if r["mode"] == "logits_error" else "decode-step logits"
            vs_bf16 = ""
            if r.get("weights", "bf16") != "bf16" or r["variant"] == DEQUANT:
                vs_bf16 = f"; vs the bf16 model's fp32: {num(r, 'logits_rel_err_vs_bf16', '.3e')}"
            console.print(f"{what} error vs fp32, {r['variant']}: {num(r, 'logits_rel_err', '.3e')}{vs_bf16}"
                          + (f" ({r['note']})" if r.get("note") else ""), markup=False, highlight=False)


# ----------------------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r:.40}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def token_count(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("must be at least 2 (ms/token of generate is a difference over "
                                          "tokens - 1)")
    return value


def model_name(text: str) -> str:
    try:
        return hf.canonical_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_e2e_options(ap: argparse.ArgumentParser, default_modes: tuple[str, ...] = MODES) -> None:
    """The options that only the end-to-end run has (shared with ``hybridgemm bench`` and
    perf/bench_tp.py, whose default modes, named in the help, are ``default_modes``)."""
    ap.add_argument("--layers", type=positive_int, help="decoder layers (default: the model's own)")
    ap.add_argument("--batch", type=positive_int, nargs="+", help=f"batch sizes of the decode modes (default "
                    f"{' '.join(map(str, BATCHES))})")
    ap.add_argument("--prefill", type=positive_int, help=f"prompt length of the prefill mode (default {PREFILL})")
    ap.add_argument("--tokens", type=token_count, help=f"decode steps timed per round (default {TOKENS})")
    ap.add_argument("--modes", nargs="+", choices=MODES, metavar="MODE",
                    help=f"modes to run (default: {'all' if default_modes == MODES else ' '.join(default_modes)}): "
                    f"{', '.join(MODES)}")
    ap.add_argument("--rounds", type=positive_int, help=f"timed rounds per variant (default {ROUNDS})")


FP8_FLAGS = ("quantize_lm_head", "no_peers", "fp8_activations")  # options of FP8 runs only (and --granularity)
WEIGHTS_HELP = ("the patched model's projections quantized to e4m3 (patch(weights='fp8')), beside the stock bf16 "
                "model and the torchao peers")


def add_fp8_options(ap: argparse.ArgumentParser) -> None:
    """The options of an FP8 run besides ``--weights`` and ``--granularity`` (perf/weight_formats.py);
    default None, so that :func:`fp8_options_problem` tells a given one."""
    ap.add_argument("--quantize-lm-head", action="store_true", default=None,
                    help="FP8 runs: quantize the LM head too (patch(quantize_lm_head=True); the peers' too)")
    ap.add_argument("--no-peers", action="store_true", default=None,
                    help="FP8 runs: no torchao peer rows (they run where torchao is installed)")
    ap.add_argument("--fp8-activations", action="store_true", default=None,
                    help="FP8 runs: patch(activations='fp8'), prefill GEMMs on x quantized to e4m3 (W8A8)")


def fp8_options_problem(args: argparse.Namespace) -> str:
    """Why the weight options of ``args`` do not go together ("" when they do)."""
    problem = weight_options_problem(args.weights, args.granularity)
    given = [f"--{name.replace('_', '-')}" for name in FP8_FLAGS if getattr(args, name, None)]
    if not problem and given and args.weights != "fp8":
        problem = f"{', '.join(given)}: only with --weights fp8"
    return problem


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgemm.perf.bench_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=model_name, help=f"one of {', '.join(hf.model_names())}")
    add_e2e_options(ap)
    add_weight_options(ap, WEIGHTS_HELP)
    add_fp8_options(ap)
    ap.add_argument("--out", help="CSV to upsert rows into, or a folder for e2e_<gpu>.csv (FP8 runs: "
                    "e2e_fp8_<gpu>.csv) (default: that file here)")
    ap.add_argument("--plot", metavar="DIR", help="draw e2e.png from the CSV into DIR afterwards")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    problem = fp8_options_problem(args)
    if problem:
        ap.error(problem)
    resolve_weight_options(args)
    args.quantize_lm_head, args.no_peers = bool(args.quantize_lm_head), bool(args.no_peers)
    args.fp8_activations = bool(args.fp8_activations)
    return args


def command_line(args) -> str:
    """The run as one canonical command line (stored in every row)."""
    parts = ["hybridgemm", "bench", "--e2e", "--model", args.model, "--layers", str(args.layers),
             "--batch", *map(str, args.batch)]
    parts += ["--prefill", str(args.prefill)] if "prefill" in args.modes else []  # no other mode reads it
    parts += ["--tokens", str(args.tokens), "--modes", *args.modes, "--rounds", str(args.rounds)]
    if args.weights == "fp8":
        parts += ["--weights", "fp8", "--granularity", args.granularity]
        parts += [f"--{name.replace('_', '-')}" for name in FP8_FLAGS if getattr(args, name)]
    return shlex.join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_e2e: needs a CUDA GPU (none found here): it times whole models on the GPU", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print("bench_e2e: needs transformers (pip install transformers) to build the models", file=sys.stderr)
        return 2

    config = hf.hf_config(args.model, args.layers)
    args.layers = config.num_hidden_layers
    args.batch = tuple(args.batch or BATCHES)
    args.prefill, args.tokens = args.prefill or PREFILL, args.tokens or TOKENS
    args.modes, args.rounds = tuple(dict.fromkeys(args.modes or MODES)), args.rounds or ROUNDS
    gpu = torch.cuda.get_device_name()
    # an FP8 run's stock rows have the bf16 run's keys: a file of their own keeps each run's pairs together
    name = f"{'e2e' if args.weights == 'bf16' else 'e2e_fp8'}_{gpu_label(gpu)}.csv"
    out = args.out or name
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        out = os.path.join(out, name)
    extra = {**csvio.environment_columns(command_line(args)), "transformers": transformers.__version__,
             "date": datetime.date.today().isoformat(), "commit": git_commit()}
    if args.weights == "fp8" and not args.no_peers:
        extra["torchao"] = ew.torchao_version() or ""
    start = time.perf_counter()

    def log(line: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    run = Run(args.model, config, torch.device("cuda"), args.batch, args.tokens, args.prefill, args.rounds,
              args.modes, extra=extra, log=log, granularity=args.granularity, quantize_lm_head=args.quantize_lm_head,
              peers=not args.no_peers, fp8_activations=args.fp8_activations)
    log(f"{command_line(args)} on {gpu}, torch {torch.__version__}, transformers {transformers.__version__}")
    res = run_e2e(run, on_rows=lambda rows: upsert(out, rows))
    print_summary(res)
    print(f"wrote {len(res.rows)} rows to {out}")
    rc = 0
    if res.errors:
        print("bench_e2e: errors in " + ", ".join(f"{r['mode']} B={r['batch']} {r['variant']}" for r in res.errors),
              file=sys.stderr)
        rc = 1
    if res.unpatch_exact is False:
        print("bench_e2e: after unpatch the state dict differs from the stock model's", file=sys.stderr)
        rc = 1
    if args.plot:
        try:
            print(f"wrote {plot_e2e(out, args.plot)}")
        except ImportError:
            print("bench_e2e: no matplotlib: skipping e2e.png (pip install 'hybridgemm[plot]')", file=sys.stderr)
        except ValueError as e:  # no row with a time
            print(f"bench_e2e: no figure: {e}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
