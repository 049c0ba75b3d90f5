"""Read the header of a llama.cpp slot file without the server.

Layout (``llama_context::state_seq_save_file``, state version 4): u32 magic ``ggsq``,
u32 version, u32 count, ``count`` i32 values, then the sequence state. llama-server
packs its prompt into those values (``server_tokens::serialize``): -1 (a format marker),
the packing version (1), the token count n, n token ids, the media-chunk count, media.
Older servers wrote the plain token list; both are read.
The token list is the first gate: a file whose tokens are not exactly the head's is
never restored (a failed restore wipes the slot's live cache, so we check first).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .errors import SlotFileError

MAGIC = 0x67677371  # 'ggsq'
SUPPORTED_VERSIONS = frozenset({4})
MAX_PACKED = 16 * 1024 * 1024  # more header values than any context holds: a damaged count
# Matched with fullmatch only: `$` would also accept a trailing newline.
FILE_RE = re.compile(r"oc-prefix-([0-9a-f]{16})\.bin")


def is_slot_file_name(name: str) -> bool:
    """True only for names ocpc writes: ``oc-prefix-<16 lower-case hex>.bin``, nothing else."""
    return FILE_RE.fullmatch(name) is not None


def slot_filename(fingerprint: str) -> str:
    name = f"oc-prefix-{fingerprint}.bin"
    if not is_slot_file_name(name):
        raise ValueError(f"not a fingerprint: {fingerprint!r}")
    return name


def fingerprint_of(filename: str) -> str | None:
    """The fingerprint in an ocpc slot file name, or None for any other file."""
    match = FILE_RE.fullmatch(filename)
    return match.group(1) if match else None


@dataclass(frozen=True)
class SlotFileHeader:
    version: int
    tokens: tuple[int, ...]
    size: int  # whole file, bytes
    state_bytes: int  # bytes after the token list

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def read_header(path: Path) -> SlotFileHeader:
    try:
        with open(path, "rb") as handle:
            head = handle.read(12)
            if len(head) < 12:
                raise SlotFileError(f"{path.name} is truncated ({len(head)} bytes): not a slot file")
            magic, version, count = struct.unpack("<III", head)
            if magic != MAGIC:
                raise SlotFileError(f"{path.name} is not a llama.cpp slot file (bad magic)")
            if version not in SUPPORTED_VERSIONS:
                raise SlotFileError(
                    f"{path.name} has slot-file version {version}; this ocpc reads {sorted(SUPPORTED_VERSIONS)}"
                )
            size = path.stat().st_size
            if 12 + 4 * count > size or count > MAX_PACKED:
                raise SlotFileError(f"{path.name} is truncated or damaged: header names {count} values")
            raw = handle.read(4 * count)
            if len(raw) != 4 * count:
                raise SlotFileError(f"{path.name} is truncated: {len(raw)} of {4 * count} header bytes")
    except OSError as exc:
        raise SlotFileError(f"cannot read {path}: {exc}") from exc
    packed = struct.unpack(f"<{count}i", raw)
    tokens = _unpack_server_tokens(packed, path.name)
    return SlotFileHeader(version=version, tokens=tokens, size=size, state_bytes=size - 12 - 4 * count)


SERVER_TOKENS_VERSION = 1


def _unpack_server_tokens(packed: tuple[int, ...], name: str) -> tuple[int, ...]:
    if not packed or packed[0] != -1:
        return packed  # a plain token list, as older servers wrote it
    if len(packed) < 3 or packed[1] != SERVER_TOKENS_VERSION:
        raise SlotFileError(f"{name}: unknown server token packing {packed[1:2]}")
    n = packed[2]
    if n < 0 or 3 + n > len(packed):
        raise SlotFileError(f"{name}: token list of {n} does not fit the header")
    return packed[3 : 3 + n]


def file_digest(path: Path) -> str:
    """xxh64 of the whole file (GB/s: a fraction of a restore's own read)."""
    digest = xxhash.xxh64()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
