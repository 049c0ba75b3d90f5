"""ocpc's files as a prepare reads them: the index, and each file's state for the decision.

A file is ``MISSING``, ``PRESENT`` (on disk, not yet proven on this server process) or
``PROVEN`` (a restore of exactly this file, same size and mtime, served a request here): a
present file is restored behind its gates, a proven one without the probe. An index that
cannot be read costs this prepare its parks and project heads, never the request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from oc_prefix_cache.disk.index import Index, Store
from oc_prefix_cache.disk.park_files import Park, project_entry
from oc_prefix_cache.disk.slotfile import read_header, slot_filename
from oc_prefix_cache.engine.decision import FileState
from oc_prefix_cache.engine.planner import KnownPrefix
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.errors import SlotFileError, StoreError

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
