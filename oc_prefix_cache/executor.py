"""The executor: carry out the decision's action on a slot, behind the gates, in the deadline.

Gates (see gates.py) before a restore: the file's own token list must equal the head's
(read from its header without the server, because a failed restore wipes the slot), and
the file's digest must match the one recorded when it was saved. After a restore of a
file not yet proven on this server process: a probe (the head plus this request's next
few tokens) must be served >= 90% from cache. Only evidence about the file itself may
condemn it (``GateFailed``): its header, its digest, a refusal to restore, or a failed
probe on a slot nothing else touched. A failed probe on a slot another request touched
is contention (``Contended``): the prepare fails open and the file keeps its standing.

Every server call draws from the prepare's deadline, and none that changes the slot
starts when too little of it is left (deadline.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .deadline import SLOT_CHANGE_MARGIN_S, Deadline
from .errors import OcpcError, ServerError, SlotFileError, SlotRestoreFailed, StoreError
from .fingerprint import ServerIdentity
from .gates import header_gate, probe_gate, untouched
from .planner import HeadPlan
from .slot_client import SlotClient
from .slotfile import file_digest, part_name, read_header, slot_filename
from .store import Entry, Index, Store, slot_key
from .tracker import Observation, SlotTracker

log = logging.getLogger("ocpc.executor")
INDEX_WAIT_S = 2.0  # the longest a prepare waits for the index lock (another daemon or gc holds it)


class GateFailed(OcpcError):
    """Evidence against the file itself: it must be rebuilt."""


class Contended(OcpcError):
    """The probe failed, but another request touched the slot meanwhile: not the file's fault."""


@dataclass(frozen=True)
class Done:
    action: str  # "restored" | "warmed"
    reason: str
    exact: bool  # the slot holds exactly the head's tokens (else the head plus the probe)


