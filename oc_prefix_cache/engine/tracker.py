"""The slot tracker: what each (server, slot) holds as far as ocpc can prove, and restarts.

llama-server says little about a slot (``GET /slots``): the id of the last task that ran
in it, how many tokens it holds, how many of the last prompt were processed and reused,
and whether it is busy. It says nothing about *which* tokens. So ocpc records, every
time it leaves a slot (after its own restore, warm or probe, and after a real request it
saw end), what the slot held and the observation that went with it. The next prepare
trusts that record only if ``/slots`` still shows exactly that observation: any task,
restore or erase by anyone else in between changes it, and the record is forgotten.

Restarts: ``id_task`` only grows within one server process and is absent on a fresh one,
so a missing or smaller one means the server restarted. Everything learnt about that
server (holdings, proofs of files, its command line) belongs to the old process and is
dropped. The prepare path observes the slot on every request, the same-conversation hit
included, so a restart is noticed even by the very request that started the server.

State is keyed by (server URL, slot id); one tracker serves every front door of a
process (the plugin's daemon and the proxy), so none is blind to the other's slot actions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from oc_prefix_cache.chat.conversation import Trail
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.errors import LockTimeout
from oc_prefix_cache.files import file_lock

log = logging.getLogger("ocpc.tracker")


@dataclass(frozen=True)
class Observation:
    """One slot as ``GET /slots`` showed it."""

    id_task: int | None  # last task that ran in the slot; None on a fresh server
    n_tokens: int | None  # tokens in the slot's cache (prompt + generated)
    n_processed: int | None  # of the last task's prompt: tokens processed
    n_cached: int | None  # of the last task's prompt: tokens reused
    busy: bool = False

    @classmethod
    def of(cls, info: dict[str, Any]) -> Observation:
        def whole(key: str) -> int | None:
            value = info.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(
            id_task=whole("id_task"),
            n_tokens=whole("n_prompt_tokens"),
            n_processed=whole("n_prompt_tokens_processed"),
            n_cached=whole("n_prompt_tokens_cache"),
            busy=bool(info.get("is_processing")),
        )

    def same_state(self, other: Observation) -> bool:
        """Nothing ran, was restored or erased in between (busy is not state)."""
        return (self.id_task, self.n_tokens, self.n_processed, self.n_cached) == (
            other.id_task,
            other.n_tokens,
            other.n_processed,
            other.n_cached,
        )

    def after_request(self, *, prompt: int, generated: int | None) -> bool:
        """Could the slot's contents be exactly a request of ``prompt`` tokens that generated
        ``generated`` more? (The server keeps all but the last sampled token; the per-task
        counters are reset when the task ends, so the token count is what is left to check.)
        Without ``generated`` (an older plugin), only that the slot holds at least the prompt."""
        if self.busy or self.n_tokens is None:
            return False
        if generated is None:
            return self.n_tokens >= prompt
        return prompt + generated - 2 <= self.n_tokens <= prompt + generated


@dataclass(frozen=True)
class Holding:
    """What ocpc knows the slot holds, and the observation that vouches for it."""

    kind: str  # "head" | "proj" | "conv" | "side" (a request with no head: nothing to keep)
    key: str  # its key: head fingerprint, project-head key or conversation id
    head: str  # the head fingerprint underneath
    n_tokens: int  # tokens of that reusable prefix
    exact: bool  # the slot holds exactly those tokens (no request ran after ocpc's own step)
    left: Observation  # /slots when ocpc left the slot, or when it saw a real request end
    conversation: str = ""  # the conversation whose request runs or ran in the slot, if known
    stored: int = 0  # tokens of the longest prefix of it already in a file (head, project head, park)


@dataclass
class SlotState:
    holding: Holding | None = None
    trail: Trail | None = None  # the last body of the conversation in the slot
    last_task: int | None = None  # highest id_task seen in this slot (restart detection)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ServerState:
    epoch: int = 0  # bumped on every restart noticed
    slots: dict[int, SlotState] = field(default_factory=dict)
    proven: set[tuple[str, int, int]] = field(default_factory=set)  # (file, size, mtime_ns) on this process
    argv: list[str] | None = None
    argv_known: bool = False
    process: tuple[int, int] | None = None  # (pid, start ticks) of the local server process, when found


@dataclass(frozen=True)
class Seen:
    """The result of one observation: the slot now, and what ocpc may believe of it."""

    now: Observation
    restarted: bool
    holding: Holding | None  # still vouched for by ``now``; None when forgotten or never known
    trail: Trail | None
    epoch: int


class SlotHold:
    """A slot held past one block (``SlotTracker.hold``): the proxy's prepare *and* forward.

    Work done ``inside()`` it, in that thread, re-enters the slot's lock instead of waiting for
    it (the prepare takes the lock for its own steps); anyone else waits. ``release`` once the
    forwarded request has ended, from any thread; a second call does nothing.
    """

    def __init__(
        self, *, key: tuple[str, int], inside: Callable[[], AbstractContextManager[None]], release: Callable[[], None]
    ) -> None:
        self.key = key
        self._inside = inside
        self._release: Callable[[], None] | None = release
        self._guard = threading.Lock()

    def inside(self) -> AbstractContextManager[None]:
        return self._inside()

    def release(self) -> None:
        with self._guard:
            release, self._release = self._release, None
        if release is not None:
            release()


class SlotTracker:
    """Thread-safe; one per process, shared by the daemon and the proxy."""

    MAX_PROOFS = 1024  # files proven per server process; far more than a slot folder holds

    def __init__(self, *, lock_dir: Path | None = None) -> None:
        self._guard = threading.Lock()
        self._servers: dict[str, ServerState] = {}
        self._lock_dir = lock_dir  # where per-slot file locks live, so two processes take turns too
        self._local = threading.local()  # per thread: the slots it works in under a SlotHold

    # -- observations ----------------------------------------------------------------------
    def observe(
        self,
        server: str,
        slot: int,
        now: Observation,
        *,
        process_gone: bool = False,
        process_alive: bool = False,
        witness: tuple[int, int] | None = None,
    ) -> Seen:
        """Record ``now``; notice a restart; keep the holding only if ``now`` vouches for it.

        ``process_gone``: the server process ocpc knew (``witness``) has ended: a restart,
        whatever /slots shows. ``process_alive``: that process is still the one running, so a
        smaller ``id_task`` is not a restart: the server ran a deferred older task (a slot
        action) after a newer one. Without a witness, a smaller id is taken for a restart.
        ``witness``: the process those two were judged on; when another look has meanwhile
        noticed its end (and dropped it), this look's ``process_gone`` is that same restart, not
        another one (which would drop what was recorded since, such as a warm start's restore).
        """
        with self._guard:
            state = self._server(server)
            if process_gone and witness is not None and state.process != witness:
                process_gone = False
            slot_state = state.slots.setdefault(slot, SlotState())
            seen = slot_state.last_task
            dropped = seen is not None and (now.id_task is None or now.id_task < seen)
            restarted = process_gone or (dropped and not process_alive)
            if dropped and not restarted:
                log.debug(
                    "slot %d task id %s -> %s on the same server process: a deferred task", slot, seen, now.id_task
                )
            if restarted:
                why = "its process ended" if process_gone else f"slot {slot} task id {seen} -> {now.id_task}"
                self._restart(server, state, why)
                slot_state = state.slots.setdefault(slot, SlotState())
            if now.id_task is not None:
                slot_state.last_task = max(now.id_task, slot_state.last_task or now.id_task)
            holding = slot_state.holding
            if holding is not None and not holding.left.same_state(now):
                slot_state.holding = holding = None  # something ran, restored or erased since
            return Seen(now=now, restarted=restarted, holding=holding, trail=slot_state.trail, epoch=state.epoch)

    def restarted(self, server: str, why: str) -> None:
        """A restart known from elsewhere (the launcher restarted the server)."""
        with self._guard:
            self._restart(server, self._server(server), why)

    def _restart(self, server: str, state: ServerState, why: str) -> None:
        log.info("llama-server at %s restarted (%s): slot holdings and file proofs dropped", server, why)
        locks = {slot: s.lock for slot, s in state.slots.items()}
        state.epoch += 1
        state.slots = {slot: SlotState(lock=lock) for slot, lock in locks.items()}
        state.proven.clear()
        state.argv, state.argv_known, state.process = None, False, None

    # -- what a slot holds -----------------------------------------------------------------
    def leave(
        self, server: str, slot: int, holding: Holding | None, *, trail: Trail | None = None, epoch: int | None = None
    ) -> None:
        """Record what ocpc left in the slot (None: nothing known). Ignored across a restart."""
        with self._guard:
            state = self._server(server)
            if epoch is not None and epoch != state.epoch:
                return
            slot_state = state.slots.setdefault(slot, SlotState())
            slot_state.holding = holding
            if holding is not None and holding.left.id_task is not None:
                slot_state.last_task = max(holding.left.id_task, slot_state.last_task or holding.left.id_task)
            slot_state.trail = trail

    def forget(self, server: str, slot: int, why: str) -> None:
        with self._guard:
            slot_state = self._server(server).slots.get(slot)
            if slot_state is not None and (slot_state.holding is not None or slot_state.trail is not None):
                log.debug("forgetting what %s slot %d holds: %s", server, slot, why)
                slot_state.holding, slot_state.trail = None, None

    def last_task(self, server: str, slot: int) -> int | None:
        """The newest task id seen in the slot on this server process (None: none yet)."""
        with self._guard:
            slot_state = self._server(server).slots.get(slot)
            return slot_state.last_task if slot_state is not None else None

    def holding(self, server: str, slot: int) -> Holding | None:
        with self._guard:
            slot_state = self._server(server).slots.get(slot)
            return slot_state.holding if slot_state else None

    def trail(self, server: str, slot: int) -> Trail | None:
        with self._guard:
            slot_state = self._server(server).slots.get(slot)
            return slot_state.trail if slot_state else None

    def slots(self, server: str) -> list[int]:
        """The slots of ``server`` ocpc has records for."""
        with self._guard:
            return sorted(self._server(server).slots)

    def epoch(self, server: str) -> int:
        with self._guard:
            return self._server(server).epoch

    def locked(self, server: str) -> list[int]:
        """The slots of ``server`` whose lock some prepare or hold has now (``/ocpc/status``, and the
        tests that check nothing outlives its request)."""
        with self._guard:
            return sorted(slot for slot, state in self._server(server).slots.items() if state.lock.locked())

    def knows(self, server: str) -> bool:
        """Whether ocpc believes anything of this server process: what a slot holds or ran, a
        file proven on it, its process. (What a process that ended takes with it.)"""
        with self._guard:
            state = self._servers.get(server.rstrip("/"))
            if state is None:
                return False
            return bool(
                state.proven
                or state.process
                or any(s.holding is not None or s.trail is not None for s in state.slots.values())
            )

    # -- proofs of files -------------------------------------------------------------------
    def proven(self, server: str, key: tuple[str, int, int]) -> bool:
        with self._guard:
            return key in self._server(server).proven

    def prove(self, server: str, key: tuple[str, int, int], *, epoch: int) -> None:
        with self._guard:
            state = self._server(server)
            if state.epoch == epoch:
                if len(state.proven) >= self.MAX_PROOFS:
                    state.proven.clear()  # a bound, not a cache policy: re-proving costs a probe
                state.proven.add(key)

    def unprove(self, server: str, file: str) -> None:
        """A real request missed what this file should have served: prove it again next time."""
        with self._guard:
            state = self._server(server)
            state.proven = {k for k in state.proven if k[0] != file}

    # -- the server's command line (for the fingerprint's flags) ---------------------------
    def argv(self, server: str) -> tuple[bool, list[str] | None]:
        with self._guard:
            state = self._server(server)
            return state.argv_known, state.argv

    def set_argv(
        self, server: str, argv: list[str] | None, *, epoch: int, process: tuple[int, int] | None = None
    ) -> None:
        with self._guard:
            state = self._server(server)
            if state.epoch == epoch:
                state.argv, state.argv_known, state.process = argv, True, process

    def process(self, server: str) -> tuple[int, int] | None:
        """The server's process as last found (the restart witness), or None."""
        with self._guard:
            return self._server(server).process

    # -- serialising work on a slot --------------------------------------------------------
    @contextmanager
    def slot_lock(
        self, server: str, slot: int, *, deadline: Deadline, gone: threading.Event | None = None
    ) -> Iterator[None]:
        """Hold the slot for a prepare, bounded by the deadline (re-entered inside a ``SlotHold``).
        ``gone``: set when the request's client left; the wait ends then too."""
        if (server.rstrip("/"), slot) in self._held_here():
            yield  # this thread works inside a hold of this slot: it has the slot already
            return
        with self._guard:
            lock = self._server(server).slots.setdefault(slot, SlotState()).lock
        if not _acquire(lock, deadline, gone):
            if gone is not None and gone.is_set():
                raise LockTimeout(f"the client went away while its request waited for slot {slot} of {server}")
            raise LockTimeout(
                f"slot {slot} of {server} stayed busy with another prepare until the caller's "
                "deadline; the request goes on without ocpc"
            )
        try:
            if self._lock_dir is None:
                yield
                return
            name = xxhash.xxh64_hexdigest(f"{server.rstrip('/')}#slot{slot}".encode())
            with file_lock(self._lock_dir / f"slot-{name}.lock", timeout=max(0.0, deadline.remaining())):
                yield
        finally:
            lock.release()

    def hold(self, server: str, slot: int, *, deadline: Deadline, gone: threading.Event | None = None) -> SlotHold:
        """Take the slot (as ``slot_lock`` does, bounded by the deadline, or until ``gone``) and
        keep it until the hold is released: so nothing takes the slot between a prepare and the
        request it served."""
        key = (server.rstrip("/"), slot)
        lock = self.slot_lock(server, slot, deadline=deadline, gone=gone)
        lock.__enter__()  # LockTimeout propagates: nothing taken
        held = self._held_here

        @contextmanager
        def inside() -> Iterator[None]:
            held().add(key)
            try:
                yield
            finally:
                held().discard(key)

        def release() -> None:
            lock.__exit__(None, None, None)

        return SlotHold(key=key, inside=inside, release=release)

    def _held_here(self) -> set[tuple[str, int]]:
        held: set[tuple[str, int]] | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = set()
        return held

    def snapshot(self) -> dict[str, Any]:
        """For ``/v1/status``: per server, its epoch and what each slot holds."""
        with self._guard:
            return {
                url: {
                    "epoch": s.epoch,
                    "proven": len(s.proven),
                    "slots": {str(slot): _holding_json(st.holding) for slot, st in sorted(s.slots.items())},
                }
                for url, s in self._servers.items()
            }

    def _server(self, server: str) -> ServerState:
        return self._servers.setdefault(server.rstrip("/"), ServerState())


def _holding_json(holding: Holding | None) -> dict[str, Any] | None:
    if holding is None:
        return None
    return {
        "kind": holding.kind,
        "key": holding.key,
        "head": holding.head,
        "tokens": holding.n_tokens,
        "exact": holding.exact,
        "conversation": holding.conversation,
        "id_task": holding.left.id_task,
    }


#: How often a wait for a slot's lock looks whether its client left.
GONE_POLL_S = 0.25


def _acquire(lock: threading.Lock, deadline: Deadline, gone: threading.Event | None) -> bool:
    """``lock`` within the deadline; with ``gone``, in slices, giving up once it is set: a request
    whose client left must not wait for the slot it will not use, nor take it from one that will."""
    while True:
        wait = deadline.remaining()
        if wait <= 0 or (gone is not None and gone.is_set()):
            return False
        if lock.acquire(timeout=wait if gone is None else min(wait, GONE_POLL_S)):
            return True
