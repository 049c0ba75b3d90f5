"""The engine's use of the shared store (disk/shared_store.py): publish what this box saved, bring
what another box saved when this one has none of its own.

Three moments:
- **between requests** (engine/watch.py): ``publish`` copies the files this box's index names into
  its folder of the store, every ``PUBLISH_EVERY_S``; with a store, every conversation is parked
  ahead after each turn (the watch's threshold 0), so a box that dies loses only the turn in flight.
- **at start** (``bring_heads``): the heads every other box warmed, so a new or restarted box
  restores its first request's head instead of prefilling it.
- **on a miss** (``head``, ``park``, ``project``): a request whose head, park or project head this
  box does not have gets another box's, copied into the slot folder and recorded in the local
  index, then restored by the prepare path as any file of its own: behind its gates.
A store that cannot be read or written costs those files, never a request: every failure is
logged and the request goes on as without a store.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Entry, Index, Store
from oc_prefix_cache.disk.park_files import Park, find_park
from oc_prefix_cache.disk.shared_store import Found, SharedStore
from oc_prefix_cache.errors import OcpcError, StoreError

log = logging.getLogger("ocpc.shared")

PUBLISH_EVERY_S = 2.0
INDEX_WAIT_S = 5.0


class SharedFiles:
    """One box's shared store, and the local index its brought files are recorded in."""

    def __init__(self, *, shared: SharedStore, store: Store) -> None:
        self.shared, self.store = shared, store
        self._publishing = threading.Lock()
        self._last_publish = 0.0
        self.counts: dict[str, int] = {"published": 0, "brought": 0, "bring_failed": 0}

    # -- between requests -------------------------------------------------------------------------
    def publish_if_due(self, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._last_publish < PUBLISH_EVERY_S or not self._publishing.acquire(blocking=False):
            return
        try:
            self._last_publish = now
            self.publish()
        finally:
            self._publishing.release()

    def publish(self) -> None:
        try:
            result = self.shared.publish(self.store.load())
        except (OcpcError, OSError) as exc:
            log.warning("publishing to the shared store failed (%s); the next round tries again", exc)
            return
        self.counts["published"] += result.copied

    # -- at start ---------------------------------------------------------------------------------
    def bring_heads(self) -> list[str]:
        """Every head another box published that this box has no file for; what was brought."""
        try:
            local = self.store.load()
        except StoreError as exc:
            log.warning("index unreadable; no heads brought from the shared store: %s", exc)
            return []
        brought = []
        for item in self.shared.others():
            if item.entry.kind == "head" and item.key not in local.entries and item.key not in brought:
                if self._bring(item):
                    brought.append(item.key)
        return brought

    # -- on a miss --------------------------------------------------------------------------------
    def head(self, key: str, *, deadline: Deadline) -> bool:
        """Bring the head ``key`` (its fingerprint) from another box; True when it is here now."""
        return self._bring_key("head", key, deadline=deadline)

    def project(self, key: str, *, deadline: Deadline) -> bool:
        return self._bring_key("proj", key, deadline=deadline)

    def park(
        self, *, identity: str, session: str, digests: tuple[str, ...], local: Park | None, deadline: Deadline
    ) -> Park | None:
        """Another box's park of this conversation when it covers more than ``local`` (this box's
        own, if any), brought here; else ``local``. A conversation the gateway moved (its box died
        or was drained) continues from where it was parked last, wherever that was."""
        if deadline.remaining() <= 0:
            return local
        found = self.shared.others()
        theirs = find_park(self.shared.as_index(found), identity=identity, session=session, digests=digests)
        if theirs is None or (
            local is not None and (local.messages, local.n_tokens) >= (theirs.messages, theirs.n_tokens)
        ):
            return local
        item = next((f for f in found if f.key == theirs.key and f.entry.kind == "conv"), None)
        if item is None or deadline.remaining() <= 0 or not self._bring(item):
            return local
        return theirs

    def _bring_key(self, kind: str, key: str, *, deadline: Deadline) -> bool:
        if deadline.remaining() <= 0:
            return False
        item = next((f for f in self.shared.others() if f.key == key and f.entry.kind == kind), None)
        return item is not None and self._bring(item)

    def _bring(self, item: Found) -> bool:
        entry = self.shared.bring(item)
        if entry is None:
            self.counts["bring_failed"] += 1
            return False
        try:
            self.store.update(lambda index: _record(index, item.key, entry), timeout=INDEX_WAIT_S)
        except (StoreError, OcpcError) as exc:
            log.warning("brought %s from box %s but could not record it: %s", entry.file, item.box, exc)
            return False
        self.counts["brought"] += 1
        log.info("brought %s (%s, %d tokens) from box %s", entry.file, entry.kind, entry.prefix_tokens, item.box)
        return True


def _record(index: Index, key: str, entry: Entry) -> None:
    now = int(time.time())
    index.entries[key] = replace(entry, last_used=now, created=now)
