#!/usr/bin/env bash
# A/B of a change against the commit the checkout's git HEAD names, in one process tree and on one
# machine: run COMMAND with PATHS as at HEAD ("base"), then as in the working tree ("tree").
#
#   bash scripts/ab_base.sh NAME "COMMAND" PATH [PATH ...]
#
# COMMAND runs under bash with $AB_SIDE (base or tree) set; its output goes to
# $OUT/ab_NAME_<side>.txt, the last lines to the terminal. The tree's files are restored
# afterwards, whatever the command's status. The package must be installed editable (the
# gpu-check install stage does), so the swapped files are what the command imports.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: bash scripts/ab_base.sh NAME \"COMMAND\" PATH [PATH ...]" >&2; exit 2; }
name=$1; cmd=$2; shift 2
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
keep=$(mktemp -d)
for p in "$@"; do
  git cat-file -e "HEAD:$p" 2>/dev/null || { echo "ab_base: $p is not in HEAD ($(git rev-parse --short HEAD))" >&2; exit 2; }
  mkdir -p "$keep/$(dirname "$p")" && cp -p "$p" "$keep/$p" || exit 2
done
restore() { for p in "$@"; do cp -p "$keep/$p" "$p"; done; }
trap 'restore "$@"' EXIT
status=0
for side in base tree; do
  if [ "$side" = base ]; then for p in "$@"; do git show "HEAD:$p" >"$p"; done; else restore "$@"; fi
  echo "== ab $name $side ($(git rev-parse --short HEAD)$([ "$side" = tree ] && echo ' + tree')): $cmd"
  AB_SIDE=$side bash -c "$cmd" >"$OUT/ab_${name}_$side.txt" 2>&1 || status=1
  tail -n 8 "$OUT/ab_${name}_$side.txt"
done
exit $status
