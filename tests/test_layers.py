"""The package's import graph: layers import one way and no module imports itself back.

Layers, lowest first: kernels/ (hybridgemm.kernels) ← autotune_cache/ ← fusion/ (the
package root: decide, dispatch, linear_layer, attention, patching, ...) ← perf/ ← the command line
(hybridgemm.cli, hybridgemm.__main__). A module may import its own layer and those below.
Inside fusion/, the decision (decide, the batch-invariant decision in modes, and explain, which
reports decisions) never imports the code that runs it (dispatch).
Read from the source with ``ast``, so every import counts, inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"kernels": "hybridgemm.kernels", "autotune_cache": "hybridgemm.autotune_cache", "fusion": "hybridgemm",
           "perf": "hybridgemm.perf"}
# Inside fusion/ (the package root, the linear call and its fused projections) the sub-packages
# stand above it: models (patching, the fused decoder layer) and parallel (which patches too).
# The package's __init__ gathers the public API from all three.
SUBPACKAGES = {"hybridgemm.models": "models", "hybridgemm.parallel": "parallel"}
API = "hybridgemm"
CLI = "hybridgemm.cli"
RANK = {"kernels": 0, "autotune_cache": 1, "fusion": 2, "models": 3, "parallel": 4, "api": 5, "perf": 6, "cli": 7}
# Project modules loaded on first use, each for a reason: Triton is imported on first use so
# that `import hybridgemm` works where Triton is absent (the CPU path needs none). A load is an
# import inside a function or a call of kernels.lazy.triton_module("<module>") anywhere.
LAZY_ALLOWED = {
    # kernels/__init__.py: under `if`, skipped where the checkout's folder stands aside for the installed `kernels`
    ("hybridgemm.kernels", "hybridgemm.kernels.epilogue"),
    ("hybridgemm.kernels", "hybridgemm.kernels.problem"),
    ("hybridgemm.modes", "hybridgemm.kernels.triton_config"),
    ("hybridgemm.modes", "hybridgemm.kernels.triton_gemm"),
    ("hybridgemm.kernels.backends", "hybridgemm.kernels.triton_launch"),
    ("hybridgemm.kernels.backends", "hybridgemm.kernels.triton_gemm"),
    ("hybridgemm.kernels.backends", "hybridgemm.kernels.triton_splitk"),
    ("hybridgemm.mlp", "hybridgemm.kernels.triton_glu"),
    ("hybridgemm.dispatch", "hybridgemm.kernels.triton_glu"),
    ("hybridgemm.experts", "hybridgemm.kernels.triton_moe"),
    ("hybridgemm.experts", "hybridgemm.kernels.triton_router"),
    ("hybridgemm.router", "hybridgemm.kernels.triton_splitk"),  # the router's GEMM with the routing in its epilogue
    ("hybridgemm.router", "hybridgemm.kernels.triton_router"),  # DeepSeek-V3's routing
    ("hybridgemm.autotune_cache.tune_moe", "hybridgemm.kernels.triton_moe"),
    ("hybridgemm.autotune_cache.tune_glu", "hybridgemm.kernels.triton_glu"),
    # choose_fp8: the split-K default config; choose_fusable: its untuned config
    ("hybridgemm.decide", "hybridgemm.kernels.triton_splitk"),
    ("hybridgemm.dispatch", "hybridgemm.kernels.triton_splitk"),  # fused_splitk: does the norm prologue fit
    ("hybridgemm.models.decode_checks", "hybridgemm.kernels.triton_rope"),
    ("hybridgemm.models.attention_forms", "hybridgemm.kernels.triton_decode_attention"),
    ("hybridgemm.models.attention_forms", "hybridgemm.kernels.triton_qk_rope"),  # OLMo 2's q/k norms, rotary, cache
    ("hybridgemm.norm", "hybridgemm.kernels.triton_rmsnorm"),
    ("hybridgemm.models.compiled_layer_norm", "hybridgemm.kernels.triton_layernorm"),  # the LayerNorm families' norms
    ("hybridgemm.fp8_linear", "hybridgemm.kernels.triton_dequant"),  # the one-pass dequantization past the FP8 rows
    ("hybridgemm.kernels.cublaslt_fp8", "hybridgemm.kernels.fp8_quant"),
    # autotune --hf-config --tp: what parallelize splits (tensor_parallel loads torch's functional collectives)
    ("hybridgemm.cli.commands", "hybridgemm.parallel.tensor_parallel"),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "tables" not in parts:
                mods[".".join((pkg, *parts))] = path
    return mods


MODULES = _modules()


def _layer(mod: str) -> str:
    if mod == CLI or mod.startswith(CLI + ".") or mod == "hybridgemm.__main__":
        return "cli"
    if mod == API:
        return "api"
    for pkg, layer in SUBPACKAGES.items():
        if mod == pkg or mod.startswith(pkg + "."):
            return layer
    for folder, pkg in FOLDERS.items():
        if folder != "fusion" and (mod == pkg or mod.startswith(pkg + ".")):
            return folder
    return "fusion"


def _resolve(mod: str, node) -> list[str]:
    """The project modules an import statement in ``mod`` loads (a name imported from a
    package counts as its submodule when there is one)."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod if MODULES[mod].stem == "__init__" else mod.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                pkg = pkg.rsplit(".", 1)[0]
            base = f"{pkg}.{base}" if base else pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        if name:
            found.append(name)
    return found


