"""The executor: carry out the decision's action on a slot, behind the gates, in the deadline.

Gates (see engine/gates.py) before a restore: the file's own token list must equal the head's
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from oc_prefix_cache.deadline import SLOT_CHANGE_MARGIN_S, Deadline
from oc_prefix_cache.disk.index import Entry, Index, Store, slot_key
from oc_prefix_cache.disk.slotfile import KNOWN_VERSIONS, file_digest, part_name, read_header, slot_filename
from oc_prefix_cache.engine.gates import header_gate, prefix_gate, probe_gate, untouched
from oc_prefix_cache.engine.planner import PROBE_TOKENS, HeadPlan
from oc_prefix_cache.engine.tracker import Observation, SlotTracker
from oc_prefix_cache.errors import (
    Contended,
    GateFailed,
    OcpcError,
    ServerError,
    SlotFileError,
    SlotRestoreFailed,
    StoreError,
)
from oc_prefix_cache.files import chmod_private
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import ServerIdentity, server_key

log = logging.getLogger("ocpc.executor")
INDEX_WAIT_S = 2.0  # the longest a prepare waits for the index lock (another daemon or gc holds it)


@dataclass
class SaveCosts:
    """What a save costs on this server, learned from every save it made: bytes per token
    (from the largest save, where a hybrid's fixed recurrent state weighs least) and seconds
    per byte (from the latest save, the server's write and ocpc's digest together). Why: a
    park is decided before it is written (does it fit the park cap? is writing it now worth
    more than re-prefilling later?), and a 27B's 30k-token park is ~3 GB."""

    bytes_per_token: float | None = None
    seconds_per_byte: float | None = None
    largest_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def saw(self, *, tokens: int, size: int, seconds: float) -> None:
        if tokens <= 0 or size <= 0:
            return
        with self._lock:
            if tokens >= self.largest_tokens:
                self.largest_tokens, self.bytes_per_token = tokens, size / tokens
            self.seconds_per_byte = seconds / size

    def bytes_for(self, tokens: int) -> int | None:
        with self._lock:
            return None if self.bytes_per_token is None else round(tokens * self.bytes_per_token)

    def seconds_for(self, tokens: int) -> float | None:
        size = self.bytes_for(tokens)
        with self._lock:
            return None if size is None or self.seconds_per_byte is None else size * self.seconds_per_byte


@dataclass(frozen=True)
class Done:
    action: str  # "hit" | "restored" | "warmed"
    reason: str
    exact: bool  # the slot holds exactly a prefix ocpc made (else that prefix plus the probe)
    tokens: tuple[int, ...] = ()  # what the slot now holds, when ocpc put it there
    probe: int = 0  # how many of ``tokens`` are the probe's, after the prefix (fewer than
    # PROBE_TOKENS when the request ends sooner)
    proved: bool = False  # the probe gate passed: the server reused this restore


@dataclass(frozen=True)
class Prefix:
    """A file's worth of tokens: a head, a project head or a parked conversation."""

    kind: str  # "head" | "proj" | "conv"
    key: str
    tokens: tuple[int, ...]  # expected tokens (heads, project heads); () for a park (its header says)


class Executor:
    """Slot actions for one server. Stateless beyond its collaborators; thread-safe."""

    def __init__(
        self,
        *,
        client: SlotClient,
        tracker: SlotTracker,
        store: Store,
        slot_dir: Path,
        on_saved: Callable[[], None] = lambda: None,
        known: frozenset[int] = KNOWN_VERSIONS,
    ) -> None:
        self.client = client
        self.known = known  # slot-file versions read as known (an unknown one fails for good at its first gate)
        self.tracker = tracker
        self.store = store
        self.slot_dir = slot_dir
        self.costs = SaveCosts()
        self.server = client.server_id
        self._on_saved = on_saved  # e.g. schedule gc off the request path

    def observe(self, slot: int, *, deadline: Deadline | None = None) -> Observation:
        for info in self.client.slots(deadline=deadline):
            if info.get("id") == slot:
                return Observation.of(info)
        raise OcpcError(
            f"llama-server at {self.server} has no slot {slot}; set OC_PREFIX_CACHE_SLOT to one of its slots"
        )

    # -- restore ---------------------------------------------------------------------------
    def restore(
        self,
        prefix: Prefix,
        plan: HeadPlan,
        slot: int,
        *,
        prove: bool,
        before: Observation,
        epoch: int,
        deadline: Deadline,
        witnessed: bool = False,
        by_request: bool = False,
    ) -> Done:
        """Restore ``prefix``'s file behind the gates.

        Heads and project heads must hold exactly the planned tokens; a park holds whatever
        its conversation had reached, which must be a strict prefix of this request's tokens.
        ``witnessed``: ocpc watches the server's process, so a restart is noticed without a
        task in the slot (see below). ``by_request``: no probe (there is no request yet: a warm
        start); the first real request's report proves the restore, as it does a park's.
        """
        path = self.slot_dir / slot_filename(prefix.key, prefix.kind)
        try:
            header = read_header(path, known=self.known)
            stat = path.stat()
        except (SlotFileError, OSError) as exc:
            raise GateFailed(f"unreadable file: {exc}") from exc
        if not header.known:  # used only once the gates prove it here; a failure is the format's, not the file's
            prove = True
        unknown = None if header.known else header.version

        def failed(message: str, *, probe: bool = False) -> GateFailed:
            return GateFailed(
                message
                if unknown is None
                else f"{message} (slot-file version {unknown}, which this ocpc has not read)",
                probe=probe,
                unknown_version=unknown,
            )

        if prefix.kind == "conv":
            gate = prefix_gate(header.tokens, plan.request_tokens)
            tokens = tuple(header.tokens)
        else:
            gate = header_gate(header.tokens, prefix.tokens)
            tokens = prefix.tokens
        if not gate.ok:
            raise failed(gate.reason)
        key = (path.name, stat.st_size, stat.st_mtime_ns)
        if prove or not self.tracker.proven(self.server, key):
            prove = True
            try:
                self._check_digest(prefix.key, path, deadline=deadline)
            except GateFailed as exc:
                raise failed(str(exc)) from exc
        # see below: without the process as witness, a task must follow a restore on a fresh server
        fresh = before.id_task is None and not witnessed
        prove = prove or fresh
        if (prefix.kind == "conv" or by_request) and not fresh and header.known:
            # A park is this conversation's own exact prefix, under this server's identity,
            # checked token for token against the request and by digest: its reuse is proven
            # by the real request itself (its report), so no probe. Unless the server is fresh
            # and ocpc cannot watch its process: a restore creates no task, and then a slot that
            # holds only a restore looks exactly like the empty slot of a restarted server; the
            # probe's task is what tells them apart.
            started = time.perf_counter()
            try:
                self.client.restore(slot, path.name, deadline=deadline)
            except SlotRestoreFailed as exc:
                raise GateFailed(str(exc)) from exc
            return Done(
                "restored",
                f"restored {_what(prefix.kind)} in {_ms(started)} ms ({gate.reason}; "
                "its reuse is proven by the request)",
                True,
                tokens,
            )
        counter_before = self._prompt_counter(deadline) if prove else None
        started = time.perf_counter()
        try:
            self.client.restore(slot, path.name, deadline=deadline)
        except SlotRestoreFailed as exc:
            raise failed(str(exc)) from exc
        if not prove:
            return Done(
                "restored", f"restored {_what(prefix.kind)} in {_ms(started)} ms (proven on this server)", True, tokens
            )
        probe = plan.request_tokens[len(tokens) : len(tokens) + PROBE_TOKENS]
        timings = self.client.evaluate(list(tokens + probe), slot=slot, deadline=deadline)
        gate = probe_gate(cache_n=timings.cache_n, head_tokens=len(tokens))
        if not gate.ok:
            after = self.observe(slot, deadline=deadline)
            alone = untouched(
                prompt_tokens_before=counter_before,
                prompt_tokens_after=self._prompt_counter(deadline),
                probe_processed=timings.prompt_n,
                probe_tokens=len(tokens) + len(probe),
                after_tokens=after.n_tokens,
                was_busy=before.busy,
            )
            if alone.ok:
                raise failed(f"{gate.reason}; {alone.reason}", probe=True)
            raise Contended(f"{gate.reason}, but {alone.reason}: not blamed on the file")
        self.tracker.prove(self.server, key, epoch=epoch)
        return Done(
            "restored",
            f"restored {_what(prefix.kind)} and gated in {_ms(started)} ms: {gate.reason}",
            False,
            tokens + probe,
            probe=len(probe),
            proved=True,
        )

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
    def warm_head(
        self, plan: HeadPlan, slot: int, *, server: ServerIdentity, epoch: int, why: str, deadline: Deadline
    ) -> Done:
        started = time.perf_counter()
        timings = self.client.evaluate(list(plan.tokens), slot=slot, prefill=True, deadline=deadline)
        final = self.slot_dir / slot_filename(plan.fingerprint)
        digest, size = self.save(slot, final, plan.tokens, deadline=deadline)
        stat = final.stat()
        self.tracker.prove(self.server, (final.name, stat.st_size, stat.st_mtime_ns), epoch=epoch)
        note = self._record_head(plan, final, slot, server, digest, deadline=deadline)
        self._on_saved()
        return Done(
            "warmed",
            f"{why}: prefilled {timings.prompt_n} tokens and saved {size / 1e6:.1f} MB in {_ms(started)} ms{note}",
            True,
            plan.tokens,
        )

    def save(self, slot: int, final: Path, tokens: tuple[int, ...], *, deadline: Deadline) -> tuple[str, int]:
        """Save the slot to ``final`` through a temp name of its own; check it holds ``tokens``.

        Returns (xxh64, size). The temp name carries a random tag, so two servers or daemons
        saving the same key never write one file; a failed save leaves nothing behind.
        """
        part = final.with_name(part_name(final.name, os.urandom(4).hex()))
        started = time.perf_counter()
        try:
            self.client.save(slot, part.name, deadline=deadline)
            header = read_header(part)
            if tuple(header.tokens) != tokens:
                raise SlotFileError(f"{part.name} does not hold the expected {len(tokens)} tokens after saving")
            digest = file_digest(part)
            size = part.stat().st_size
            _keep_private(part)
            part.replace(final)
        except (ServerError, SlotFileError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise OcpcError(f"could not save slot {slot} as {final.name} ({len(tokens)} tokens): {exc}") from exc
        self.costs.saw(tokens=len(tokens), size=size, seconds=time.perf_counter() - started)
        return digest, size

    def _record_head(
        self, plan: HeadPlan, path: Path, slot: int, server: ServerIdentity, digest: str, *, deadline: Deadline
    ) -> str:
        note = self.record(
            Entry(
                file=path.name,
                bytes=path.stat().st_size,
                prefix_tokens=len(plan.tokens),
                created=0,
                last_used=0,
                model=server.model_path,
                server_build=server.build,
                harness=plan.harness,
                xxh64=digest,
                kind="head",
                head=plan.fingerprint,
                identity=server_key(server),  # what another box's head must match (engine/shared.py)
            ),
            key=plan.fingerprint,
            deadline=deadline,
        )
        if not note:
            self._note_current(slot, plan.fingerprint, deadline=deadline)
        return note

    def record(self, entry: Entry, *, key: str, deadline: Deadline) -> str:
        """Write ``entry`` to the index (keeping ``created`` of an older one); a note on failure.

        A record is not worth the caller's budget: gc and status cope with a missing one.
        """
        now = int(time.time())

        def change(index: Index) -> None:
            old = index.entries.get(key)
            index.entries[key] = replace(entry, created=old.created if old else now, last_used=now)

        try:
            self.store.update(change, timeout=min(INDEX_WAIT_S, max(0.1, deadline.remaining() - SLOT_CHANGE_MARGIN_S)))
        except (StoreError, OcpcError) as exc:
            log.error("%s", exc)
            return f" (not recorded in the index: {exc})"
        return ""

    def _note_current(self, slot: int, key: str, *, deadline: Deadline) -> None:
        try:
            self.store.update(
                lambda index: index.mark_current(slot_key(self.server, slot), key),
                timeout=min(INDEX_WAIT_S, max(0.1, deadline.remaining() - SLOT_CHANGE_MARGIN_S)),
            )
        except (StoreError, OcpcError) as exc:
            log.warning("could not mark %s current: %s", key, exc)

    # -- longer prefixes: park a conversation, save a project head ---------------------------
    def save_prefix(self, slot: int, prefix: Prefix, entry: Entry, *, epoch: int, deadline: Deadline) -> Done:
        """Make the slot hold exactly ``prefix.tokens`` and save them under its kind and key.

        The tokens are a prefix of what the slot holds (a conversation's last prompt before its
        generation prompt, or a project head on top of the head), so the server gets there from
        its in-memory checkpoint near the end: a few tokens processed, not a prefill. The save
        goes through a temp name and is checked to hold exactly those tokens, so a request of
        another client that took the slot in between is never saved under this key.
        """
        started = time.perf_counter()
        timings = self.client.evaluate(list(prefix.tokens), slot=slot, prefill=True, deadline=deadline)
        final = self.slot_dir / slot_filename(prefix.key, prefix.kind)
        digest, size = self.save(slot, final, prefix.tokens, deadline=deadline)
        stat = final.stat()
        self.tracker.prove(self.server, (final.name, stat.st_size, stat.st_mtime_ns), epoch=epoch)
        note = self.record(
            replace(
                entry, file=final.name, bytes=size, prefix_tokens=len(prefix.tokens), xxh64=digest, kind=prefix.kind
            ),
            key=prefix.key,
            deadline=deadline,
        )
        self._on_saved()
        return Done(
            "saved",
            f"{_what(prefix.kind)} ({len(prefix.tokens)} tokens: {timings.prompt_n} processed) "
            f"saved, {size / 1e6:.1f} MB in {_ms(started)} ms{note}",
            True,
            prefix.tokens,
        )

    def erase_quietly(self, slot: int, *, deadline: Deadline) -> None:
        try:
            self.client.erase(slot, deadline=deadline)
        except (ServerError, OcpcError) as exc:
            log.warning("could not erase slot %d: %s", slot, exc)


def _keep_private(path: Path) -> None:
    """A slot file decodes to its prompt: 0600 before it takes its name, when it is ours to change
    (a server ocpc did not start writes under its own umask; one of another user keeps its mode)."""
    try:
        chmod_private(path)
    except OSError:
        pass  # the 0700 slot folder still keeps it from other users


def _what(kind: str) -> str:
    return {"head": "the head", "proj": "the project head", "conv": "the parked conversation"}[kind]


def _ms(started: float) -> int:
    return round((time.perf_counter() - started) * 1000)
