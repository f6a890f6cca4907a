#!/usr/bin/env bash
# Everything the GPU machine runs, in one go: offline install, GPU tests, benchmarks.
#
#   bash scripts/gpu-check.sh [STAGE ...]      (default: install tests bench)
#
# Stages: install   pip-install the carried wheels (.whl/) and this package, offline
#         tests     pytest -m gpu (all GPU tests)
#         alltests  the whole suite on the GPU (CPU tests too, Triton compiled for real)
#         bench     the backend benchmarks (cuBLASLt, Triton)
#         quick     the backend benchmarks, small subset
#         tune      autotune llama3-8b (all M buckets) + qwen2.5-7b (decode/prefill/train M) into
#                   $OUT/h200.json, then again with --force into $OUT/h200_rerun.json, and compare
#         dispatch  dispatched calls vs the table's winners vs F.linear ($OUT/h200.json)
#         attention the Qwen2.5-7B attention projection path (uses $OUT/h200.json)
#         harness   hybridgemm bench (all providers, training) + plots into $OUT/plots
#         pack      tar every CSV, PNG and table under $OUT into $OUT/results.tar.gz
#         <other>   run as a shell command (e.g. "python3 -m hybridgemm ...")
# Results and logs go to $OUT (the device tool's output folder) or ./out.
# Before calling: ../shared/device/fetch-wheels.sh (nvmath-python, platformdirs into .whl/),
# and name .whl in the device call's carry list.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PY:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install tests bench)
status=0
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

for stage in "${stages[@]}"; do
  case "$stage" in
    install)
      log "install"
      if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || { log "wheel install failed"; exit 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 \
        || { cat "$OUT/install.txt"; log "package install failed"; exit 1; }
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
        | tee -a "$OUT/summary.txt"
      $PY -c "import torch, triton, hybridgemm; from hybridgemm.kernels import cublaslt as c;
print('torch', torch.__version__, 'triton', triton.__version__, 'cublaslt', c.cublaslt_version(),
      'gpu', torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/summary.txt"
      ;;
    tests)
      log "pytest -m gpu"
      $PY -m pytest -m gpu -q -rfE tests >"$OUT/pytest_gpu.txt" 2>&1; rc=$?
      tail -n 25 "$OUT/pytest_gpu.txt" | tee -a "$OUT/summary.txt"; [ $rc -eq 0 ] || status=$rc
      ;;
    alltests)
      log "pytest (all)"
      $PY -m pytest -q -rfE tests >"$OUT/pytest_all.txt" 2>&1; rc=$?
      tail -n 25 "$OUT/pytest_all.txt" | tee -a "$OUT/summary.txt"; [ $rc -eq 0 ] || status=$rc
      ;;
    bench|quick)
      q=(); [ "$stage" = quick ] && q=(--quick)
      for mod in bench_cublaslt bench_triton; do
        [ -f "perf/$mod.py" ] || continue
        log "$mod ${q[*]}"
        $PY -m "hybridgemm.perf.$mod" --out "$OUT" "${q[@]}" >"$OUT/$mod.txt" 2>&1; rc=$?
        tail -n 45 "$OUT/$mod.txt" | tee -a "$OUT/summary.txt"; [ $rc -eq 0 ] || status=$rc
      done
      ;;
    tune)
      log "autotune (twice)"
      for t in h200 h200_rerun; do
        f=(); [ $t = h200_rerun ] && f=(--force)
        /usr/bin/time -f "autotune llama3-8b wall %e s" $PY -m hybridgemm autotune --model llama3-8b \
          --out "$OUT/$t.json" --no-progress "${f[@]}" >"$OUT/autotune_$t.txt" 2>&1 || status=1
        $PY -m hybridgemm autotune --model qwen2.5-7b --m 1 8 2048 4096 16384 --out "$OUT/$t.json" \
          --no-progress "${f[@]}" >>"$OUT/autotune_$t.txt" 2>&1 || status=1
        grep -E "wall|tuned " "$OUT/autotune_$t.txt" | tee -a "$OUT/summary.txt"
      done
      $PY -m hybridgemm.perf.bench_dispatch --compare "$OUT/h200.json" "$OUT/h200_rerun.json" 2>&1 \
        | tee "$OUT/tune_compare.txt" | tail -n 20 | tee -a "$OUT/summary.txt"
      ;;
    dispatch)
      log "bench_dispatch"
      $PY -m hybridgemm.perf.bench_dispatch --table "${TABLE:-$OUT/h200.json}" --out "$OUT" >"$OUT/bench_dispatch.txt" 2>&1 \
        || status=1
      tail -n 4 "$OUT/bench_dispatch.txt" | tee -a "$OUT/summary.txt"
      ;;
    attention)
      log "bench_attention"
      HYBRIDGEMM_TABLE="${TABLE:-$OUT/h200.json}" $PY -m hybridgemm.perf.bench_attention --out "$OUT" \
        >"$OUT/bench_attention.txt" 2>&1 || status=1
      tail -n 25 "$OUT/bench_attention.txt" | tee -a "$OUT/summary.txt"
      ;;
    harness)
      log "hybridgemm bench"
      HYBRIDGEMM_TABLE="${TABLE:-$OUT/h200.json}" $PY -m hybridgemm bench --model llama3-8b --training --no-progress \
        --out "$OUT/bench_h200.csv" --plot "$OUT/plots" >"$OUT/bench_harness.txt" 2>&1 || status=1
      tail -n 40 "$OUT/bench_harness.txt" | tee -a "$OUT/summary.txt"
      ;;
    pack)
      log "pack"
      (cd "$OUT" && tar czf results.tar.gz --exclude results.tar.gz --exclude summary.txt \
        $(ls | grep -vE '^(results.tar.gz|summary.txt)$') && ls | grep -vE '^(results.tar.gz|summary.txt)$' \
        | xargs rm -rf)
      ;;
    *)
      log "$stage"
      bash -c "$stage" 2>&1 | tee -a "$OUT/summary.txt"; rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || status=$rc
      ;;
  esac
done
log "done, status $status"
exit $status
