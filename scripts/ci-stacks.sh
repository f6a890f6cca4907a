#!/usr/bin/env bash
# The CPU suite (Triton interpreter, no GPU) on the ends of the range pyproject.toml declares:
#   oldest: torch 2.10.0, triton 3.6.0, numpy 2.2.6, transformers 5.8.1
#   newest: torch 2.15.0, triton 3.9.0, numpy 2.4.6, transformers 5.25.0
# (the model tests, tests/models, assert per family that the fused decode step is taken and
# matches stock: on both transformers releases)
# Each stack gets its own venv, .venv/stacks/NAME (git-ignored with .venv/), installed once and
# re-checked when pyproject.toml or this file changes. PyPI has no CPU build of these torch
# releases, so their CUDA builds are installed (~6-7 GB each) and run on the CPU. Installs bypass
# pip's wheel cache, which would hold another ~3 GB per stack.
#   bash scripts/ci-stacks.sh [--discard] [oldest] [newest] [-- PYTEST_ARGS]   (no names: both)
#   --discard: delete each stack's venv once its tests have run, so that at most one stack is on
#              disk at a time (CI machines have a few GB to spare, not 14)
# Each stack's tests run in parallel (pytest-xdist, from the test extra): HYBRIDGEMM_TEST_JOBS
# workers, by default one per core.
# Runs every stack asked for, then exits non-zero if any stack failed to install or to pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

names=()
discard=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    --discard) discard=1 ;;
    *) names+=("$1") ;;
  esac
  shift
done
[ ${#names[@]} -gt 0 ] || names=(oldest newest)

pins() {
  case "$1" in
    oldest) echo "torch==2.10.0 triton==3.6.0 numpy==2.2.6 transformers==5.8.1" ;;
    newest) echo "torch==2.15.0 triton==3.9.0 numpy==2.4.6 transformers==5.25.0" ;;
    *) return 1 ;;
  esac
}

free_disk() { df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' '; }

install() {  # install() NAME VENV: the pinned stack plus .[test,nvmath], once per stamp
  local name=$1 venv=$2 stamp
  stamp="$venv/.stack-$(cat pyproject.toml scripts/ci-stacks.sh | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" || return 1
  echo "ci-stacks: installing $name into $venv ($(free_disk) free)" >&2
  export PIP_NO_CACHE_DIR=1
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # The pins are the stack: a machine-wide pip constraint file must not cap them (PIP_CONSTRAINT).
  # setuptools>=77 is the build requirement tests/test_packaging.py builds the wheel with.
  # shellcheck disable=SC2046
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q $(pins "$name") "setuptools>=77" \
    -e ".[test,nvmath]" || return 1
  rm -f "$venv"/.stack-*
  touch "$stamp"
}

failed=()
for name in "${names[@]}"; do
  if ! pins "$name" >/dev/null; then
    echo "ci-stacks: unknown stack '$name' (oldest, newest)" >&2
    failed+=("$name"); continue
  fi
  venv=".venv/stacks/$name"
  if ! install "$name" "$venv"; then
    echo "ci-stacks: $name: install failed ($(free_disk) free on disk)" >&2
    failed+=("$name")
    [ $discard = 1 ] && rm -rf "$venv"
    continue
  fi
  echo "== stack $name: $("$venv/bin/python" -c 'import numpy, torch, transformers, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}, "
      f"transformers {transformers.__version__}")')"
  # No GPU is used even where one exists: the gpu tests skip, kernels run in the interpreter.
  CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -n "${HYBRIDGEMM_TEST_JOBS:-auto}" "$@"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "ci-stacks: $name: pytest exited $rc" >&2
    failed+=("$name")
  fi
  [ $discard = 1 ] && rm -rf "$venv"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "ci-stacks: FAILED: ${failed[*]}" >&2
  exit 1
fi
