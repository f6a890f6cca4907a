"""The tensor-parallel benchmark (perf/bench_tp.py) without a GPU: two ranks launched by
torchrun on the gloo backend run the tiny model end to end (eager decode, prefill, logits
error; the compiled mode recorded as skipped, and once traced with ``--compile-backend
eager``), the rows, the CSV and the figure checked; the command-line errors in this process;
the 70B sizes and both sharding plans of perf/tp_models.py on the meta device, under a fake
process group; and plot_tp from a synthetic CSV."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf import bench_tp as T
from hybridgemm.perf import tp_models as M
from hybridgemm.perf.csvio import command_as_run, read_rows

transformers = pytest.importorskip("transformers")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_TIMEOUT_S = 900  # a hang guard for one torchrun launch (a minute or two on a busy 2-core machine)
VARIANTS = tuple(T.VARIANTS)
TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m hybridgemm.perf.bench_tp --model tiny
    --device cpu ARGS`` (torch.distributed.run is what the torchrun script runs), bounded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "hybridgemm.perf.bench_tp", "--model", "tiny", "--device", "cpu", *args]
    for attempt in range(2):
        try:
            proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"bench_tp on two ranks did not finish within {RUN_TIMEOUT_S} s:\n{e.stderr}")
        # One retry for a rank killed by C++'s std::terminate with no exception in flight, which
        # a C++ thread's destructor can call in the interpreter's teardown: a finished rank skips
        # that teardown (bench_tp.exit_now), a rank that raised does not. Any other failure, or
        # the same one twice, is reported.
        if proc.returncode == 0 or "terminate called without an active exception" not in proc.stderr or attempt:
            return proc
    return proc


def tiny_weight_bytes(tp: int) -> int:
    """Bytes a decode step reads on one of ``tp`` ranks, counted by hand from tp_models.TINY:
    hidden 64, 4 heads of 16 (2 KV heads), MLP 128, vocabulary 256, 2 layers, q/k/v/o biases.
    Sharded: q/k/v rows with their biases, o columns (its bias whole on every rank), the MLP,
    the LM head's rows; norms whole; the input embedding never read in full."""
    h, q, kv, inter, vocab, layers = 64, 64, 32, 128, 256, 2
    attn = (q * h + q) + 2 * (kv * h + kv) + h * q
    per_layer = attn // tp + h + 3 * inter * h // tp + 2 * h  # ... + o's bias, MLP, two norms
    return 2 * (layers * per_layer + h + vocab * h // tp)  # final norm, LM head; bf16


# ----------------------------------------------------------------------------- two ranks, end to end


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    proc = torchrun(tmp, "--batch", "1", "2", "--tokens", "3", "--prefill", "16", "--rounds", "2", "--modes",
                    "eager_static", "compiled_static", "prefill", "logits_error", "decode_error", "--out", "res/tp.csv",
                    "--plot", "figs")
    return proc, tmp


def test_two_ranks_write_every_row(two_ranks):
    proc, tmp = two_ranks
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(str(tmp / "res" / "tp.csv"))
    assert list(rows[0]) == list(T.COLUMNS)
    measured = [("eager_static", 1), ("eager_static", 2), ("compiled_static", 1), ("compiled_static", 2),
                ("prefill", 1), ("logits_error", E.LOGITS_SHAPE[0]), ("decode_error", E.DECODE_SHAPE[0])]
    assert sorted((r["mode"], int(r["batch"]), r["variant"]) for r in rows) == sorted(
        (m, b, v) for m, b in measured for v in VARIANTS)
    for r in rows:
        assert (r["gpu"], r["model"], r["layers"], r["tp"]) == ("cpu", "tiny", "2", str(T.VARIANTS[r["variant"]]))
        assert r["command"].startswith(
            command_as_run("torchrun --nproc-per-node 2 -m hybridgemm.perf.bench_tp --model tiny"))
        assert r["transformers"] == transformers.__version__ and r["date"] and r["commit"]
        if r["mode"] == "compiled_static":
            assert r["status"] == "skipped" and "CPU" in r["note"] and not r["ms_per_token"], r
        else:
            assert r["status"] == "ok", r
    assert (tmp / "figs" / "tp.png").read_bytes()[:8] == PNG_MAGIC
    assert "tp2_stock" in proc.stdout and f"wrote {7 * len(VARIANTS)} rows" in proc.stdout


def test_times_speedups_and_floors(two_ranks):
    proc, tmp = two_ranks
    rows = [r for r in read_rows(str(tmp / "res" / "tp.csv")) if r["status"] == "ok" and r["mode"] not in E.ERROR_MODES]
    tp1 = {(r["mode"], r["batch"]): float(r["ms_per_token"]) for r in rows if r["variant"] == "tp1_hybridgemm"}
    for r in rows:
        ms, tp = float(r["ms_per_token"]), T.VARIANTS[r["variant"]]
        assert math.isfinite(ms) and ms > 0 and int(r["samples"]) >= int(r["rounds"]) == 2
        per_run = 16 if r["mode"] == "prefill" else int(r["batch"])
        assert float(r["tokens_per_s"]) == pytest.approx(per_run * 1e3 / ms)
        assert float(r["speedup_vs_tp1"]) == pytest.approx(tp1[(r["mode"], r["batch"])] / ms)
        assert int(r["weight_bytes_per_gpu"]) == tiny_weight_bytes(tp)
        floor = E.hbm_floor_ms(tiny_weight_bytes(tp))
        assert float(r["hbm_floor_ms_per_gpu"]) == pytest.approx(floor)
        if r["mode"] == "prefill":
            assert not r["fraction_of_floor"]
        else:
            assert float(r["fraction_of_floor"]) == pytest.approx(floor / ms)


def test_sharded_logits_are_as_close_to_fp32_as_the_whole_model(two_ranks):
    """Every variant holds its part of the same full model: the tp=2 logits are as close to the
    fp32 reference as tp=1's (a shard of another model, a bias added twice or a wrong KV head
    would be off by far more than bf16 rounding)."""
    proc, tmp = two_ranks
    for mode in E.ERROR_MODES:
        err = {r["variant"]: float(r["logits_rel_err"]) for r in read_rows(str(tmp / "res" / "tp.csv"))
               if r["mode"] == mode}
        assert set(err) == set(VARIANTS), mode
        assert 0 < err["tp1_hybridgemm"] < 0.02, (mode, err)
        for v in ("tp2_hybridgemm", "tp2_hybridgemm_push", "tp2_stock"):
            assert 0 < err[v] < 2 * err["tp1_hybridgemm"], (mode, err)


def test_compiled_decode_traces_both_sharded_models_in_one_graph(tmp_path):
    """``--compile-backend eager``: Dynamo traces the static-cache decode step of both tp=2
    models with fullgraph=True (DTensor included), so no fullgraph=False fallback note."""
    proc = torchrun(tmp_path, "--batch", "2", "--tokens", "2", "--rounds", "1", "--modes", "compiled_static",
                    "--compile-backend", "eager", "--variants", "tp2_stock", "tp2_hybridgemm", "--out", "c.csv",
                    "--no-progress")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(str(tmp_path / "c.csv"))
    assert [(r["variant"], r["status"], r["note"]) for r in rows] == [("tp2_stock", "ok", ""),
                                                                      ("tp2_hybridgemm", "ok", "")]
    assert "--compile-backend eager" in rows[0]["command"]


@pytest.fixture
def one_rank(tmp_path):
    """This process as the one rank of a gloo group (for the tp=1 paths)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield T.Ranks(0, 1, dist.group.WORLD, dist.group.WORLD)
    dist.destroy_process_group()


def test_a_model_too_big_for_one_gpu_skips_tp1_and_the_reference(one_rank, monkeypatch):
    """What the 80-layer 70B gets on an H200 (the memory check stubbed: the CPU is never
    checked): tp1_hybridgemm is never built, every one of its rows is skipped with the figures."""
    monkeypatch.setattr(T, "fits", lambda nbytes, device, fraction, free=False: "141.1 GB, above 85% of ...")
    monkeypatch.setattr(T, "build", lambda *a: pytest.fail("a model that does not fit was built"))
    run = E.Run("tiny", T.model_config("tiny"), torch.device("cpu"), batches=(1, 8), tokens=2, prefill=8, rounds=1,
                modes=("compiled_static", "prefill", "logits_error"), extra={"gpu": "cpu"})
    res = T.run_tp(run, one_rank, ("tp1_hybridgemm",))
    assert [(r["mode"], r["batch"], r["status"]) for r in res.rows] == [
        ("compiled_static", 1, "skipped"), ("compiled_static", 8, "skipped"), ("prefill", 1, "skipped"),
        ("logits_error", 2, "skipped")]
    assert all(r["note"] == "the bf16 weights do not fit one GPU: 141.1 GB, above 85% of ..." for r in res.rows)
    assert not res.errors


def test_stock_compile_falls_back_to_graph_breaks_with_a_note(monkeypatch):
    """tp2_stock's compiled mode, when fullgraph=True fails, is measured again with
    fullgraph=False and the note says why; the hybridgemm variants never fall back."""
    seen = []

    def fake_measure(run, mode, batch, model, ranks, lockstep):
        seen.append(run.compile_options["fullgraph"])
        if run.compile_options["fullgraph"]:
            return RuntimeError("Unsupported: graph break in DTensor\nmore"), ""
        return [2.0], ""

    monkeypatch.setattr(T, "measure", fake_measure)
    run = E.Run("tiny", T.model_config("tiny"), torch.device("cpu"))
    res, note = T.measure_variant_mode(run, "tp2_stock", "compiled_static", 1, None, None)
    assert (res, seen) == ([2.0], [True, False])
    assert note == "fullgraph=False (with fullgraph=True: RuntimeError: Unsupported: graph break in DTensor)"
    assert run.compile_options["fullgraph"] is True  # the run's own options are left as they were
    seen.clear()
    res, _ = T.measure_variant_mode(run, "tp2_hybridgemm", "compiled_static", 1, None, None)
    assert isinstance(res, RuntimeError) and seen == [True]


def test_a_finished_rank_exits_without_the_teardown(tmp_path):
    """exit_now: the exit code kept, Python's exit handlers run, buffered output flushed, and no
    interpreter teardown (a module global's ``__del__``, which the teardown runs, never runs);
    the same script ending in ``sys.exit`` runs all of it."""
    script = ("import atexit, os, sys\n"
              "from hybridgemm.perf.bench_tp import exit_now\n"
              "class Held:\n"
              "    def __del__(self, mark=os.path.abspath('teardown'), open=open):\n"
              "        open(mark, 'w').close()\n"
              "held = Held()\n"
              "atexit.register(lambda: open('handler', 'w').close())\n"
              "sys.stdout.write('buffered, no newline')\n")
    for ending, teardown in (("exit_now(3)", False), ("sys.exit(3)", True)):
        where = tmp_path / ending[:-3]
        where.mkdir()
        (where / "rank.py").write_text(script + ending + "\n")
        proc = subprocess.run([sys.executable, "rank.py"], cwd=where, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 3, proc.stderr
        assert proc.stdout == "buffered, no newline"
        assert (where / "handler").exists()
        assert (where / "teardown").exists() == teardown, ending


def test_the_module_run_as_a_script_ends_through_exit_now(tmp_path, no_torchrun_env):
    """``python -m hybridgemm.perf.bench_tp`` returns main's status through exit_now: without a
    torchrun environment it says how to launch and exits 2, and no teardown runs."""
    (tmp_path / "run.py").write_text(
        "import os, runpy, sys\n"
        "class Held:\n"
        "    def __del__(self, mark=os.path.abspath('teardown'), open=open):\n"
        "        open(mark, 'w').close()\n"
        "held = Held()\n"
        "sys.argv = ['bench_tp', '--model', 'tiny', '--device', 'cpu']\n"
        "runpy.run_module('hybridgemm.perf.bench_tp', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "torchrun" in proc.stderr, proc.stderr
    assert not (tmp_path / "teardown").exists()


# ----------------------------------------------------------------------------- command-line errors


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for k in TORCH_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def launched(monkeypatch, world: int, rank: int = 0) -> None:
    for k, v in zip(TORCH_ENV, (rank, world, rank, "127.0.0.1", "29999")):
        monkeypatch.setenv(k, str(v))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_without_torchrun_says_how_to_launch(no_torchrun_env, capsys):
    assert T.main(["--model", "tiny", "--device", "cpu"]) == 2
    err = one_line_error(capsys)
    assert "no torch.distributed environment (RANK, WORLD_SIZE" in err
    assert "launch with torchrun, e.g. `torchrun --nproc-per-node 2 -m hybridgemm.perf.bench_tp" in err


@pytest.mark.parametrize("world, argv, words", [
    (3, [], "world size 3, but the variants asked (tp1_hybridgemm, tp2_hybridgemm, tp2_hybridgemm_push, "
            "tp2_hybridgemm_nccl, tp2_stock) need 2 ranks: launch with torchrun --nproc-per-node 2"),
    (1, [], "world size 1, but the variants asked"),
    (2, ["--variants", "tp1_hybridgemm"], "world size 2, but the variants asked (tp1_hybridgemm) need 1 rank: "
                                          "launch with torchrun --nproc-per-node 1"),
    (2, ["--backend", "nccl"], "--backend nccl needs --device cuda"),
    (2, ["--one-gpu"], "--one-gpu needs --device cuda and --backend gloo"),
])
def test_world_size_and_backend_errors(no_torchrun_env, capsys, world, argv, words):
    launched(no_torchrun_env, world)
    assert T.main(["--model", "tiny", "--device", "cpu", *argv]) == 2
    assert words in one_line_error(capsys)


@pytest.mark.parametrize("argv, words", [
    (["--backend", "nccl"], "--one-gpu needs --device cuda and --backend gloo"),
    ([], "--one-gpu runs the error modes only (logits_error, decode_error); asked: compiled_static, prefill"),
    (["--modes", "decode_error", "eager_static"], "asked: eager_static"),
])
def test_one_gpu_takes_gloo_and_error_modes_only(no_torchrun_env, capsys, argv, words):
    launched(no_torchrun_env, 2, rank=1)
    no_torchrun_env.setattr(torch.cuda, "device_count", lambda: 1)
    assert T.main(["--model", "tiny", "--device", "cuda", "--one-gpu", *argv]) == 2
    assert words in one_line_error(capsys)


def test_one_gpu_puts_every_rank_on_gpu_0(no_torchrun_env):
    launched(no_torchrun_env, 2, rank=1)
    no_torchrun_env.setattr(torch.cuda, "device_count", lambda: 1)
    args = T.parse_args(["--model", "tiny", "--device", "cuda", "--one-gpu", "--modes", "decode_error"])
    assert T.check_launch(args) == (1, 2, 0) and args.backend == "gloo"
    args.layers, args.batch, args.prefill, args.tokens, args.modes, args.rounds = 2, (2,), 16, 2, ("decode_error",), 1
    assert T.command_line(args, 2).endswith("--backend gloo --device cuda --one-gpu")


def test_cuda_device_needs_a_gpu_per_rank(no_torchrun_env, capsys):
    launched(no_torchrun_env, 2, rank=1)
    no_torchrun_env.setattr(torch.cuda, "device_count", lambda: 1)
    assert T.main(["--model", "tiny", "--device", "cuda"]) == 2
    assert "local rank 1 needs GPU 1, and this machine has 1" in one_line_error(capsys)


def test_launch_defaults(no_torchrun_env):
    launched(no_torchrun_env, 1)
    args = T.parse_args(["--model", "TINY", "--variants", "tp1_hybridgemm", "--device", "cpu"])
    assert T.check_launch(args) == (0, 1, 0)
    assert (args.model, args.variants, args.backend, args.modes) == ("tiny", ("tp1_hybridgemm",), "gloo", None)


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt-9"], "unknown model 'gpt-9'; known: qwen2.5-7b, llama3-8b, llama3-70b, qwen3-8b, granite-8b, "
                           "gemma2-9b, gemma-7b, gemma3-4b, olmo2-7b, olmo3-7b, ministral-8b, smollm3-3b, "
                           "ministral3-8b, ernie4.5-0.3b, stablelm-2-1.6b, stablelm-3b, aya-23-8b, tiny"),
    (["--model", "tiny", "--variants", "tp8_magic"], "--variants: invalid choice"),
    (["--model", "tiny", "--backend", "mpi"], "--backend: invalid choice"),
    (["--model", "tiny", "--layers", "0"], "--layers: must be positive"),
    ([], "--model"),
])
def test_bad_arguments_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        T.parse_args(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


# ----------------------------------------------------------------------------- models, sizes


def test_llama3_70b_is_known_and_does_not_fit_one_h200_at_full_depth(monkeypatch):
    config = M.model_config("llama3-70b")
    sizes = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                 vocab_size=128256, num_hidden_layers=80)
    assert {k: getattr(config, k) for k in sizes} == sizes
    run = E.Run("llama3-70b", config, torch.device("cpu"))
    nbytes = M.full_bytes(run, torch.bfloat16)
    assert nbytes == pytest.approx(141.1e9, rel=1e-3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (150.0e9, 150.1e9))  # an idle H200
    assert M.fits(nbytes, "cuda", T.TP1_MAX_FRACTION) == "141.1 GB, above 85% of the GPU's total 150.1 GB"
    assert "of the GPU's free 150.0 GB" in M.fits(2 * nbytes, "cuda", T.REF_MAX_FRACTION, free=True)
    cut = M.full_bytes(E.Run("llama3-70b", M.model_config("llama3-70b", 8), torch.device("cpu")), torch.bfloat16)
    assert M.fits(cut, "cuda", T.TP1_MAX_FRACTION) is None
    assert M.fits(nbytes, "cpu", T.TP1_MAX_FRACTION) is None  # the CPU is not checked


@pytest.fixture
def fake_ranks():
    """This process as rank 0 of 2 in a process group whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield T.Ranks(0, 2, dist.group.WORLD, dist.group.WORLD)
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama3-70b", "qwen2.5-7b"])
def test_both_plans_shard_the_real_models_alike_on_the_meta_device(fake_ranks, name):
    """The 80-layer 70B (and Qwen2.5's q/k/v biases) sharded both ways without memory: each GPU
    holds the same bytes under hybridgemm.parallelize and torch's plan, half of the model but the
    input embedding and norms, which both keep whole."""
    import hybridgemm

    run = E.Run(name, M.model_config(name), torch.device("cpu"))
    held = {}
    for variant in ("tp2_hybridgemm", "tp2_stock"):
        model, _, norms = M.meta_model(run, torch.bfloat16)
        if variant == "tp2_hybridgemm":
            assert not hybridgemm.parallelize(model, fake_ranks.group, patch=False).skipped
        else:
            assert M.shard_stock(model, fake_ranks.mesh("cpu"), 2) == []
        held[variant] = M.gpu_weight_bytes(model)
    whole, _, norms = M.meta_model(run, torch.bfloat16)
    read = sum(p.numel() for n, p in whole.named_parameters() if "embed_tokens" not in n)
    kept = sum(p.numel() for n, p in whole.named_parameters() if n in norms)
    assert held["tp2_hybridgemm"] == held["tp2_stock"] == 2 * ((read - kept) // 2 + kept)


def test_stock_plan_refuses_heads_that_do_not_split(fake_ranks):
    run = E.Run("tiny", M.model_config("tiny"), torch.device("cpu"))
    model, _, _ = M.meta_model(run, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="tp=4 to divide the 4 query and 2 key/value heads"):
        M.shard_stock(model, fake_ranks.mesh("cpu"), 4)


def test_weights_depend_on_the_name_only():
    config = M.model_config("tiny")
    a = M.weight_value("model.layers.0.mlp.up_proj.weight", (128, 64), config, "cpu", torch.bfloat16, torch.bfloat16,
                       False)
    again = M.weight_value("model.layers.0.mlp.up_proj.weight", (128, 64), config, "cpu", torch.float32,
                           torch.bfloat16, False)
    other = M.weight_value("model.layers.1.mlp.up_proj.weight", (128, 64), config, "cpu", torch.bfloat16,
                           torch.bfloat16, False)
    norm = M.weight_value("model.norm.weight", (64,), config, "cpu", torch.bfloat16, torch.bfloat16, True)
    assert again.dtype == torch.float32 and torch.equal(again, a.float())  # the fp32 copy holds the bf16 values
    assert not torch.equal(a, other) and 0.015 < a.float().std().item() < 0.025
    assert (norm.float() - 1).abs().max().item() < 0.2
    assert M._layer_chunks(["model.embed_tokens.weight", "model.layers.0.a.weight", "model.layers.0.b.bias",
                            "model.layers.11.a.weight", "lm_head.weight"]) == {
        "": ["model.embed_tokens.weight", "lm_head.weight"], "model.layers.0": ["model.layers.0.a.weight",
                                                                                "model.layers.0.b.bias"],
        "model.layers.11": ["model.layers.11.a.weight"]}


# ----------------------------------------------------------------------------- the figure


def synthetic_csv(path) -> None:
    rows = []
    for model, tp1_status in (("llama3-8b", "ok"), ("llama3-70b", "skipped")):
        for mode, batch, base in (("compiled_static", 1, 4.0), ("compiled_static", 8, 4.4), ("prefill", 1, 90.0)):
            for variant, scale in (("tp1_hybridgemm", 1.0), ("tp2_hybridgemm", 0.55), ("tp2_stock", 0.6)):
                status = tp1_status if variant == "tp1_hybridgemm" else "ok"
                if model == "llama3-8b" and variant == "tp2_stock" and batch == 8:
                    status = "error"
                ms = base * scale if status == "ok" else ""
                rows.append(dict(gpu="NVIDIA H200", model=model, layers=8, mode=mode, batch=batch, variant=variant,
                                 tp=T.VARIANTS[variant], status=status, ms_per_token=ms,
                                 speedup_vs_tp1=1 / scale if status == "ok" and tp1_status == "ok" else "",
                                 hbm_floor_ms_per_gpu=1.0 / T.VARIANTS[variant], tokens=2048, torch="2.13"))
        rows.append(dict(gpu="NVIDIA H200", model=model, layers=8, mode="logits_error", batch=2,
                         variant="tp2_stock", tp=2, status="ok", logits_rel_err=0.01))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=T.COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_plot_tp_from_a_synthetic_csv(tmp_path):
    from hybridgemm.perf.plots_models import plot_tp

    path = tmp_path / "tp.csv"
    synthetic_csv(path)
    png = plot_tp(path, tmp_path / "figs")
    assert png == tmp_path / "figs" / "tp.png" and png.read_bytes()[:8] == PNG_MAGIC
    assert plot_tp(path, tmp_path, name="other.png").name == "other.png"
    with pytest.raises(FileNotFoundError, match="no such CSV file"):
        plot_tp(tmp_path / "missing.csv", tmp_path)
    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(T.COLUMNS) + "\n")
    with pytest.raises(ValueError, match="no rows with a time"):
        plot_tp(empty, tmp_path)


# ----------------------------------------------------------------------------- perf/tp_compute.py


def test_rank0_shard_leaves_the_collectives_out(fake_ranks):
    """tp_compute's model: rank 0's shard (the bytes counted by hand), its row-parallel layers
    returning their partial products unsummed (rank 0's O: its columns' product plus the bias)
    and its head its own slice of the logits."""
    from hybridgemm.parallel import RowParallelLinear, VocabParallelLinear
    from hybridgemm.perf import tp_compute as C

    run = E.Run("tiny", M.model_config("tiny"), torch.device("cpu"), dtype=torch.float32)
    built = C.rank0_shard(run, fake_ranks)
    model = built.model
    assert built.weight_bytes == 2 * tiny_weight_bytes(2)  # fp32 here: twice the bf16 count
    o_proj, head = model.model.layers[0].self_attn.o_proj, model.lm_head
    assert type(o_proj) is C._UnsummedRowParallel and isinstance(o_proj, RowParallelLinear)
    assert type(head) is C._LocalVocabSlice and isinstance(head, VocabParallelLinear)
    assert type(model.model.layers[1].mlp.down_proj) is C._UnsummedRowParallel
    x = torch.randn(3, o_proj.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(o_proj(x), x @ o_proj.weight.T + o_proj.bias)  # rank 0 adds the bias
        logits = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False).logits
    assert logits.shape == (1, 3, head.rows) and torch.isfinite(logits).all()


@pytest.mark.parametrize("argv", [["--model", "tiny", "--tp", "1"], ["--model", "tiny", "--batch", "0"],
                                  ["--model", "nope"], ["--model", "tiny", "--rounds", "0"]])
def test_tp_compute_bad_arguments_exit_2(argv, capsys):
    from hybridgemm.perf import tp_compute as C

    with pytest.raises(SystemExit) as info:
        C.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_tp_compute_needs_a_gpu(monkeypatch, capsys):
    from hybridgemm.perf import tp_compute as C

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert C.main(["--model", "tiny"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tp_compute_records_skips_and_build_errors_as_rows(fake_ranks, monkeypatch):
    """A model too big for one GPU skips tp1 with a note; a shard that cannot be built is an
    error row at every batch, not a traceback."""
    from hybridgemm.perf import tp_compute as C

    run = E.Run("tiny", M.model_config("tiny"), torch.device("cpu"), batches=(1, 8))
    monkeypatch.setattr(C, "fits", lambda *a: "141.1 GB, above 85% of the GPU's total 150.1 GB")
    rows = C.run_variant(run, "tp1_hybridgemm", 1, fake_ranks)
    assert [(r["batch"], r["status"]) for r in rows] == [(1, "skipped"), (8, "skipped")]
    assert all("do not fit one GPU: 141.1 GB" in r["note"] for r in rows)

    def broken(*a):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(C, "rank0_shard", broken)
    rows = C.run_variant(run, "tp2_rank0_compute", 2, fake_ranks)
    assert [(r["batch"], r["status"], r["note"]) for r in rows] == \
        [(1, "error", "RuntimeError: CUDA out of memory"), (8, "error", "RuntimeError: CUDA out of memory")]
