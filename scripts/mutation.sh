#!/usr/bin/env bash
# Mutation testing (mutmut 3.8.1) of the code that decides what a call runs and what a table
# may hold, against the CPU test suite:
#   autotune_cache/keys.py, the tuning table (autotune_cache/table.py and the table_entries,
#   table_document and table_locations modules beside it), kernels/checks.py and the
#   dispatcher's rules, fusion/decide.py.
# Each mutant runs only the tests (of TEST_FILES below) that call the mutated function, with
# TRITON_INTERPRET=1; a test failing kills it. Results are written to
# .mutation/summary.txt (killed/total and score per file, then every survivor).
#
# Usage: bash scripts/mutation.sh [keys|table|checks|rules ...]   (default: all four)
# Expected runtime on 2 CPU cores: 15-20 min for all four (most of it the table); the
# measured numbers and every surviving mutant are in tests/RELIABILITY.md, "Mutation testing".
#
# Why a staging tree: the package is installed from fusion/, kernels/, autotune_cache/ and
# perf/ through setuptools' package-dir mapping, so `hybridgemm.autotune_cache.table` lives in
# autotune_cache/table.py. mutmut names a mutant after its file's path and matches that name
# against the module the tests import, so it needs a tree where the path is the module:
# .mutation/src/hybridgemm/... (copies; mutmut works in .mutation/mutants/ and puts it first on
# sys.path, ahead of the editable install). Nothing in the working tree is modified.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGE=$ROOT/.mutation
MUTMUT=$ROOT/.venv/bin/mutmut
[ -x "$MUTMUT" ] || { echo "mutation.sh: installing mutmut into .venv" >&2; .venv/bin/pip install -q "mutmut==3.8.1"; }

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(keys table checks rules)

# The CPU tests that exercise these files (GPU tests are skipped without a GPU anyway).
TEST_FILES=(tests/autotune_cache/test_keys.py tests/autotune_cache/test_table.py
            tests/autotune_cache/test_table_exact.py tests/autotune_cache/test_table_faults.py
            tests/autotune_cache/test_table_hostile.py tests/kernels/test_checks.py tests/fusion/test_decide.py
            tests/fusion/test_bad_input.py tests/autotune_cache/test_tuner_cpu.py tests/cli/test_cli_dispatch.py
            tests/cli/test_cli_strict.py tests/cli/test_cli_device.py tests/fusion/test_batch_invariant.py
            tests/autotune_cache/test_presets.py tests/autotune_cache/test_upgrade.py
            tests/autotune_cache/test_upgrade_decisions.py)
# Left out: stress tests (seconds each: concurrent writer processes, a 16 MiB table, 16 384
# entries, the last with a 2 s limit that mutmut's per-call overhead exceeds), each of which
# would run for every mutant of the save/parse path; `python -m hybridgemm --help` (a
# subprocess that reaches none of these files); and the check that the table modules' source
# imports no pickle and calls no eval (which no mutant changes). Every mutant these could kill
# must then be killed by a faster test, so the score is a lower bound.
DESELECT=(tests/autotune_cache/test_table.py::test_concurrent_writers_lose_no_entries
          tests/autotune_cache/test_table_faults.py::test_readers_during_eight_concurrent_tuners_see_whole_tables
          "tests/autotune_cache/test_table_hostile.py::test_hostile_table[valid-table-just-under-the-cap]"
          "tests/autotune_cache/test_table_hostile.py::test_hostile_table[16384-one-M-entries-of-one-shape]"
          tests/cli/test_cli_dispatch.py::test_python_dash_m_entry_point
          tests/autotune_cache/test_table_faults.py::test_a_table_never_executes_code)

files=() globs=()
for t in "${targets[@]}"; do
  case $t in
    keys) files+=(src/hybridgemm/autotune_cache/keys.py); globs+=("hybridgemm.autotune_cache.keys.*") ;;
    table) for m in table table_entries table_document table_locations; do
             files+=(src/hybridgemm/autotune_cache/$m.py); globs+=("hybridgemm.autotune_cache.$m.*")
           done ;;
    checks) files+=(src/hybridgemm/kernels/checks.py); globs+=("hybridgemm.kernels.checks.*") ;;
    rules) files+=(src/hybridgemm/decide.py); globs+=("hybridgemm.decide.*") ;;
    *) echo "mutation.sh: unknown target $t (keys, table, checks, rules)" >&2; exit 2 ;;
  esac
