#!/usr/bin/env bash
# A/B of a change against the commit the checkout's git HEAD names (or AB_BASE, any revision git
# resolves there), in one process tree and on one machine: run COMMAND with PATHS as at that
# commit ("base"), then as in the working tree ("tree"). The device machine's copy of .git can
# name an older HEAD than the tree it runs (its CSVs' commit column shows which): give AB_BASE as
# a commit hash there, not relative to HEAD.
#
#   [AB_BASE=REV | AB_BASE_DIR=DIR] bash scripts/ab_base.sh NAME "COMMAND" PATH [PATH ...]
#
# AB_BASE_DIR: the base's files are DIR/PATH (copies written where the commit is known, e.g.
# `git show REV:PATH > DIR/PATH`, carried with the tree) rather than read from git.
#
# PATHs are files, relative to the repository root. COMMAND runs under bash in the repository
# root with $AB_SIDE (base or tree) set; its output goes to $OUT/ab_NAME_<side>.txt after a
# header line naming the side and commit, the last lines to the terminal. The tree's files are
# restored afterwards, whatever the command's status (a kill -9 cannot be caught: the copies
# are then in the folder the first line prints). The package must be installed editable (the
# gpu-check install stage does), so the swapped files are what the command imports. Do not
# edit the PATHs while it runs: the restore writes the copies taken at the start.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: bash scripts/ab_base.sh NAME \"COMMAND\" PATH [PATH ...]" >&2; exit 2; }
name=$1; cmd=$2; shift 2
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
dir=${AB_BASE_DIR:-}
if [ -n "$dir" ]; then
  base="files of $dir"
  for p in "$@"; do
    [ -f "$dir/$p" ] && [ -f "$p" ] || { echo "ab_base: $p is not a file both in $dir and in the tree" >&2; exit 2; }
  done
else
  rev=${AB_BASE:-HEAD}
  base=$(git rev-parse --short "$rev^{commit}" 2>/dev/null) || { echo "ab_base: no commit $rev here" >&2; exit 2; }
  for p in "$@"; do
    [ "$(git cat-file -t "$base:$p" 2>/dev/null)" = blob ] && [ -f "$p" ] \
      || { echo "ab_base: $p is not a file both in $rev ($base) and in the tree" >&2; exit 2; }
  done
fi
keep=$(mktemp -d)
echo "ab_base: the tree's files are kept in $keep until the end"
for p in "$@"; do mkdir -p "$keep/$(dirname "$p")" && cp -p "$p" "$keep/$p" || exit 2; done
restore() { for p in "$@"; do cp -p "$keep/$p" "$p"; done && rm -rf "$keep"; }
trap 'restore "$@"' EXIT
status=0
for side in base tree; do
  if [ "$side" = base ]; then
    for p in "$@"; do
      if [ -n "$dir" ]; then cp "$dir/$p" "$p"; else git show "$base:$p" >"$p"; fi \
        || { echo "ab_base: could not write $p as at $base" >&2; exit 2; }
    done
  else
    for p in "$@"; do cp -p "$keep/$p" "$p"; done
  fi
  header="== ab $name $side ($base$([ "$side" = tree ] && echo ' + tree')): $cmd"
  echo "$header"; echo "$header" >"$OUT/ab_${name}_$side.txt"
  AB_SIDE=$side bash -c "$cmd" >>"$OUT/ab_${name}_$side.txt" 2>&1 || status=1
  tail -n 8 "$OUT/ab_${name}_$side.txt"
done
exit $status
