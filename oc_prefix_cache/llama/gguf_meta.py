"""Read a GGUF file's key/value header: enough to know the architecture and its cache kind.

Why: what a restored slot is worth depends on the model's cache family (llama/families.py), so
the prepare path, ``launch`` and ``doctor`` need to know which kind of model the server runs. gguf-py would do,
but it is not a runtime dependency; the header format is small and stable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.families import Family, family_of

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufInfo:
    architecture: str
    keys: dict[str, Any]  # scalars and strings only; arrays are skipped

    @property
    def family(self) -> Family:
        """Transformer, hybrid/recurrent or sliding-window (llama/families.py says what each means)."""
        return family_of(self.architecture, self.keys)

    @property
    def context_length(self) -> int | None:
        value = self.keys.get(f"{self.architecture}.context_length")
        return int(value) if isinstance(value, int) else None


def read_gguf_info(path: Path) -> GgufInfo:
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise OcpcError(f"{path} is not a GGUF file")
            (_version,) = struct.unpack("<I", handle.read(4))
            _n_tensors, n_kv = struct.unpack("<QQ", handle.read(16))
            keys: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _read_string(handle)
                (vtype,) = struct.unpack("<I", handle.read(4))
                value = _read_value(handle, vtype)
                if value is not _SKIPPED:
                    keys[key] = value
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise OcpcError(f"cannot read the GGUF header of {path}: {exc}") from exc
    arch = keys.get("general.architecture")
    return GgufInfo(architecture=arch if isinstance(arch, str) else "unknown", keys=keys)


_SKIPPED = object()


def _read_string(handle: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    return handle.read(length).decode("utf-8")


def _read_value(handle: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, handle.read(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _read_string(handle)
    if vtype == _ARRAY:
        (item_type,) = struct.unpack("<I", handle.read(4))
        (count,) = struct.unpack("<Q", handle.read(8))
        if item_type in _SCALARS:
            handle.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
        elif item_type == _STRING:
            for _ in range(count):
                (length,) = struct.unpack("<Q", handle.read(8))
                handle.seek(length, 1)
        else:  # nested arrays: rare, read them the slow way
            for _ in range(count):
                _read_value(handle, item_type)
        return _SKIPPED
    raise OcpcError(f"unknown GGUF value type {vtype}")
