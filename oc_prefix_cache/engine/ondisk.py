"""ocpc's files as a prepare reads them: the index, and each file's state for the decision.

A file is ``MISSING``, ``PRESENT`` (on disk, not yet proven on this server process) or
``PROVEN`` (a restore of exactly this file, same size and mtime, served a request here): a
present file is restored behind its gates, a proven one without the probe. An index that
cannot be read costs this prepare its parks and project heads, never the request.

A file made before identities were by content (FORMAT 3: docs/design.md, "Identity: what a slot
file means, anywhere") is found under its old name and **adopted** (``adopt``): hard-linked (else
copied) to its new name, its index entry copied under the new key. The old name and entry stay,
so the previous ocpc, run again, still finds its files; the adopted one is restored behind the
same gates as any other (a new name is never proven).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from oc_prefix_cache.disk.index import Index, Store
from oc_prefix_cache.disk.park_files import Park, adopted_entry, project_entry
from oc_prefix_cache.disk.slotfile import part_name, read_header, slot_filename
from oc_prefix_cache.engine.decision import FileState
from oc_prefix_cache.engine.planner import KnownPrefix
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.errors import LockTimeout, SlotFileError, StoreError

log = logging.getLogger("ocpc.prepare")


class OnDisk:
    """The slot folder and the index of one ocpc home, for one server's proofs."""

    def __init__(self, *, slot_dir: Path, store: Store, tracker: SlotTracker, server: str) -> None:
        self.slot_dir, self.store, self.tracker, self.server = slot_dir, store, tracker, server

    def index(self) -> Index | None:
        try:
            return self.store.load()
        except StoreError as exc:
            log.warning("index unreadable, no parks or project heads this time: %s", exc)
            return None

    def state(self, kind: str, key: str) -> FileState:
        name = slot_filename(key, kind)
        try:
            stat = (self.slot_dir / name).stat()
        except OSError:
            return FileState.MISSING
        proof = (name, stat.st_size, stat.st_mtime_ns)
        return FileState.PROVEN if self.tracker.proven(self.server, proof) else FileState.PRESENT

    def project_state(self, index: Index | None, key: str | None) -> FileState:
        """A project head's file counts only while its index entry lives (a day)."""
        if key is None or index is None or project_entry(index, key, now=time.time()) is None:
            return FileState.MISSING
        return self.state("proj", key)

    def known_park(self, park: Park | None) -> KnownPrefix | None:
        """The park's text and tokens (its header, read without the server), so planning a long
        conversation resumed from it tokenizes only what follows it; gated as ever after."""
        if park is None or not park.text_chars:
            return None
        try:
            header = read_header(self.slot_dir / slot_filename(park.key, "conv"))
        except SlotFileError:
            return None  # the restore's own gate says why
        return KnownPrefix(chars=park.text_chars, text_xxh64=park.text_xxh64, tokens=tuple(header.tokens))

    def adopt(self, kind: str, old: str, new: str, *, identity: str, head: str, timeout: float = 1.0) -> bool:
        """Give the file of key ``old`` (made under FORMAT 3's identity) the name of key ``new``:
        a hard link (a copy where links cannot be made), and its index entry, when it has one,
        under ``new`` too (``identity`` and ``head`` its new ones; the old entry stays). False when
        there is no such file, or ``new`` names another file already (never overwritten)."""
        source = self.slot_dir / slot_filename(old, kind)
        target = self.slot_dir / slot_filename(new, kind)
        if old == new or not source.is_file():
            return False
        try:
            _link_or_copy(source, target)
        except FileExistsError:
            if not _same_file(source, target):
                return False  # another file has that name: not ours to replace
        except OSError as exc:
            log.warning("could not adopt %s as %s: %s", source.name, target.name, exc)
            return False

        def change(index: Index) -> None:
            entry = index.entries.get(old)
            if entry is not None and new not in index.entries:
                index.entries[new] = adopted_entry(entry, file=target.name, identity=identity, head=head)

        try:
            self.store.update(change, timeout=timeout)
        except (StoreError, LockTimeout) as exc:  # the file is there, restored behind its gates as ever
            log.warning("adopted %s as %s, but could not record it in the index: %s", source.name, target.name, exc)
        log.info("adopted %s (made by an earlier ocpc) as %s", source.name, target.name)
        return True


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a second name of ``source`` (FileExistsError when taken); a whole copy where
    the file system has no hard links, renamed in place so no reader sees half of it."""
    try:
        os.link(source, target)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    part = target.with_name(part_name(target.name, os.urandom(4).hex()))
    try:
        shutil.copyfile(source, part)
        os.chmod(part, 0o600)
        if target.exists():
            raise FileExistsError(str(target))
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
