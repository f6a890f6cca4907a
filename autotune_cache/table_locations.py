"""Where tuning tables live: the user table's path, and the tables shipped with the package.

- the user table: ``$HYBRIDGEMM_CACHE_DIR/table.json`` if the variable is set, else
  ``platformdirs.user_cache_dir("hybridgemm")/table.json``;
- shipped tables: ``hybridgemm/autotune_cache/tables/*.json``, listed in file-name order. A
  GPU model's table is found by its file name or by the GPU name its signature records
  (:func:`shipped_table_for_device`).

Which of these apply to a device, and how they merge, is :func:`~.table.load_tables`' part.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import platformdirs

from .keys import TableError
from .table_document import _log, _read_table_bytes, parse_document

CACHE_DIR_ENV = "HYBRIDGEMM_CACHE_DIR"


def shipped_table_dir() -> Path:
    return Path(__file__).resolve().parent / "tables"


def shipped_table_paths(directory: os.PathLike | str | None = None) -> list[Path]:
    """The shipped tables, sorted by file name."""
    d = Path(directory) if directory is not None else shipped_table_dir()
    return sorted(d.glob("*.json")) if d.is_dir() else []


def device_slug(name: str) -> str:
    """A GPU name as shipped tables are named: lowercase words joined by ``-``, without the
    vendor (``"NVIDIA H200"`` → ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` → ``"h100-80gb-hbm3"``)."""
    words = re.findall(r"[a-z0-9]+", name.lower()) if isinstance(name, str) else []
    return "-".join(w for w in words if w != "nvidia")


def shipped_devices(directory: os.PathLike | str | None = None) -> dict[str, tuple[Path, str]]:
    """The GPU models shipped tables are for: the table's file-name stem (``h200``) → (its
    path, the GPU name its signature records; ``""`` for a table that cannot be read, which
    its file name still names, so that loading it can say what is wrong)."""
    found = {}
    for path in shipped_table_paths(directory):
        gpu = ""
        try:
            data = _read_table_bytes(path)
            if data is not None:
                gpu = parse_document(data).signature.get("gpu_name", "")
        except TableError as e:
            _log.debug("shipped table %s: no GPU name (%s)", path, e)
        found[path.stem] = (path, gpu if isinstance(gpu, str) else "")
    return found


def shipped_table_for_device(name: str, directory: os.PathLike | str | None = None) -> Path | None:
    """The shipped table for the GPU model ``name``, matched case-insensitively on the table's
    file name (``h200``) or on the GPU name its signature records (``"NVIDIA H200"``,
    ``nvidia-h200``), or ``None``."""
    slug = device_slug(name)
    if not slug:
        return None
    for stem, (path, gpu) in shipped_devices(directory).items():
        if slug in (device_slug(stem), device_slug(gpu)):
            return path
    return None


def user_table_path() -> Path:
    """``$HYBRIDGEMM_CACHE_DIR/table.json`` if set, else the platform's user cache dir."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser() / "table.json"

    return Path(platformdirs.user_cache_dir("hybridgemm")) / "table.json"
