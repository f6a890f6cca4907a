"""cuBLASLt algorithms as data: readable, serialisable, restorable with validation.

A ``cublasLtMatmulAlgo_t`` is 64 opaque bytes. :class:`CublasLtAlgo` keeps those bytes
together with the fields a person can read (algorithm id, tile, stages, split-K, reduction
scheme, swizzle, custom option, inner and cluster shape, all read back *from* the bytes
through ``cublasLtMatmulAlgoConfigGetAttribute``) and the cuBLASLt version that produced
them. A record is only ever restored into the same cuBLASLt version, and then checked
against the problem with ``cublasLtMatmulAlgoCheck`` before use (kernels/cublaslt_plan.py).

Nothing here touches the GPU; reading attributes of an algorithm struct is host-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cublaslt_runtime import CublasLtUnavailable, bindings

ALGO_BYTES = 64
RECORD_KIND = "cublaslt"

# Config attribute -> record field name. Order is the record's order.
_FIELDS = (
    ("ID", "algo_id"),
    ("TILE_ID", "tile"),
    ("STAGES_ID", "stages"),
    ("SPLITK_NUM", "splitk"),
    ("REDUCTION_SCHEME", "reduction"),
    ("CTA_SWIZZLING", "swizzle"),
    ("CUSTOM_OPTION", "custom"),
    ("INNER_SHAPE_ID", "inner_shape"),
    ("CLUSTER_SHAPE_ID", "cluster_shape"),
)


class InvalidAlgorithm(ValueError):
    """A cuBLASLt algorithm record that cannot be used here (and why)."""


def _enum_name(enum_cls, value: int) -> str:
    try:
        return enum_cls(value).name
    except ValueError:
        return str(value)


def read_algo_fields(algo_buf: np.ndarray) -> dict[str, int]:
    """Read the configuration attributes of a 64-byte algorithm buffer."""
    lt = bindings()
    out = {}
    written = np.zeros(1, dtype=np.uint64)
    for attr_name, field in _FIELDS:
        attr = lt.MatmulAlgoConfigAttribute[attr_name]
        val = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
        lt.matmul_algo_config_get_attribute(
            algo_buf.ctypes.data, attr, val.ctypes.data, val.nbytes, written.ctypes.data
        )
        out[field] = int(val[0])
    return out


def set_algo_field(algo_buf: np.ndarray, attr_name: str, value: int) -> None:
    lt = bindings()
    attr = lt.MatmulAlgoConfigAttribute[attr_name]
    val = np.array([value], dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
    lt.matmul_algo_config_set_attribute(algo_buf.ctypes.data, attr, val.ctypes.data, val.nbytes)


@dataclass(frozen=True)
class CublasLtAlgo:
    """One cuBLASLt algorithm: its 64 bytes, their readable fields, and the version."""

    data: bytes
    fields: tuple[tuple[str, int], ...]
    cublaslt_version: int
    workspace_bytes: int = 0
    source: str = "heuristic"  # "heuristic" or "exhaustive": how it was found

    def __post_init__(self):
        if len(self.data) != ALGO_BYTES:
            raise InvalidAlgorithm(f"algorithm data must be {ALGO_BYTES} bytes, got {len(self.data)}")

    @property
    def field_dict(self) -> dict[str, int]:
        return dict(self.fields)

    @property
    def algo_id(self) -> int:
        return self.field_dict["algo_id"]

    def buffer(self) -> np.ndarray:
        """A fresh, writable host buffer holding the algorithm struct."""
        return np.frombuffer(bytearray(self.data), dtype=np.uint64).copy()

    @classmethod
    def from_buffer(
        cls, buf: np.ndarray, version: int, workspace_bytes: int = 0, source: str = "heuristic"
    ) -> CublasLtAlgo:
        raw = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)[:ALGO_BYTES].tobytes()
        fields = read_algo_fields(np.frombuffer(bytearray(raw), dtype=np.uint64).copy())
        return cls(raw, tuple(fields.items()), int(version), int(workspace_bytes), source)

    def describe(self) -> str:
        """Short human-readable summary, e.g. ``id=66 TILE_128x256 STAGES_64x4 splitk=1``."""
        lt = bindings()
        f = self.field_dict
        parts = [
            f"id={f['algo_id']}",
            _enum_name(lt.MatmulTile, f["tile"]),
            _enum_name(lt.MatmulStages, f["stages"]),
            f"splitk={f['splitk']}",
        ]
        if f["splitk"] > 1:
            parts.append(f"red={_enum_name(lt.ReductionScheme, f['reduction'])}")
        if f["swizzle"]:
            parts.append(f"swz={f['swizzle']}")
        if f["custom"]:
            parts.append(f"custom={f['custom']}")
        if f["cluster_shape"]:
            parts.append(_enum_name(lt.ClusterShape, f["cluster_shape"]))
        return " ".join(parts)

    def to_record(self) -> dict:
        """JSON-safe record: readable fields, the opaque bytes (hex), the cuBLASLt version."""
        rec = {"kind": RECORD_KIND, "cublaslt_version": self.cublaslt_version}
        rec.update(self.field_dict)
        rec["workspace_bytes"] = self.workspace_bytes
        rec["source"] = self.source
        rec["bytes"] = self.data.hex()
        try:  # names make the record readable; the numbers are what restore uses
            lt = bindings()
            f = self.field_dict
            rec["tile_name"] = _enum_name(lt.MatmulTile, f["tile"])
            rec["stages_name"] = _enum_name(lt.MatmulStages, f["stages"])
        except CublasLtUnavailable:
            pass
        return rec

    @classmethod
    def from_record(cls, rec: dict, running_version: int | None = None) -> CublasLtAlgo:
        """Rebuild from :meth:`to_record`'s output. Refuses (``InvalidAlgorithm``) a record of
        the wrong kind or shape, one made by another cuBLASLt version than ``running_version``,
        and one whose readable fields disagree with its bytes (edited or corrupted)."""
        if not isinstance(rec, dict) or rec.get("kind") != RECORD_KIND:
            raise InvalidAlgorithm(f"not a cuBLASLt algorithm record: {rec!r:.200}")
        try:
            version = rec["cublaslt_version"]
            raw_hex = rec["bytes"]
            fields = {name: rec[name] for _, name in _FIELDS}
            workspace = rec.get("workspace_bytes", 0)
        except KeyError as e:
            raise InvalidAlgorithm(f"cuBLASLt algorithm record lacks field {e}") from None
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidAlgorithm(f"cublaslt_version must be an int, got {version!r}")
        for name, v in fields.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidAlgorithm(f"field {name!r} must be an int, got {v!r}")
        if not isinstance(raw_hex, str):
            raise InvalidAlgorithm("field 'bytes' must be a hex string")
        try:
            raw = bytes.fromhex(raw_hex)
        except ValueError:
            raise InvalidAlgorithm("field 'bytes' is not valid hex") from None
        if len(raw) != ALGO_BYTES:
            raise InvalidAlgorithm(f"field 'bytes' must hold {ALGO_BYTES} bytes, got {len(raw)}")
        if running_version is not None and version != running_version:
            raise InvalidAlgorithm(
                f"record was made by cuBLASLt {version}, this process runs cuBLASLt "
                f"{running_version}; algorithms are opaque and only valid for the version "
                "that made them: re-tune"
            )
        algo = cls(raw, tuple(fields.items()), version, int(workspace), rec.get("source", "record"))
        if running_version is not None:
            actual = read_algo_fields(algo.buffer())
            if actual != fields:
                diff = {k: (fields[k], actual[k]) for k in fields if fields[k] != actual[k]}
                raise InvalidAlgorithm(
                    f"record's readable fields disagree with its bytes {diff} (edited or corrupt)"
                )
        return algo
