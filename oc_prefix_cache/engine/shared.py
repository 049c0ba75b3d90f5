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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import TypeVar

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Entry, Index, Store, prefix_digests
from oc_prefix_cache.disk.park_files import Park, find_park
from oc_prefix_cache.disk.shared_store import Found, SharedStore
from oc_prefix_cache.errors import OcpcError, StoreError

log = logging.getLogger("ocpc.shared")

PUBLISH_EVERY_S = 2.0
INDEX_WAIT_S = 5.0
#: The most a request waits on the store (a hung network filesystem included): then it goes on
#: without it, as it would with no store (the copy goes on in the background and is used next time).
STORE_WAIT_S = 30.0
T = TypeVar("T")


class SharedFiles:
    """One box's shared store, and the local index its brought files are recorded in."""

    def __init__(self, *, shared: SharedStore, store: Store) -> None:
        self.shared, self.store = shared, store
        self._publishing = threading.Lock()
        self._last_publish = 0.0
        # the store's reads and copies for requests run here: a request waits for them within its
        # deadline and no longer, whatever the filesystem does (a hard-mounted NFS can hang a read)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ocpc-shared")
        self.counts: dict[str, int] = {"published": 0, "brought": 0, "bring_failed": 0, "timed_out": 0}

    # -- between requests -------------------------------------------------------------------------
    def publish_if_due(self, *, now: float | None = None) -> None:
        """Start a publish when one is due and none runs: in a thread of its own, so copying a large
        file never holds up the watch (park ahead, restarts, leases)."""
        now = time.monotonic() if now is None else now
        if now - self._last_publish < PUBLISH_EVERY_S or not self._publishing.acquire(blocking=False):
            return
        self._last_publish = now

        def run() -> None:
            try:
                self.publish()
            finally:
                self._publishing.release()

        threading.Thread(target=run, name="ocpc-publish", daemon=True).start()

    def publish(self) -> None:
        try:
            result = self.shared.publish(self.store.load())
        except (OcpcError, OSError) as exc:
            log.warning("publishing to the shared store failed (%s); the next round tries again", exc)
            return
        self.counts["published"] += result.copied

    # -- at start ---------------------------------------------------------------------------------
    def bring_heads(self, identity: str, *, deadline: Deadline) -> list[str]:
        """Every head another box published for this server's identity (same model content, build,
        KV flags) that this box has no file for; what was brought, within ``deadline``."""
        try:
            local = self.store.load()
        except StoreError as exc:
            log.warning("index unreadable; no heads brought from the shared store: %s", exc)
            return []
        until = time.monotonic() + max(0.0, deadline.remaining())
        brought: list[str] = []
        for item in self.shared.others(until=until):
            wanted = item.entry.kind == "head" and item.entry.identity == identity
            if wanted and item.key not in local.entries and item.key not in brought and self._bring(item, until):
                brought.append(item.key)
        return brought

    # -- on a miss --------------------------------------------------------------------------------
    def head(self, key: str, *, deadline: Deadline) -> bool:
        """Bring the head ``key`` (its fingerprint) from another box; True when it is here now."""
        return self._bounded(lambda until: self._bring_key("head", key, until), deadline, default=False)

    def project(self, key: str, *, deadline: Deadline) -> bool:
        return self._bounded(lambda until: self._bring_key("proj", key, until), deadline, default=False)

    def park(
        self, *, identity: str, session: str, digests: tuple[str, ...], local: Park | None, deadline: Deadline
    ) -> Park | None:
        """Another box's park of this conversation when it covers more of this very request than
        ``local`` (this box's own, if any), brought here; else ``local``. A conversation the gateway
        moved (its box died or was drained) continues from where it was parked last, wherever that
        was. Only a park whose messages are the first messages of this request counts: a stale park
        of a conversation that went on (or was compacted) elsewhere is never brought over a newer one."""
        return self._bounded(
            lambda until: self._park(identity, session, digests, local, until), deadline, default=local
        )

    def _park(
        self, identity: str, session: str, digests: tuple[str, ...], local: Park | None, until: float
    ) -> Park | None:
        found = [f for f in self.shared.others(until=until) if f.entry.kind == "conv" and _prefix_of(f.entry, digests)]
        theirs = find_park(self.shared.as_index(found), identity=identity, session=session, digests=digests)
        if theirs is None or (
            local is not None and (local.messages, local.n_tokens) >= (theirs.messages, theirs.n_tokens)
        ):
            return local
        item = next((f for f in found if f.key == theirs.key), None)
        if item is None or not self._bring(item, until):
            return local
        return theirs

    def _bring_key(self, kind: str, key: str, until: float) -> bool:
        item = next((f for f in self.shared.others(until=until) if f.key == key and f.entry.kind == kind), None)
        return item is not None and self._bring(item, until)

    def _bring(self, item: Found, until: float) -> bool:
        entry = self.shared.bring(item, until=until)
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

    def _bounded(self, work: Callable[[float], T], deadline: Deadline, *, default: T) -> T:
        """``work(until)`` on the store's thread, waited for within the request's deadline (and
        ``STORE_WAIT_S``); past it, ``default``: the request goes on as it would without a store."""
        wait = min(max(0.0, deadline.remaining()), STORE_WAIT_S)
        if wait <= 0:
            return default
        future = self._io.submit(work, time.monotonic() + wait)
        try:
            return future.result(timeout=wait + 0.5)
        except FutureTimeout:
            self.counts["timed_out"] += 1
            log.warning("the shared store did not answer within %.1f s; this request goes on without it", wait)
            return default
        except (OcpcError, OSError) as exc:
            log.warning("the shared store failed (%s); this request goes on without it", exc)
            return default


def _prefix_of(entry: Entry, digests: tuple[str, ...]) -> bool:
    """Whether a park's messages are the first messages of a request (its chain's digest at its
    length), whatever its session says."""
    n, digest = entry.covers()
    return 0 < n <= len(digests) and prefix_digests(digests, {n}).get(n) == digest


def _record(index: Index, key: str, entry: Entry) -> None:
    now = int(time.time())
    index.entries[key] = replace(entry, last_used=now, created=now)
