"""index.json: which slot files exist, what made them, when they were last used.

Written atomically (temp file, fsync, rename) under an exclusive file lock, so two
daemons, or a daemon and ``ocpc gc``, never interleave writes. A corrupt index is never
guessed at or overwritten silently: reads raise ``IndexCorrupt`` and the caller decides
(the prepare path goes on without recording; gc refuses to delete anything).
Format: docs/index-format.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import xxhash

from oc_prefix_cache.disk.slotfile import kind_of
from oc_prefix_cache.errors import IndexCorrupt, LockTimeout, OcpcError, StoreError
from oc_prefix_cache.files import file_lock, write_private

log = logging.getLogger("ocpc.store")

INDEX_VERSION = 3
# Version 1 had heads only; its entries read as kind "head". Version 2 kept a park's whole
# message chain (a digest per message: 38 KB for a 2,000-message conversation, a 9.7 MB index
# for 200 of them, read on every prepare that is not a hit); version 3 keeps its length and one
# digest of it (``chain_n``, ``chain_xxh64``), and still reads a version 2 ``chain``. A newer version reads too: what
# this ocpc knows of it is read, the rest is kept as it was (an upgrade and a downgrade share
# one index; an unknown field is not corruption).
OLDEST_VERSION = 1
KINDS = ("head", "proj", "conv")
# An entry of a kind not in KINDS (a newer ocpc's, read after a downgrade) is not corruption
# either: it is kept as it was written, byte for byte, and never used; gc never deletes it or
# touches its file (``Index.foreign``).


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
    chain: list[str] = field(default_factory=list)  # version 2's chain (the digests in order); now written empty
    chain_n: int = 0  # conv: how many messages the file covers
    chain_xxh64: str = ""  # conv: ``chain_digest`` of those messages' digests, in order
    expires: int = 0  # unix seconds after which the file is useless (proj: the end of its day); 0 never
    text_chars: int = 0  # conv: characters of the rendered prompt its tokens cover (0: unknown)
    text_xxh64: str = ""  # conv: digest of that text, so a request that starts with it tokenizes only the rest
    conversation: str = ""  # conv: the conversation's own name (engine/instances.py; "" in parks of ocpc before 0.2)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # fields of another ocpc version, kept

    def to_json(self) -> dict[str, Any]:
        data = {name: value for name, value in asdict(self).items() if name != "extra"}
        return {**self.extra, **data}

    def covers(self) -> tuple[int, str]:
        """(how many messages, their chain's digest): from the compact fields, or from a version 2
        entry's whole chain."""
        if self.chain:
            return len(self.chain), chain_digest(self.chain)
        return self.chain_n, self.chain_xxh64


def chain_digest(digests: Sequence[str]) -> str:
    """One digest of a message chain (the messages' own digests in order, each 16 hex digits)."""
    return xxhash.xxh64_hexdigest("".join(digests).encode())


def prefix_digests(digests: Sequence[str], lengths: set[int]) -> dict[int, str]:
    """``chain_digest(digests[:n])`` for every ``n`` in ``lengths`` (up to ``len(digests)``), in one
    pass: a request is checked against every park's chain without a digest list per park."""
    out: dict[int, str] = {}
    running = xxhash.xxh64()
    if 0 in lengths:
        out[0] = running.hexdigest()
    for i, digest in enumerate(digests, start=1):
        running.update(digest.encode())
        if i in lengths:
            out[i] = running.hexdigest()
    return out


_ENTRY_FIELDS = frozenset(f.name for f in fields(Entry)) - {"extra"}
_INDEX_FIELDS = frozenset({"version", "entries", "current", "current_seen"})


@dataclass
class Index:
    entries: dict[str, Entry] = field(default_factory=dict)
    current: dict[str, str] = field(default_factory=dict)  # slot key -> fingerprint
    # slot key -> unix seconds a running ocpc last saw that slot on its server: a key no ocpc
    # has seen for days (a port or a slot count no longer in use) stops protecting its file
    current_seen: dict[str, int] = field(default_factory=dict)
    version: int = INDEX_VERSION  # a newer ocpc's number is kept, so it never reads as older
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # another version's top-level fields
    # key -> an entry of a kind this ocpc does not know (a newer version's), exactly as read: no
    # code looks at it (it is not in ``entries``), it is written back unchanged, and gc leaves it
    # and its file alone (``foreign_files``). An entry of ours under the same key wins.
    foreign: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        ours = {fp: e.to_json() for fp, e in self.entries.items()}
        kept = {fp: raw for fp, raw in self.foreign.items() if fp not in ours}
        return {
            **self.extra,
            "version": max(self.version, INDEX_VERSION),
            "entries": dict(sorted((ours | kept).items())),
            "current": dict(sorted(self.current.items())),
            "current_seen": dict(sorted(self.current_seen.items())),
        }

    def foreign_files(self) -> frozenset[str]:
        """The file names entries of unknown kinds give (a string ``file`` field): never ours to delete."""
        return frozenset(
            raw["file"]
            for fp, raw in self.foreign.items()
            if fp not in self.entries and isinstance(raw.get("file"), str)
        )

    def mark_current(self, slot: str, key: str, *, now: int | None = None) -> None:
        self.current[slot] = key
        self.current_seen[slot] = int(time.time()) if now is None else now

    def server_alive(self, server: str, n_slots: int, *, now: int) -> list[str]:
        """A running ocpc sees ``server`` with ``n_slots`` slots: its keys are fresh, and the keys
        of its slots that no longer exist (``-np 4`` -> ``-np 1``) are dropped. Returns those."""
        gone = []
        for slot in list(self.current):
            parsed = parse_slot_key(slot)
            if parsed is None or parsed[0] != server.rstrip("/"):
                continue
            if parsed[1] >= n_slots:
                gone.append(slot)
                self.current.pop(slot)
                self.current_seen.pop(slot, None)
            else:
                self.current_seen[slot] = now
        return gone

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> Index:
        version = data.get("version") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < OLDEST_VERSION:
            raise IndexCorrupt(f"{source}: not an ocpc index (no version {OLDEST_VERSION} or later)")
        entries_raw, current_raw = data.get("entries"), data.get("current", {})
        seen_raw = data.get("current_seen", {})
        if not all(isinstance(v, dict) for v in (entries_raw, current_raw, seen_raw)):
            raise IndexCorrupt(f"{source}: 'entries', 'current' and 'current_seen' must be objects")
        entries: dict[str, Entry] = {}
        foreign: dict[str, dict[str, Any]] = {}
        for fp, raw in entries_raw.items():
            if is_foreign(raw):
                foreign[fp] = raw
                continue
            entry = _entry(raw, fp, source)
            if kind_of(entry.file) != entry.kind:
                raise IndexCorrupt(f"{source}: entry {fp!r} names {entry.file!r}, not an ocpc {entry.kind} file")
            entries[fp] = entry
        current = {str(k): str(v) for k, v in current_raw.items()}
        seen = {str(k): v for k, v in seen_raw.items() if isinstance(v, int) and not isinstance(v, bool)}
        extra = {k: v for k, v in data.items() if k not in _INDEX_FIELDS}
        return cls(entries=entries, current=current, current_seen=seen, version=version, extra=extra, foreign=foreign)


def is_foreign(raw: Any) -> bool:
    """An entry of a kind this ocpc does not know: an object whose ``kind`` is a string not in
    KINDS. Nothing else of it is checked (a newer kind may name any file, with any fields)."""
    return isinstance(raw, dict) and isinstance(raw.get("kind"), str) and raw["kind"] not in KINDS


def _entry(raw: Any, fp: str, source: str) -> Entry:
    """One entry, with every field of the type the dataclass says, or IndexCorrupt.

    Fields this ocpc does not know (written by another version) are kept as they are; a
    missing field that has a default takes it; a missing one without (the file) is corrupt.
    """
    if not isinstance(raw, dict):
        raise IndexCorrupt(f"{source}: entry {fp!r} is not an object")
    known = {k: v for k, v in raw.items() if k in _ENTRY_FIELDS}
    try:
        entry = Entry(**known, extra={k: v for k, v in raw.items() if k not in _ENTRY_FIELDS})
    except TypeError as exc:
        raise IndexCorrupt(f"{source}: entry {fp!r} is malformed ({exc})") from exc
    for name, kind in (
        ("file", str),
        ("bytes", int),
        ("prefix_tokens", int),
        ("created", int),
        ("last_used", int),
        ("model", str),
        ("server_build", str),
        ("harness", str),
        ("xxh64", str),
        ("kind", str),
        ("identity", str),
        ("head", str),
        ("session", str),
        ("chain", list),
        ("chain_n", int),
        ("chain_xxh64", str),
        ("expires", int),
        ("text_chars", int),
        ("text_xxh64", str),
        ("conversation", str),
    ):
        value = getattr(entry, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise IndexCorrupt(f"{source}: entry {fp!r} has {name}={value!r}, expected {kind.__name__}")
    if entry.kind not in KINDS or not all(isinstance(d, str) for d in entry.chain):
        raise IndexCorrupt(f"{source}: entry {fp!r} has kind {entry.kind!r} or a chain that is not strings")
    return entry


def slot_key(base_url: str, slot: int) -> str:
    """How ``current`` names a slot: the server URL and the slot id."""
    return f"{base_url.rstrip('/')}#slot{slot}"


def parse_slot_key(key: str) -> tuple[str, int] | None:
    """``slot_key``'s (server URL, slot id), or None for a key in another form."""
    url, sep, slot = key.rpartition("#slot")
    return (url, int(slot)) if sep and slot.isdigit() else None


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
                f"{self.index_path} is not valid JSON ({exc}); fix or move it away, cleanup stays off until then"
            ) from exc
        return Index.from_json(data, source=str(self.index_path))

    def save(self, index: Index) -> None:
        """Atomic replace: readers see the old index or the new one, never half of one."""
        try:
            write_private(self.index_path, (json.dumps(index.to_json(), indent=1) + "\n").encode())
        except OSError as exc:
            raise StoreError(f"cannot write {self.index_path}: {exc}") from exc

    def update(self, change: Callable[[Index], None], *, timeout: float | None = None) -> Index:
        """Load, change and save the index under the lock; returns the saved index."""
        with self.locked(timeout=timeout):
            index = self.load()
            change(index)
            self.save(index)
            return index


ALIVE_EVERY_S = 3600.0  # how often a running ocpc writes that its server's slots still exist


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
        self._alive: tuple[str, int] | None = None  # (server, slots) seen running since the last flush
        self._last_flush = time.monotonic()
        self._last_alive = float("-inf")

    def note(self, key: str, *, slot: str | None = None, when: int | None = None) -> None:
        with self._guard:
            self._used[key] = max(self._used.get(key, 0), int(time.time()) if when is None else when)
            if slot is not None:
                self._current[slot] = key

    def alive(self, server: str, n_slots: int) -> None:
        """The server answers with ``n_slots`` slots: its current keys are written fresh (at least
        every ``ALIVE_EVERY_S``, even with no use), so gc never takes them for a gone server's."""
        with self._guard:
            self._alive = (server, n_slots)

    def due(self) -> bool:
        with self._guard:
            now = time.monotonic()
            if self._alive is not None and now - self._last_alive >= ALIVE_EVERY_S:
                return True
            return bool(self._used or self._current) and now - self._last_flush >= self.interval

    def flush_or_keep(self) -> None:
        """``flush``, where a failure is logged and the uses kept for the next try (nobody waits
        on these writes: a request's answer never depends on them)."""
        try:
            self.flush()
        except OcpcError as exc:
            log.warning("could not record file uses in the index (kept for the next try): %s", exc)

    def flush(self, *, timeout: float | None = 10.0) -> None:
        """Write the noted uses (entries that no longer exist are skipped); StoreError on failure."""
        with self._guard:
            used, current, alive = dict(self._used), dict(self._current), self._alive
            self._used.clear()
            self._current.clear()
            self._alive = None
            self._last_flush = time.monotonic()
            if alive is not None:
                self._last_alive = self._last_flush
        if not used and not current and alive is None:
            return
        now = int(time.time())

        def change(index: Index) -> None:
            for key, when in used.items():
                entry = index.entries.get(key)
                if entry is not None and when > entry.last_used:
                    entry.last_used = when
            for slot, key in current.items():
                if key in index.entries:
                    index.mark_current(slot, key, now=now)
            if alive is not None:
                for slot in index.server_alive(*alive, now=now):
                    log.info("%s no longer exists on its server: its current mark is dropped", slot)

        try:
            self.store.update(change, timeout=timeout)
        except (StoreError, LockTimeout):
            with self._guard:  # keep them for the next try
                for key, when in used.items():
                    self._used[key] = max(self._used.get(key, 0), when)
                for slot, key in current.items():
                    self._current.setdefault(slot, key)
                if alive is not None and self._alive is None:
                    self._alive = alive
            raise
