"""The shared store: heads and parked conversations that move between boxes.

Many boxes (docs/scale.md) may share one folder (``OC_PREFIX_CACHE_SHARED_STORE``: a local disk
for boxes on one machine, an NFS export for several). Each box *publishes* the slot files of its
own index there, and on a miss *brings* another box's file into its own slot folder, where the
prepare path restores it behind the same gates as any file of its own: a copied file is trusted no
more than a local one, and only under the identity it was made with (llama/fingerprint.py: the
model's content, the server's build, the KV flags; never a path, so a box with a copy of the model
elsewhere finds it).

Layout: ``<store>/<box>/`` per box (``box_id``: made once per ocpc home), holding that box's
published files and its ``index.json`` (the entries published, in index.json's own format, so the
previous ocpc reads it too). **One writer per file**: a box writes only its own folder, and reads
the others'. So the store needs no lock, and none is taken: advisory locks (``flock``, ``fcntl``)
are not reliable on every network filesystem (NFSv3 without lockd, some SMB mounts), and a lock a
dead box held would stall the others. Every file is written whole before anyone can see it (a
temp name in the same folder, ``fsync``, ``rename``, ``fsync`` of the folder): a rename in one
folder is atomic on local filesystems and on NFS v3/v4, and NFS's close-to-open consistency gives
a reader that opens the file after the rename all of it. A file is checked against its entry's
xxh64 when it is brought, so a torn or stale copy is never restored. Filesystems whose rename is
not atomic (object-store mounts such as s3fs or gcsfuse) are not supported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from oc_prefix_cache.disk.index import Entry, Index
from oc_prefix_cache.disk.slotfile import PART_RE, is_slot_file_name, part_name, slot_filename
from oc_prefix_cache.errors import StoreError
from oc_prefix_cache.files import private_dir, write_private

log = logging.getLogger("ocpc.shared")

#: The kinds a box publishes: every file that can serve another box's request.
SHARED_KINDS = frozenset({"head", "proj", "conv"})
#: An entry brought from another box carries its box's id here (in ``Entry.extra``): not published again.
FROM_BOX = "from_box"
_BOX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CHUNK = 8 * 2**20
STALE_PART_S = 3600.0  # a temp copy older than this is a dead copier's: removed from the own folder


def box_id(home: Path) -> str:
    """This ocpc home's name in the store: its host and a random part, made once and kept, so two
    boxes never share a folder (two homes on one host included)."""
    path = home / "box-id"
    try:
        value = path.read_text(encoding="utf-8").strip()
        if _BOX_RE.fullmatch(value):
            return value
    except OSError:
        pass
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "box"
    value = f"{host}-{secrets.token_hex(4)}"
    write_private(path, (value + "\n").encode())
    return value


@dataclass(frozen=True)
class Found:
    """An entry another box published, and where its file is."""

    box: str
    key: str
    entry: Entry
    path: Path


@dataclass(frozen=True)
class Published:
    copied: int
    removed: int


class SharedStore:
    """One box's view of the store: its own folder to publish into, the others' to bring from."""

    def __init__(self, root: Path, *, box: str, slot_dir: Path) -> None:
        if not _BOX_RE.fullmatch(box):
            raise StoreError(f"not a box name for the shared store: {box!r}")
        self.root, self.box, self.slot_dir = root, box, slot_dir
        # each other box's index as last read, by its file's stat: a prepare re-reads only what changed
        self._read: dict[str, tuple[tuple[int, int, int], list[Found]]] = {}

    @property
    def own(self) -> Path:
        return self.root / self.box

    # -- publishing: this box's files, into its own folder ----------------------------------------
    def publish(self, index: Index) -> Published:
        """Make the own folder hold exactly the shareable files of ``index`` (``SHARED_KINDS``, made
        here, whole: their xxh64 as recorded). A file being replaced locally right now fails its
        digest and waits for the next round; files no longer in the index leave the store."""
        private_dir(self.own)
        published = self._own_index()
        wanted = {key: entry for key, entry in index.entries.items() if _shareable(entry)}
        copied = 0
        for key, entry in wanted.items():
            before = published.entries.get(key)
            if before is not None and (before.file, before.xxh64) == (entry.file, entry.xxh64):
                published.entries[key] = entry  # its use and times, the file as it is
                continue
            if _copy_checked(self.slot_dir / entry.file, self.own / entry.file, entry.xxh64):
                published.entries[key] = entry
                copied += 1
        for key in [k for k in published.entries if k not in wanted]:
            del published.entries[key]
        keep = {e.file for e in published.entries.values()}
        removed = 0
        now = time.time()
        for path in self.own.iterdir():  # only files named like ours: slot files, and dead copies of them
            stale_part = PART_RE.fullmatch(path.name) is not None and now - _mtime(path) > STALE_PART_S
            if (is_slot_file_name(path.name) and path.name not in keep) or stale_part:
                path.unlink(missing_ok=True)
                removed += 1
        self._write_own_index(published)
        return Published(copied=copied, removed=removed)

    # -- bringing: another box's file, into this box's slot folder --------------------------------
    def others(self, *, until: float | None = None) -> list[Found]:
        """Every entry the other boxes published, newest use first (a box whose index cannot be
        read is skipped and said: it costs this box what that box had, nothing else). ``until``: a
        ``time.monotonic()`` past which the boxes not yet read are left out (a request's deadline)."""
        found: list[Found] = []
        for folder in self._box_folders():
            if until is not None and time.monotonic() > until:
                log.info("the shared store's folders were not all read within the request's deadline")
                break
            if folder.name != self.box:
                found += self._entries_of(folder)
        found.sort(key=lambda f: f.entry.last_used, reverse=True)
        return found

    def _entries_of(self, folder: Path) -> list[Found]:
        path = folder / "index.json"
        try:
            info = path.stat()
        except OSError:
            return []
        stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
        cached = self._read.get(folder.name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            index = Index.from_json(json.loads(path.read_bytes()), source=str(folder))
        except (OSError, ValueError, StoreError) as exc:
            log.warning("the shared store's %s cannot be read (%s); its files are left out", folder, exc)
            return []
        entries = [
            Found(box=folder.name, key=key, entry=entry, path=folder / entry.file)
            for key, entry in index.entries.items()
            if entry.kind in SHARED_KINDS and _named_for(key, entry)
        ]
        self._read[folder.name] = (stamp, entries)
        return entries

    def as_index(self, found: Iterable[Found]) -> Index:
        """The others' entries as one index, for the lookups a local index gets (``find_park``):
        the newest use of a key wins."""
        index = Index()
        for item in found:
            index.entries.setdefault(item.key, item.entry)
        return index

    def bring(self, item: Found, *, until: float | None = None) -> Entry | None:
        """Copy ``item``'s file into the slot folder (whole, checked against its digest, under the
        name its key and kind give: never another file's) and give the entry to record locally;
        None when the copy failed, did not match or ran past ``until`` (nothing is left behind)."""
        if not _named_for(item.key, item.entry):
            return None
        target = self.slot_dir / item.entry.file
        if not _copy_checked(item.path, target, item.entry.xxh64, until=until):
            return None
        extra = {**item.entry.extra, FROM_BOX: item.box}
        return replace(item.entry, chain=list(item.entry.chain), extra=extra)

    # -- the own folder's index ---------------------------------------------------------------------
    def _own_index(self) -> Index:
        try:
            return Index.from_json(json.loads((self.own / "index.json").read_bytes()), source=str(self.own))
        except FileNotFoundError:
            return Index()
        except (OSError, ValueError, StoreError) as exc:  # ours, and not readable: written anew
            log.warning("this box's published index could not be read (%s); publishing it again", exc)
            return Index()

    def _write_own_index(self, index: Index) -> None:
        write_private(self.own / "index.json", json.dumps(index.to_json(), indent=1).encode())

    def _box_folders(self) -> list[Path]:
        try:
            return [p for p in self.root.iterdir() if p.is_dir() and _BOX_RE.fullmatch(p.name)]
        except OSError as exc:
            log.warning("the shared store %s cannot be listed: %s", self.root, exc)
            return []


def _named_for(key: str, entry: Entry) -> bool:
    """Whether ``entry``'s file is the one its key and kind name (an entry naming any other file,
    or a path, is never copied anywhere)."""
    try:
        return entry.file == slot_filename(key, entry.kind)
    except ValueError:
        return False


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _shareable(entry: Entry) -> bool:
    return (
        entry.kind in SHARED_KINDS
        and bool(entry.xxh64)
        and is_slot_file_name(entry.file)
        and FROM_BOX not in entry.extra  # brought here: its own box publishes it
    )


def _copy_checked(source: Path, target: Path, xxh64: str, *, until: float | None = None) -> bool:
    """Copy ``source`` to ``target`` whole (a temp name beside it, as a save's: gc knows it; fsync,
    rename, 0600) when its bytes digest to ``xxh64``; False, nothing left behind, when they do not,
    a read fails, or the copy runs past ``until`` (``time.monotonic()``)."""
    tmp = target.with_name(part_name(target.name, secrets.token_hex(4)))
    digest = xxhash.xxh64()
    try:
        private_dir(target.parent)
        with open(source, "rb") as src, open(tmp, "xb", opener=_private) as out:
            while chunk := src.read(_CHUNK):
                if until is not None and time.monotonic() > until:
                    log.info("copying %s ran past its deadline; left for another time", source)
                    tmp.unlink(missing_ok=True)
                    return False
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if not xxh64 or digest.hexdigest() != xxh64:
            log.info("%s does not match its index entry (being replaced?); not copied", source)
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except OSError as exc:
        log.warning("could not copy %s to %s: %s", source, target, exc)
        tmp.unlink(missing_ok=True)
        return False
    return True


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["FROM_BOX", "SHARED_KINDS", "Found", "Published", "SharedStore", "box_id"]
