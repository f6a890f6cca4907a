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
    *)
      log "$stage"
      bash -c "$stage" 2>&1 | tee -a "$OUT/summary.txt"; rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || status=$rc
      ;;
  esac
done
log "done, status $status"
exit $status
