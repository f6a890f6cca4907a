"""The wheel a user installs: built from this tree, it holds every subpackage, the shipped
tables, the typing marker and the license, and the build prints no packaging warning."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    import tempfile

    from filelock import FileLock

    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the tree's build/ folder: two pytest-xdist workers building at once
    # would remove each other's files, so one build at a time
    with FileLock(Path(tempfile.gettempdir()) / "hybridgemm-wheel-build.lock", timeout=600):
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                              "-w", str(out)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named pip" in res.stderr:
        pytest.skip("pip is not installed in this interpreter")
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.glob("hybridgemm-*.whl")
    return path, res.stdout + res.stderr


def test_wheel_holds_every_subpackage_table_and_marker(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    for pkg, folder in (("hybridgemm", "fusion"), ("hybridgemm/kernels", "kernels"),
                        ("hybridgemm/autotune_cache", "autotune_cache"), ("hybridgemm/perf", "perf")):
        sources = {f"{pkg}/{p.name}" for p in (ROOT / folder).glob("*.py")}
        assert sources and sources <= names, sorted(sources - names)
    tables = {f"hybridgemm/autotune_cache/tables/{p.name}" for p in (ROOT / "autotune_cache/tables").glob("*.json")}
    assert tables and tables <= names, sorted(tables - names)
    assert "hybridgemm/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names), sorted(n for n in names if "dist-info" in n)


def test_wheel_build_prints_no_packaging_warning(wheel):
    _, log = wheel
    assert "would be ignored" not in log and "BuildBackendWarning" not in log, log[-3000:]


def test_version_is_read_from_the_installed_metadata():
    import re

    import hybridgemm

    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert hybridgemm.__version__ == declared


def _python_in_the_checkout(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` from the checkout's root, which puts the root first on sys.path."""
    import os

    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_bare_name_kernels_in_a_checkout_is_the_installed_package(tmp_path):
    # `kernels/` at the checkout's root is hybridgemm.kernels; from the root it is also found as `kernels`,
    # the name of another distribution. The installed one must win, and hybridgemm's must still load.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
    res = _python_in_the_checkout(
        "import kernels, hybridgemm.kernels as ours\n"
        "print(kernels.MARK, kernels.__file__)\n"
        "print(ours.__file__, ours.Problem.__module__)\n", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = res.stdout.splitlines()
    assert first == f"installed {tmp_path / 'kernels' / '__init__.py'}"
    assert second == f"{ROOT / 'kernels' / '__init__.py'} hybridgemm.kernels.problem"


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "none-installed"])
def test_two_checkouts_on_the_path_do_not_load_each_other(tmp_path, installed):
    # another checkout's root after this one's: neither kernels/ is taken for the installed package
    import shutil

    other = tmp_path / "other"
    for folder in ("fusion", "autotune_cache"):
        (other / folder).mkdir(parents=True)
    shutil.copytree(ROOT / "kernels", other / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    path = [str(other)]
    if installed:
        (tmp_path / "site" / "kernels").mkdir(parents=True)
        (tmp_path / "site" / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
        path.append(str(tmp_path / "site"))
    import os

    code = "import kernels\nprint(getattr(kernels, 'MARK', kernels.__file__))\n"
    res = _python_in_the_checkout(code, Path(os.pathsep.join(path)))
    assert res.returncode == 0, res.stderr[-3000:]  # (no import ping-pong between the two)
    if installed:
        assert res.stdout.strip() == "installed"
    else:  # this checkout's own, or an installed kernels package the interpreter has (transformers >= 5.25's)
        assert not res.stdout.strip().startswith(str(other)), res.stdout


def test_transformers_imports_from_the_checkouts_root():
    pytest.importorskip("transformers")
    res = _python_in_the_checkout("from transformers import LlamaConfig, activations\nprint(LlamaConfig.__name__)")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "LlamaConfig"


def test_the_default_venv_pins_the_newest_stacks_transformers():
    import re

    setup = re.search(r"^TRANSFORMERS=(\S+)", (ROOT / "scripts/setup.sh").read_text(), re.M).group(1)
    newest = re.search(r'newest\) echo ".*transformers==(\S+)"', (ROOT / "scripts/ci-stacks.sh").read_text()).group(1)
    assert setup == newest
    assert f"transformers {setup}) stacks" in " ".join((ROOT / "README.md").read_text().split())
