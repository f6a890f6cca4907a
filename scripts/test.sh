#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, run every test this machine can run.
# Without a GPU the `gpu` tests skip and Triton kernels run in the CPU interpreter.
# Tests run in parallel (pytest-xdist): HYBRIDGEMM_TEST_JOBS workers, by default one per core;
# arguments are passed on to pytest (a later -n wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  export TRITON_INTERPRET=1
fi
exec .venv/bin/python -m pytest -q -n "${HYBRIDGEMM_TEST_JOBS:-auto}" "$@"