class Executor:
    """Slot actions for one server. Stateless beyond its collaborators; thread-safe."""

    def __init__(self, *, client: SlotClient, tracker: SlotTracker, store: Store, slot_dir: Path,
                 on_saved: Callable[[], None] = lambda: None) -> None:
        self.client = client
        self.tracker = tracker
        self.store = store
        self.slot_dir = slot_dir
        self.server = client.base_url
        self._on_saved = on_saved  # e.g. schedule gc off the request path

    def observe(self, slot: int, *, deadline: Deadline | None = None) -> Observation:
        for info in self.client.slots(deadline=deadline):
            if info.get("id") == slot:
                return Observation.of(info)
        raise OcpcError(f"llama-server at {self.server} has no slot {slot}; "
                        "set OC_PREFIX_CACHE_SLOT to one of its slots")

    # -- restore ---------------------------------------------------------------------------
    def restore_head(self, plan: HeadPlan, slot: int, *, prove: bool, before: Observation, epoch: int,
                     deadline: Deadline) -> Done:
        path = self.slot_dir / slot_filename(plan.fingerprint)
        try:
            header = read_header(path)
            stat = path.stat()
        except (SlotFileError, OSError) as exc:
            raise GateFailed(f"unreadable file: {exc}") from exc
        gate = header_gate(header.tokens, plan.tokens)
        if not gate.ok:
            raise GateFailed(gate.reason)
        key = (path.name, stat.st_size, stat.st_mtime_ns)
        if prove or not self.tracker.proven(self.server, key):
            prove = True
            self._check_digest(plan.fingerprint, path, deadline=deadline)
        counter_before = self._prompt_counter(deadline) if prove else None
        started = time.perf_counter()
        try:
            self.client.restore(slot, path.name, deadline=deadline)
        except SlotRestoreFailed as exc:
            raise GateFailed(str(exc)) from exc
        if not prove:
            return Done("restored", f"restored in {_ms(started)} ms (file already proven on this server)", True)
        timings = self.client.evaluate(list(plan.tokens + plan.probe), slot=slot, deadline=deadline)
        gate = probe_gate(cache_n=timings.cache_n, head_tokens=len(plan.tokens))
        if not gate.ok:
            after = self.observe(slot, deadline=deadline)
            alone = untouched(prompt_tokens_before=counter_before,
                              prompt_tokens_after=self._prompt_counter(deadline),
                              probe_processed=timings.prompt_n, probe_tokens=len(plan.tokens) + len(plan.probe),
                              after_tokens=after.n_tokens, was_busy=before.busy)
            if alone.ok:
                raise GateFailed(f"{gate.reason}; {alone.reason}")
            raise Contended(f"{gate.reason}, but {alone.reason}: not blamed on the file")
        self.tracker.prove(self.server, key, epoch=epoch)
        return Done("restored", f"restored and gated in {_ms(started)} ms: {gate.reason}", False)

    def _check_digest(self, fp: str, path: Path, *, deadline: Deadline) -> None:
        try:
            entry = self.store.load().entries.get(fp)
        except StoreError as exc:
            log.warning("index unreadable, restoring %s on the probe gate alone: %s", path.name, exc)
            return
        if entry is not None and entry.xxh64:
            deadline.bound(1.0, what="check the file's digest")
            try:
                actual = file_digest(path)
            except OSError as exc:
                raise GateFailed(f"unreadable file: {exc}") from exc
            if actual != entry.xxh64:
                raise GateFailed(f"file content changed since it was saved (xxh64 {actual} != {entry.xxh64})")

    def _prompt_counter(self, deadline: Deadline) -> float | None:
        try:
            metrics = self.client.metrics(deadline=deadline)
        except ServerError:
            return None
        return None if metrics is None else metrics.get("llamacpp:prompt_tokens_total")

    # -- warm ------------------------------------------------------------------------------
    def warm_head(self, plan: HeadPlan, slot: int, *, server: ServerIdentity, epoch: int, why: str,
                  deadline: Deadline) -> Done:
        started = time.perf_counter()
        timings = self.client.evaluate(list(plan.tokens), slot=slot, prefill=True, deadline=deadline)
        final = self.slot_dir / slot_filename(plan.fingerprint)
        digest, size = self.save(slot, final, plan.tokens, deadline=deadline)
        stat = final.stat()
        self.tracker.prove(self.server, (final.name, stat.st_size, stat.st_mtime_ns), epoch=epoch)
        note = self._record_head(plan, final, slot, server, digest, deadline=deadline)
        self._on_saved()
        return Done("warmed", f"{why}: prefilled {timings.prompt_n} tokens and saved {size / 1e6:.1f} MB "
                    f"in {_ms(started)} ms{note}", True)

    def save(self, slot: int, final: Path, tokens: tuple[int, ...], *, deadline: Deadline) -> tuple[str, int]:
        """Save the slot to ``final`` through a temp name of its own; check it holds ``tokens``.

        Returns (xxh64, size). The temp name carries a random tag, so two servers or daemons
        saving the same key never write one file; a failed save leaves nothing behind.
        """
        part = final.with_name(part_name(final.name, os.urandom(4).hex()))
        try:
            self.client.save(slot, part.name, deadline=deadline)
            header = read_header(part)
            if tuple(header.tokens) != tokens:
                raise SlotFileError(f"{part.name} does not hold the expected {len(tokens)} tokens after saving")
            digest = file_digest(part)
            size = part.stat().st_size
            part.replace(final)
        except (ServerError, SlotFileError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise OcpcError(f"could not save slot {slot} as {final.name} ({len(tokens)} tokens): {exc}") from exc
        return digest, size

    def _record_head(self, plan: HeadPlan, path: Path, slot: int, server: ServerIdentity, digest: str, *,
                     deadline: Deadline) -> str:
        now = int(time.time())

        def change(index: Index) -> None:
            old = index.entries.get(plan.fingerprint)
            index.entries[plan.fingerprint] = Entry(
                file=path.name, bytes=path.stat().st_size, prefix_tokens=len(plan.tokens),
                created=old.created if old else now, last_used=now, model=server.model_path,
                server_build=server.build, harness=plan.harness, xxh64=digest, kind="head", head=plan.fingerprint)
            index.current[slot_key(self.server, slot)] = plan.fingerprint

        try:  # a record is not worth the caller's budget: gc and status cope with a missing one
            self.store.update(change, timeout=min(INDEX_WAIT_S, max(0.1, deadline.remaining() - SLOT_CHANGE_MARGIN_S)))
        except (StoreError, OcpcError) as exc:
            log.error("%s", exc)
            return f" (not recorded in the index: {exc})"
        return ""

    def erase_quietly(self, slot: int, *, deadline: Deadline) -> None:
        try:
            self.client.erase(slot, deadline=deadline)
        except (ServerError, OcpcError) as exc:
            log.warning("could not erase slot %d: %s", slot, exc)


def _ms(started: float) -> int:
    return round((time.perf_counter() - started) * 1000)