LOADER = "triton_module"  # kernels/lazy.py: triton_module("triton_glu") imports hybridgemm.kernels.triton_glu
BAD_LOADS: list[str] = []  # loader calls whose module the graph cannot tell


def _loaded_module(node) -> str | None:
    """The module a ``triton_module("<name>")`` call loads (None for any other node); a call
    without one string literal naming a kernels module goes to BAD_LOADS."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None) != LOADER:
        return None
    arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
    target = f"hybridgemm.kernels.{arg.value}" if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
    return target if target in MODULES else ""


def _edges() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, loaded on first use?, line) for every project import and every
    loader call (each counts as an import on first use where it sits in a function)."""
    edges = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        in_functions = {id(inner) for fn in ast.walk(tree)
                        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                        for inner in ast.walk(fn) if inner is not fn}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(mod, node):
                    if target != mod:
                        edges.append((mod, target, id(node) not in top, node.lineno))
            elif (target := _loaded_module(node)) is not None:
                if target:
                    edges.append((mod, target, id(node) in in_functions, node.lineno))
                else:
                    BAD_LOADS.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    return edges


EDGES = _edges()


def test_the_graph_sees_the_package():
    # a graph reader that found nothing would pass every test below
    assert {"hybridgemm.decide", "hybridgemm.dispatch", "hybridgemm.autotune_cache.tuner",
            "hybridgemm.kernels.cublaslt", "hybridgemm.perf.bench_msweep", "hybridgemm.cli"} <= set(MODULES)
    assert ("hybridgemm.decide", "hybridgemm.autotune_cache.table") in {(a, b) for a, b, _, _ in EDGES}
    assert len(EDGES) > 100


def test_layers_import_one_way():
    upward = [f"{a}:{line} imports {b} ({_layer(a)} -> {_layer(b)})" for a, b, _, line in EDGES
              if RANK[_layer(b)] > RANK[_layer(a)]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in EDGES:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for mod in sorted(MODULES):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", ["hybridgemm.decide", "hybridgemm.modes", "hybridgemm.explain"])
def test_decide_never_reaches_dispatch(module):
    """The decision half imports nothing that leads to the run half (directly or through others)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in EDGES:
        graph.setdefault(a, set()).add(b)
    seen, todo = set(), [module]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert "hybridgemm.dispatch" not in seen and "hybridgemm.autotune_cache.table" in seen


def test_project_imports_inside_functions_are_only_the_listed_lazy_ones():
    lazy = {(a, b) for a, b, inside, _ in EDGES if inside}
    assert lazy == LAZY_ALLOWED, f"unlisted: {sorted(lazy - LAZY_ALLOWED)}; gone: {sorted(LAZY_ALLOWED - lazy)}"


def test_lazy_loads_name_their_module():
    """Every triton_module call names a Triton kernel module with a string literal (so the graph
    sees it), and the loader's list of such modules is every kernels/triton_*.py."""
    from hybridgemm.kernels.lazy import TRITON_MODULES

    assert not BAD_LOADS, "\n".join(BAD_LOADS)
    assert TRITON_MODULES == {p.stem for p in (ROOT / "kernels").glob("triton_*.py")}
    loads = {b for a, b, inside, _ in EDGES if inside and a != "hybridgemm.kernels.lazy"}
    assert {f"hybridgemm.kernels.{name}" for name in ("triton_glu", "triton_rmsnorm", "triton_gemm")} <= loads


@pytest.mark.parametrize("module", ["hybridgemm", "hybridgemm.cli", "hybridgemm.perf.bench_msweep"])
def test_import_needs_no_triton(module):
    """With Triton unimportable, the package (and the CLI) still import: the CPU path and
    `hybridgemm show/explain` need none."""
    import subprocess
    import sys

    # sys.modules['triton'] = None: importing triton raises ImportError, and find_spec('triton')
    # answers None (torch >= 2.15 probes for triton that way while it is imported)
    code = ("import sys\n"
            "sys.modules['triton'] = None\n"
            f"import {module}\n"
            "print(any(m.split('.')[0] == 'triton' and v is not None for m, v in sys.modules.items()))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"
