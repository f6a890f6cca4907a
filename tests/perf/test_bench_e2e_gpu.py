"""The end-to-end benchmark on the GPU (perf/bench_e2e.py): Llama-3-8B sizes cut to 2 layers,
every mode for stock and patched, one process, as ``hybridgemm bench --e2e`` runs it."""

from __future__ import annotations

import math

import pytest

from hybridgemm.perf import bench_e2e as E
from hybridgemm.perf.csvio import read_rows

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


EAGER_MODES = [m for m in E.MODES if m != "compiled_static"]


def _run(tmp_path, modes, *more):
    out = tmp_path / "e2e.csv"
    rc = E.main(["--model", "llama3-8b", "--layers", "2", "--tokens", "4", "--batch", "1", "--prefill", "64",
                 "--modes", *modes, "--out", str(out), "--plot", str(tmp_path), "--no-progress", *more])
    return rc, {(r["mode"], r["variant"]): r for r in read_rows(str(out))}


def test_two_layer_llama_every_eager_mode_both_variants(tmp_path):
    rc, by = _run(tmp_path, EAGER_MODES)
    assert set(by) == {(m, v) for m in EAGER_MODES for v in E.VARIANTS}, sorted(by)
    bad = {k: r["note"] for k, r in by.items() if r["status"] != "ok"}
    assert not bad and rc == 0, bad
    for (mode, variant), r in by.items():
        assert (r["model"], r["layers"], r["batch"]) == ("llama3-8b", "2", "2" if mode in E.ERROR_MODES else "1")
        if mode in E.ERROR_MODES:
            err = float(r["logits_rel_err"])
            assert math.isfinite(err) and 0 < err < 0.2, (variant, err)
            continue
        cols = ["ms_per_token", "tokens_per_s", "speedup"]
        cols += ["hbm_floor_ms", "fraction_of_floor"] if mode in E.DECODE_MODES else []
        for col in cols:
            value = float(r[col])
            assert math.isfinite(value) and value > 0, (mode, variant, col, r[col])
    assert (tmp_path / "e2e.png").is_file()


def test_two_layer_llama_compiled_reduce_overhead_both_variants(tmp_path):
    # CUDA graph trees refuse a recording that leaves a tensor of their pool alive; the process-wide
    # cuBLASLt workspaces and split-K scratch must be allocated outside it (kernels/process_memory.py).
    rc, by = _run(tmp_path, ["compiled_static"])
    assert by[("compiled_static", "stock")]["status"] == "ok"
    assert by[("compiled_static", "hybridgemm")]["status"] == "ok", by[("compiled_static", "hybridgemm")]["note"]
    assert rc == 0


@pytest.mark.parametrize("granularity", ["channel", "block128"])
def test_two_layer_llama_fp8_weights(tmp_path, granularity):
    """An FP8 run without peers: every mode ok for both variants, the FP8 model one byte per
    projection weight lighter (less the scales; the LM head stays bf16), and its logits no further
    from the fp32 model of the dequantized weights than twice what dequantize -> bf16 F.linear gets."""
    hyb = f"hybridgemm_e4m3_{granularity}"
    modes = ["eager_static", "compiled_static", "logits_error", "decode_error"]
    rc, by = _run(tmp_path, modes, "--weights", "fp8", "--granularity", granularity, "--no-peers")
    bad = {k: r["note"] for k, r in by.items() if r["status"] != "ok"}
    assert not bad and rc == 0, bad
    for mode in ("eager_static", "compiled_static"):
        r = by[(mode, hyb)]
        assert r["weights"] == f"e4m3_{granularity}"
        projection_weights = 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)  # two Llama-3-8B layers
        saved = int(r["weight_bytes"]) - int(r["variant_bytes"])
        assert 0.99 * projection_weights < saved < projection_weights, (saved, projection_weights)
        assert float(r["fraction_of_variant_floor"]) == pytest.approx(
            float(r["fraction_of_floor"]) * int(r["variant_bytes"]) / int(r["weight_bytes"]), rel=1e-6)
    for mode in E.ERROR_MODES:
        r, deq = by[(mode, hyb)], by[(mode, E.DEQUANT)]
        assert 0 < float(r["logits_rel_err"]) < float(r["logits_rel_err_vs_bf16"]), r
        assert float(r["error_ratio"]) == pytest.approx(float(r["logits_rel_err"]) / float(deq["logits_rel_err"]))
        assert float(r["error_ratio"]) < 2.0, (mode, r["error_ratio"])
