"""index.json: which slot files exist, what made them, when they were last used.

Written atomically (temp file, fsync, rename) under an exclusive file lock, so two
daemons, or a daemon and ``ocpc gc``, never interleave writes. A corrupt index is never
guessed at or overwritten silently: reads raise ``IndexCorrupt`` and the caller decides
(the prepare path goes on without recording; gc refuses to delete anything).
Format: docs/index-format.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import IndexCorrupt, LockTimeout, StoreError
from .files import file_lock, write_atomic
from .slotfile import kind_of

INDEX_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 had heads only; its entries read as kind "head"
KINDS = ("head", "proj", "conv")


@dataclass
class Entry:
    """One file in the slot folder. Heads are keyed by fingerprint, parks by their own id."""

    file: str
    bytes: int
    prefix_tokens: int
    created: int
    last_used: int
    model: str
    server_build: str
    harness: str
    xxh64: str = ""  # of the whole file at save time: catches damage the probe cannot see
    kind: str = "head"  # head | proj (a project's system prompt, one day) | conv (a parked conversation)
    identity: str = ""  # server/model/template identity digest: parks are looked up under it only
    head: str = ""  # proj/conv: the head fingerprint the file extends
    session: str = ""  # conv: the conversation's session id, when the harness sends one
    chain: list[str] = field(default_factory=list)  # proj/conv: digests of the messages covered, in order
    expires: int = 0  # unix seconds after which the file is useless (proj: the end of its day); 0 never
    text_chars: int = 0  # conv: characters of the rendered prompt its tokens cover (0: unknown)
    text_xxh64: str = ""  # conv: digest of that text, so a request that starts with it tokenizes only the rest


@dataclass
class Index:
    entries: dict[str, Entry] = field(default_factory=dict)
    current: dict[str, str] = field(default_factory=dict)  # slot key -> fingerprint

    def to_json(self) -> dict[str, Any]:
        return {
            "version": INDEX_VERSION,
            "entries": {fp: asdict(e) for fp, e in sorted(self.entries.items())},
            "current": dict(sorted(self.current.items())),
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> Index:
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            raise IndexCorrupt(f"{source}: not an ocpc index of version {' or '.join(map(str, READABLE_VERSIONS))}")
        entries_raw, current_raw = data.get("entries"), data.get("current", {})
        if not isinstance(entries_raw, dict) or not isinstance(current_raw, dict):
            raise IndexCorrupt(f"{source}: 'entries' and 'current' must be objects")
        entries: dict[str, Entry] = {}
        for fp, raw in entries_raw.items():
            entry = _entry(raw, fp, source)
            if kind_of(entry.file) != entry.kind:
                raise IndexCorrupt(f"{source}: entry {fp!r} names {entry.file!r}, not an ocpc {entry.kind} file")
            entries[fp] = entry
        current = {str(k): str(v) for k, v in current_raw.items()}
        return cls(entries=entries, current=current)


def _entry(raw: Any, fp: str, source: str) -> Entry:
    """One entry, with every field of the type the dataclass says, or IndexCorrupt."""
    if not isinstance(raw, dict):
        raise IndexCorrupt(f"{source}: entry {fp!r} is not an object")
    try:
        entry = Entry(**raw)
    except TypeError as exc:
        raise IndexCorrupt(f"{source}: entry {fp!r} is malformed ({exc})") from exc
    for name, kind in (("file", str), ("bytes", int), ("prefix_tokens", int), ("created", int),
                       ("last_used", int), ("model", str), ("server_build", str), ("harness", str), ("xxh64", str),
                       ("kind", str), ("identity", str), ("head", str), ("session", str), ("chain", list),
                       ("expires", int), ("text_chars", int), ("text_xxh64", str)):
        value = getattr(entry, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise IndexCorrupt(f"{source}: entry {fp!r} has {name}={value!r}, expected {kind.__name__}")
    if entry.kind not in KINDS or not all(isinstance(d, str) for d in entry.chain):
        raise IndexCorrupt(f"{source}: entry {fp!r} has kind {entry.kind!r} or a chain that is not strings")
    return entry


def slot_key(base_url: str, slot: int) -> str:
    """How ``current`` names a slot: the server URL and the slot id."""
    return f"{base_url.rstrip('/')}#slot{slot}"


class Store:
    def __init__(self, *, index_path: Path, lock_path: Path) -> None:
        self.index_path = index_path
        self.lock_path = lock_path

    @contextmanager
    def locked(self, *, timeout: float | None = None) -> Iterator[None]:
        """Exclusive across processes (flock) for a read-modify-write of the index.

        ``timeout``: give up with ``LockTimeout`` after that many seconds (a prepare has a
        deadline; only ``ocpc gc`` run by hand may wait for ever).
        """
        with file_lock(self.lock_path, timeout=timeout):
            yield

    def load(self) -> Index:
        """The index; empty when missing; ``IndexCorrupt`` when unreadable."""
        try:
            text = self.index_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Index()
        except (OSError, UnicodeDecodeError) as exc:
            raise IndexCorrupt(f"cannot read {self.index_path}: {exc}") from exc
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise IndexCorrupt(
                f"{self.index_path} is not valid JSON ({exc}); fix or move it away, "
                "cleanup stays off until then"
            ) from exc
        return Index.from_json(data, source=str(self.index_path))

    def save(self, index: Index) -> None:
        """Atomic replace: readers see the old index or the new one, never half of one."""
        try:
            write_atomic(self.index_path, (json.dumps(index.to_json(), indent=1) + "\n").encode())
        except OSError as exc:
            raise StoreError(f"cannot write {self.index_path}: {exc}") from exc

    def update(self, change: Callable[[Index], None], *, timeout: float | None = None) -> Index:
        """Load, change and save the index under the lock; returns the saved index."""
        with self.locked(timeout=timeout):
            index = self.load()
            change(index)
            self.save(index)
            return index



class UsageLog:
    """Uses of files (restores and hits), noted in memory, written to the index rarely.

    A head served only by hits must not age out of gc's TTL, but a hit may not write the
    index (it answers in about a millisecond). So uses are noted here and written by the
    daemon's background thread at most every ``interval`` seconds, and at shutdown. A use
    lost to a crash costs at most that much of a file's age.
    """

    def __init__(self, store: Store, *, interval: float = 300.0) -> None:
        self.store = store
        self.interval = interval
        self._guard = threading.Lock()
        self._used: dict[str, int] = {}  # key -> unix seconds of the latest use
        self._current: dict[str, str] = {}  # slot key -> file key now in that slot
        self._last_flush = time.monotonic()

    def note(self, key: str, *, slot: str | None = None, when: int | None = None) -> None:
        with self._guard:
            self._used[key] = max(self._used.get(key, 0), int(time.time()) if when is None else when)
            if slot is not None:
                self._current[slot] = key

    def due(self) -> bool:
        with self._guard:
            return bool(self._used or self._current) and time.monotonic() - self._last_flush >= self.interval

    def flush(self, *, timeout: float | None = 10.0) -> None:
        """Write the noted uses (entries that no longer exist are skipped); StoreError on failure."""
        with self._guard:
            used, current = dict(self._used), dict(self._current)
            self._used.clear()
            self._current.clear()
            self._last_flush = time.monotonic()
        if not used and not current:
            return

        def change(index: Index) -> None:
            for key, when in used.items():
                entry = index.entries.get(key)
                if entry is not None and when > entry.last_used:
                    entry.last_used = when
            for slot, key in current.items():
                if key in index.entries:
                    index.current[slot] = key

        try:
            self.store.update(change, timeout=timeout)
        except (StoreError, LockTimeout):
            with self._guard:  # keep them for the next try
                for key, when in used.items():
                    self._used[key] = max(self._used.get(key, 0), when)
                for slot, key in current.items():
                    self._current.setdefault(slot, key)
            raise
