"""Read the header of a llama.cpp slot file without the server.

Layout (``llama_context::state_seq_save_file``): u32 magic ``ggsq``, u32 version, u32 count,
``count`` i32 values, then the sequence state. llama-server packs its prompt into those values
(``server_tokens::serialize``): -1 (a format marker), the packing version (1), the token count
n, n token ids, the media-chunk count, media. Older servers wrote the plain token list; both
are read. The token list is the first gate: a file whose tokens are not exactly the head's is
never restored (a failed restore wipes the slot's live cache, so we check first).

The version field (``LLAMA_STATE_SEQ_VERSION``) is what a server checks before it loads a file:
only its own. What ocpc reads, the header above, is the same in every version a build on PyPI
writes, read from each build's own source (``src/llama-context.cpp`` and
``tools/server/server-common.cpp``):

* **2** (b10502, 2026-08-20): the header and the packing as above.
* **3** (b11003 through b11393): the same header; the sequence state after it adds a recurrent
  layer's extra state rows (``p_l``: ``llama-memory-recurrent.cpp``).
* **4** (b11434, 2026-10-06): the same header; the KV cache's state adds its attention-rotation
  sizes (``n_rot_k``, ``n_rot_v``: ``llama-kv-cache.cpp``).

A version this ocpc has not read (a newer build: upstream bumps it whenever the state changes)
is read the same way and marked ``known=False``: its header may still parse, and then only the
gates on the live server decide whether a restore serves (engine/capability.py), never the number.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from oc_prefix_cache.errors import SlotFileError

MAGIC = 0x67677371  # 'ggsq'
#: The versions whose header this ocpc has read in their builds' source (above).
KNOWN_VERSIONS = frozenset({2, 3, 4})
MAX_PACKED = 16 * 1024 * 1024  # more header values than any context holds: a damaged count

#: The kinds of file ocpc writes in the slot folder, and their name prefixes.
#: head: a harness's stable head (tools + system text up to the first volatile marker);
#: proj: a project's whole system prompt for one day; conv: a parked conversation.
KIND_PREFIX = {"head": "oc-prefix", "proj": "oc-proj", "conv": "oc-conv"}
_PREFIX_KIND = {v: k for k, v in KIND_PREFIX.items()}
# Matched with fullmatch only: `$` would also accept a trailing newline.
FILE_RE = re.compile(r"(oc-prefix|oc-proj|oc-conv)-([0-9a-f]{16})\.bin")
#: A save in progress: the final name, a dot, 8 hex of a per-save random tag, ``.part``.
#: The tag keeps two servers (or daemons) saving the same key from writing one temp file.
PART_RE = re.compile(r"((?:oc-prefix|oc-proj|oc-conv)-[0-9a-f]{16}\.bin)\.([0-9a-f]{8})\.part")
#: ``ocpc doctor`` proves where saves land with a file of this name (its pid inside).
DOCTOR_RE = re.compile(r"ocpc-doctor-([0-9]+)\.bin|ocpc-selftest-([0-9]+)-[0-9a-f]{8}\.bin")  # ASCII digits only
#: The self-test at first contact with a server binary and model saves this (engine/capability.py); its
#: tag keeps two servers' self-tests in one process apart.
SELFTEST_NAME = "ocpc-selftest-{pid}-{tag}.bin"


def is_slot_file_name(name: str) -> bool:
    """True only for names ocpc writes as finished files, of any kind; nothing else."""
    return FILE_RE.fullmatch(name) is not None


def slot_filename(key: str, kind: str = "head") -> str:
    prefix = KIND_PREFIX.get(kind)
    if prefix is None:
        raise ValueError(f"not a slot-file kind: {kind!r}")
    name = f"{prefix}-{key}.bin"
    if not is_slot_file_name(name):
        raise ValueError(f"not a key: {key!r}")
    return name


def fingerprint_of(filename: str) -> str | None:
    """The 16-hex key in an ocpc slot file name (any kind), or None for any other file."""
    match = FILE_RE.fullmatch(filename)
    return match.group(2) if match else None


def kind_of(filename: str) -> str | None:
    """``head``, ``proj`` or ``conv`` for an ocpc slot file name, else None."""
    match = FILE_RE.fullmatch(filename)
    return _PREFIX_KIND[match.group(1)] if match else None


def part_name(final: str, tag: str) -> str:
    """The temp name a save writes before its rename to ``final`` (tag: 8 hex digits)."""
    name = f"{final}.{tag}.part"
    if PART_RE.fullmatch(name) is None:
        raise ValueError(f"not a temp name: {name!r}")
    return name


def part_target(name: str) -> str | None:
    """The final file name a temp file was saving, or None when ``name`` is not ours."""
    match = PART_RE.fullmatch(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class SlotFileHeader:
    version: int
    tokens: tuple[int, ...]
    size: int  # whole file, bytes
    state_bytes: int  # bytes after the token list
    known: bool = True  # a version whose layout this ocpc has read (``KNOWN_VERSIONS``)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def read_header(path: Path, *, known: frozenset[int] = KNOWN_VERSIONS) -> SlotFileHeader:
    """The header; a version not in ``known`` is read the same way and marked ``known=False``
    (``SlotFileError`` only when it does not parse: no magic, a count past the file, a packing
    this ocpc does not know)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(12)
            if len(head) < 12:
                raise SlotFileError(f"{path.name} is truncated ({len(head)} bytes): not a slot file")
            magic, version, count = struct.unpack("<III", head)
            if magic != MAGIC:
                raise SlotFileError(f"{path.name} is not a llama.cpp slot file (bad magic)")
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
    return SlotFileHeader(
        version=version, tokens=tokens, size=size, state_bytes=size - 12 - 4 * count, known=version in known
    )


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
