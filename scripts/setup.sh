#!/usr/bin/env bash
# Create .venv with everything hybridgemm needs (idempotent; re-runs when pyproject.toml changes).
#   - no NVIDIA GPU: CPU torch 2.13.0, triton 3.6.0 and numpy < 2.3 (CPU tests run the Triton
#     kernels under TRITON_INTERPRET=1; triton 3.6 and numpy 2.2 are the oldest supported, and
#     Triton 3.6's interpreter fails on numpy >= 2.4), transformers pinned to the newest release
#     tested (a new release changes the model classes the tests patch).
#     scripts/ci-stacks.sh tests the range's ends.
#   - NVIDIA GPU: torch (CUDA build) and nvmath-python's cu13 extra; a python3 that already has
#     torch is reused through --system-site-packages
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRANSFORMERS=5.25.0  # the newest stack of scripts/ci-stacks.sh
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [ ! -x .venv/bin/python ]; then
  if has_gpu && $PY -c "import torch, triton" 2>/dev/null; then
    $PY -m venv --system-site-packages .venv
  else
    $PY -m venv .venv
  fi
fi
V=.venv/bin/python
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "setup: installing into .venv (once)" >&2
$V -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if has_gpu; then
  $V -c "import torch" 2>/dev/null || $V -m pip install -q torch
  $V -m pip install -q -e ".[test,cu13]"
else
  $V -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3"
  $V -m pip install -q -e ".[test,nvmath]" "transformers==$TRANSFORMERS"
fi
rm -f .venv/.setup-*
touch "$stamp"
