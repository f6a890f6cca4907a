#!/usr/bin/env bash
# The main job: set up .venv if needed, then `hybridgemm main` (see README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m hybridgemm main "$@"