done

rm -rf "$STAGE"
mkdir -p "$STAGE/src/hybridgemm"
copy() { (cd "$1" && find . -name __pycache__ -prune -o -type f \( -name '*.py' -o -name '*.json' -o -name py.typed \) -print |
          while read -r f; do mkdir -p "$2/$(dirname "$f")"; cp -p "$f" "$2/$f"; done); }
copy fusion "$STAGE/src/hybridgemm"
copy kernels "$STAGE/src/hybridgemm/kernels"
copy autotune_cache "$STAGE/src/hybridgemm/autotune_cache"
copy perf "$STAGE/src/hybridgemm/perf"
cp -r tests "$STAGE/tests"
find "$STAGE/tests" -name __pycache__ -prune -exec rm -rf {} +
cp pyproject.toml "$STAGE/"
{
  echo "[mutmut]"
  echo "source_paths = src"
  echo "only_mutate ="; printf '  %s\n' "${files[@]}"
  echo "pytest_add_cli_args_test_selection ="; printf '  %s\n' "${TEST_FILES[@]}"
  echo "pytest_add_cli_args ="; for d in "${DESELECT[@]}"; do printf '  --deselect\n  %s\n' "$d"; done
  printf '  -p\n  no:cacheprovider\n'
} > "$STAGE/setup.cfg"

start=$(date +%s)
cd "$STAGE"
# PYTHONPATH: test subprocesses (python -m hybridgemm ...) import the mutated tree too. The
# directory must exist before Python starts: a path entry missing at startup is cached as
# having no modules, and mutmut's own sys.path entry for it would then find nothing either.
mkdir -p mutants/src
export TRITON_INTERPRET=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$STAGE/mutants/src"
# One intra-op thread: mutmut forks each mutant's test run from a process that has already run
# the tests, and a forked child left with the parent's OpenMP pool spins until its CPU limit.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$MUTMUT" run --max-children "${MUTATION_JOBS:-2}" "${globs[@]}" > run.log 2>&1 || { tail -40 run.log; exit 1; }
echo "mutation run: $(( $(date +%s) - start )) s" | tee -a run.log
"$ROOT/.venv/bin/python" - "${globs[@]}" <<'EOF' | tee summary.txt
import fnmatch, json, pathlib, sys
from collections import defaultdict
globs = sys.argv[1:]
status = {1: "killed", 3: "killed", 0: "survived", 33: "no tests", 5: "no tests", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}
per_file, survivors = defaultdict(lambda: defaultdict(int)), []
def repo_path(staged: str) -> str:  # src/hybridgemm/<sub>/x.py -> <sub>/x.py; src/hybridgemm/x.py -> fusion/x.py
    rel = staged.removeprefix("src/hybridgemm/")
    return rel if "/" in rel else f"fusion/{rel}"


for meta in sorted(pathlib.Path("mutants").rglob("*.py.meta")):
    src = repo_path(str(meta.relative_to("mutants"))[:-len(".meta")])
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if not any(fnmatch.fnmatchcase(name, g) for g in globs):
            continue
        s = status.get(code, "suspicious")
        per_file[src][s] += 1
        if s != "killed" and s != "timeout":
            survivors.append((s, name))
tot_k = tot_n = 0
for src, counts in per_file.items():
    n = sum(counts.values())
    k = counts["killed"] + counts["timeout"]  # a mutant that hangs the tests is caught too
    tot_k, tot_n = tot_k + k, tot_n + n
    print(f"{src}: {k}/{n} killed ({100 * k / n:.1f}%)  " + ", ".join(f"{s} {c}" for s, c in sorted(counts.items())))
if tot_n:
    print(f"total: {tot_k}/{tot_n} killed ({100 * tot_k / tot_n:.1f}%)")
for s, name in sorted(survivors, key=lambda x: x[1]):
    print(f"{s}: {name}")
EOF
echo "details: cd .mutation && ../.venv/bin/mutmut show <name>" >&2
