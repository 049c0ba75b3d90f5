"""The prepare path: make the slot hold the request's stable head, as cheaply as possible.

For one request body, in order of cost:
- ``hit``: the same conversation going on (no server call at all), or a new session
  while the slot still holds this head (one ``GET /slots``);
- ``restored``: a file for this fingerprint exists: header gate, restore, probe gate
  (the probe extends the head with this request's own next tokens, so the slot is left
  holding a strict prefix of the request that follows, and a second restore to "exactly
  the head" would only cost time);
- ``warmed``: first run of this configuration: prefill the head's exact tokens, save,
  record in the index.
Anything else is ``skipped`` (nothing to cache) or ``failed`` (with a reason). The
caller always forwards the real request untouched, whatever we answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from . import __version__
from .errors import (
    BadRequestBody,
    OcpcError,
    ServerError,
    SlotFileError,
    SlotRestoreFailed,
    StoreError,
)
from .files import file_lock
from .fingerprint import FingerprintInputs, ServerIdentity, fingerprint
from .gates import header_gate, likely_cause, probe_gate, served_from_head
from .gc import run_gc
from .head import ChatBody, Head, Skip, extends, extract_head, harness_of, parse_body
from .render import render_head
from .server_info import flag_value, gather_identity, server_argv
from .settings import Settings
from .slot_client import SlotClient
from .slotfile import file_digest, read_header, slot_filename
from .store import Entry, Index, Store, slot_key

log = logging.getLogger("ocpc.prepare")

ACTIONS = ("hit", "restored", "warmed", "skipped", "failed")
# A first miss re-proves the file behind the gates (cheap); a second in a row rebuilds it.
REBUILD_AFTER_MISSES = 2
LOCK_WAIT_S = 240.0  # the plugin waits at most this long for a prepare


@dataclass
class PrepareResult:
    action: str
    fingerprint: str | None = None
    prefix_tokens: int = 0
    elapsed_ms: float = 0.0
    reason: str = ""
    tools_in_head: bool | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["elapsed_ms"] = round(self.elapsed_ms, 3)
        return data


@dataclass(frozen=True)
class HeadPlan:
    """A head resolved against one server: its fingerprint and exact tokens."""

    fingerprint: str
    tokens: tuple[int, ...]
    probe: tuple[int, ...]  # the next tokens of the real prompt, to prove reuse
    tools_in_head: bool
    harness: str
    model: str


@dataclass
class SlotView:
    """What we believe a slot holds, and the evidence to re-check it cheaply."""

    fingerprint: str
    prefix_tokens: int
    session: str
    digests: tuple[str, ...]
    tools_digest: str
    id_task: int | None  # the slot's last task id right after our own work
    exact: bool  # the slot holds exactly the head (no request has run since)


@dataclass
class Stats:
    counters: Counter[str] = field(default_factory=Counter)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    last_report: dict[str, Any] | None = None


class Preparer:
    """One per (daemon, llama-server). Thread-safe; prepares for one slot are serialised."""

    def __init__(self, *, settings: Settings, client: SlotClient, store: Store,
                 server_binary: Path | None = None, runtime: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.client = client
        self.store = store
        self.server_binary = server_binary
        self.stats = Stats()
        self._views: dict[int, SlotView] = {}
        self._plans: dict[str, HeadPlan] = {}  # head key -> plan, for this server identity
        self._plans_for: ServerIdentity | None = None
        self._proven: set[tuple[str, int, int]] = set()  # (fp, size, mtime_ns) gated on this server
        self._misses: Counter[str] = Counter()  # fp -> real requests in a row that missed its head
        self._last_task: dict[int, int | None] = {}  # slot -> highest id_task seen (restart detection)
        self._runtime = runtime  # how `ocpc launch` started the server, when it did
        self._argv: list[str] | None = None
        self._argv_looked_up = False
        self._last: dict[str, PrepareResult] = {}  # fp -> last answer, for reports
        self._guard = threading.Lock()
        self._slot_locks: dict[int, threading.Lock] = {}

    # -- public ------------------------------------------------------------------------
    def prepare(self, raw: bytes, headers: Mapping[str, str]) -> PrepareResult:
        started = time.perf_counter()
        try:
            result = self._prepare(raw, {k.lower(): v for k, v in headers.items()})
        except BadRequestBody as exc:
            result = PrepareResult("skipped", reason=str(exc))
        except OcpcError as exc:
            log.warning("prepare failed open: %s", exc)
            result = PrepareResult("failed", reason=str(exc))
        except Exception as exc:  # never let a bug break the user's request
            log.exception("prepare crashed; failing open")
            result = PrepareResult("failed", reason=f"internal error: {type(exc).__name__}: {exc}")
        result.elapsed_ms = (time.perf_counter() - started) * 1000
        self._record(result)
        return result

    def report(self, *, fingerprint: str, cache_n: int, prompt_n: int) -> dict[str, Any]:
        """Learn from the real request: was it served from the head we prepared?"""
        with self._guard:
            last = self._last.get(fingerprint)
            verdict = "unknown"
            if last is not None and last.action in ("hit", "restored", "warmed"):
                if served_from_head(cache_n=cache_n, prefix_tokens=last.prefix_tokens):
                    verdict = "served"
                    self.stats.counters["report_served"] += 1
                    self._misses.pop(fingerprint, None)
                else:
                    verdict = "missed"
                    self.stats.counters["report_missed"] += 1
                    self._misses[fingerprint] += 1
                    self._proven = {key for key in self._proven if key[0] != fingerprint}
                    for slot in [s for s, v in self._views.items() if v.fingerprint == fingerprint]:
                        del self._views[slot]
                    log.warning(
                        "real request after %s reused %d of %d head tokens: fingerprint %s is suspect; the next "
                        "session %s", last.action, cache_n, last.prefix_tokens, fingerprint,
                        "rebuilds it" if self._misses[fingerprint] >= REBUILD_AFTER_MISSES
                        else "proves its file again behind the gates",
                    )
            self.stats.last_report = {
                "fingerprint": fingerprint, "cache_n": cache_n, "prompt_n": prompt_n,
                "verdict": verdict, "at": time.time(),
            }
            return dict(self.stats.last_report)

    def status(self) -> dict[str, Any]:
        with self._guard:
            return {
                "counters": {a: self.stats.counters.get(a, 0) for a in ACTIONS}
                | {k: v for k, v in self.stats.counters.items() if k not in ACTIONS},
                "events": list(self.stats.events),
                "last_report": self.stats.last_report,
                "slots": {str(s): asdict(v) | {"digests": len(v.digests)} for s, v in self._views.items()},
                "suspect": sorted(self._misses),
            }

    # -- the decision ------------------------------------------------------------------
    def _prepare(self, raw: bytes, headers: dict[str, str]) -> PrepareResult:
        body = parse_body(raw)
        head = extract_head(body, self.settings.markers)
        slot = self.settings.slot
        if isinstance(head, Skip):
            self._forget(slot)  # this request will take the slot with another prompt
            return PrepareResult("skipped", reason=head.reason)
        session = headers.get("x-session-id", "")
        tools_digest = xxhash.xxh64_hexdigest(head.tools_json.encode())
        digests = body.message_digests
        with self._guard:
            view = self._views.get(slot)
            if view is not None and _same_conversation(view, session, digests, tools_digest):
                view.digests, view.exact = digests, False
                return PrepareResult("hit", view.fingerprint, view.prefix_tokens,
                                     reason="same conversation: the slot holds its head")
        continuing = any(m.get("role") == "assistant" for m in body.messages)
        with self._slot_lock(slot):
            return self._prepare_new_session(body, head, headers, slot, session, digests, tools_digest,
                                             continuing=continuing)

    def _prepare_new_session(self, body: ChatBody, head: Head, headers: dict[str, str], slot: int,
                             session: str, digests: tuple[str, ...], tools_digest: str, *,
                             continuing: bool) -> PrepareResult:
        now = self._slot_now(slot)
        restarted = self._notice_restart(slot, now) or now.id_task is None
        if continuing and not restarted:
            # Another conversation's later turn: the server's own cache (its slot or its RAM
            # prompt cache) serves it best; a restore would wipe that for the head alone.
            self._forget(slot)
            return PrepareResult("skipped", reason="a conversation going on: left to the server's own cache")
        server = gather_identity(self.client, binary=self.server_binary, argv=self._server_argv())
        if not server.model_files:
            raise OcpcError(
                f"cannot read the model file llama-server names ({server.model_path or 'none'}); ocpc keys "
                "the cache on its size and mtime, so run the daemon on the server's machine"
            )
        plan = self._plan(body, head, server, harness_of(headers.get("user-agent", "")))
        fp = plan.fingerprint
        n = len(plan.tokens)

        def done(action: str, reason: str, *, exact: bool) -> PrepareResult:
            """Answer, and remember what the slot now holds (``exact``: the head alone)."""
            after = self._slot_now(slot)
            self._notice_restart(slot, after)
            id_task = after.id_task
            with self._guard:
                self._views[slot] = SlotView(fp, n, session, digests, tools_digest, id_task, exact=exact)
            return PrepareResult(action, fp, n, reason=reason, tools_in_head=plan.tools_in_head)

        with self._guard:
            view = self._views.get(slot)
            misses = self._misses.get(fp, 0)
            if misses >= REBUILD_AFTER_MISSES:
                del self._misses[fp]
        if view is not None and view.fingerprint == fp and misses < REBUILD_AFTER_MISSES:
            holds = _slot_holds(now, view, hybrid=server.hybrid)
            if holds:
                return done("hit", holds, exact=view.exact)
        self._forget(slot)  # from here the slot changes: a failure must not leave an old view
        if misses >= REBUILD_AFTER_MISSES:
            self._erase_quietly(slot)  # else a transformer would "rebuild" from the same live cache
            why = f"rebuilt: {misses} real requests in a row missed the head"
            return done("warmed", self._warm(plan, slot, server, why=why), exact=True)
        path = self.settings.slot_dir / slot_filename(fp)
        if path.is_file():
            try:
                reason, exact = self._restore_gated(plan, slot, path)
                return done("restored", reason, exact=exact)
            except _GateFailed as failure:
                step = flag_value(self._server_argv() or [], ("--checkpoint-min-step", "-cms"))
                log.error("restore gate failed for %s: %s; likely cause: %s; rebuilding",
                          path.name, failure, likely_cause(
                              hybrid=server.hybrid, build_info=server.build, head_tokens=n,
                              checkpoint_min_step=int(step) if step and step.isdigit() else None))
                with self._guard:
                    self.stats.counters["gate_failed"] += 1
                self._erase_quietly(slot)
                return done("warmed", self._warm(plan, slot, server, why=f"gate failed ({failure})"),
                            exact=True)
        return done("warmed", self._warm(plan, slot, server, why="first run of this configuration"), exact=True)

    def _server_argv(self) -> list[str] | None:
        """The server's command line (for its KV cache types), looked up once per process."""
        with self._guard:
            if self._argv_looked_up:
                return self._argv
        argv = server_argv(self.client.base_url, runtime=self._runtime)
        with self._guard:
            self._argv, self._argv_looked_up = argv, True
        return argv

    def watch(self) -> None:
        """Check the server for a restart; the daemon calls this every second or so.

        The same-conversation hit path makes no server call, so without this a
        conversation going on after a server restart would be told ``hit`` while the
        slot is empty. Once a restart is seen, that conversation's next turn restores
        the head instead (the slot holds no live state to lose).
        """
        try:
            now = self._slot_now(self.settings.slot)
        except OcpcError:
            return  # down or restarting: the next look tells
        self._notice_restart(self.settings.slot, now)

    def _notice_restart(self, slot: int, now: _SlotNow) -> bool:
        """Forget what a restarted server lost: our views of the slot, and every proof.

        ``id_task`` only grows within one server process and is absent on a fresh one,
        so one that vanished or went down means a restart.
        """
        with self._guard:
            seen = self._last_task.get(slot)
            restarted = seen is not None and (now.id_task is None or now.id_task < seen)
            if restarted or now.id_task is None or seen is None:
                self._last_task[slot] = now.id_task
            else:
                self._last_task[slot] = max(seen, now.id_task)
            if restarted:
                log.info("llama-server restarted (slot %d task id %s -> %s): slot views and proofs dropped",
                         slot, seen, now.id_task)
                self._proven.clear()
                self._views.pop(slot, None)
                self._argv_looked_up = False  # a restart may come with other flags
            return restarted

    # -- the three actions -------------------------------------------------------------
    def _restore_gated(self, plan: HeadPlan, slot: int, path: Path) -> tuple[str, bool]:
        """Restore behind the gates; returns (reason, whether the slot holds the head alone)."""
        try:
            header = read_header(path)
            stat = path.stat()
        except (SlotFileError, OSError) as exc:
            raise _GateFailed(f"unreadable file: {exc}") from exc
        gate = header_gate(header.tokens, plan.tokens)
        if not gate.ok:
            raise _GateFailed(gate.reason)
        key = (plan.fingerprint, stat.st_size, stat.st_mtime_ns)
        if key not in self._proven:
            self._check_digest(plan.fingerprint, path)
        filename = path.name
        started = time.perf_counter()
        self._restore(slot, filename)
        if key in self._proven:
            self._touch(plan, path, slot)
            return f"restored in {_ms(started)} ms (file already proven on this server)", True
        timings = self.client.evaluate(list(plan.tokens + plan.probe), slot=slot)
        gate = probe_gate(cache_n=timings.cache_n, head_tokens=len(plan.tokens))
        if not gate.ok:
            raise _GateFailed(gate.reason)
        with self._guard:
            self._proven.add(key)  # misses stay counted until a real request is served
        self._touch(plan, path, slot)
        return f"restored and gated in {_ms(started)} ms: {gate.reason}", False

    def _check_digest(self, fp: str, path: Path) -> None:
        try:
            entry = self.store.load().entries.get(fp)
        except StoreError as exc:
            log.warning("index unreadable, restoring %s on the probe gate alone: %s", path.name, exc)
            return
        if entry is not None and entry.xxh64:
            try:
                actual = file_digest(path)
            except OSError as exc:
                raise _GateFailed(f"unreadable file: {exc}") from exc
            if actual != entry.xxh64:
                raise _GateFailed(f"file content changed since it was saved (xxh64 {actual} != {entry.xxh64})")

    def _restore(self, slot: int, filename: str) -> None:
        try:
            self.client.restore(slot, filename)
        except SlotRestoreFailed as exc:
            raise _GateFailed(str(exc)) from exc

    def _warm(self, plan: HeadPlan, slot: int, server: ServerIdentity, *, why: str) -> str:
        started = time.perf_counter()
        timings = self.client.evaluate(list(plan.tokens), slot=slot, prefill=True)
        final = self.settings.slot_dir / slot_filename(plan.fingerprint)
        part = final.with_name(final.name + ".part")
        try:
            self.client.save(slot, part.name)
            header = read_header(part)
            if tuple(header.tokens) != plan.tokens:
                raise SlotFileError(f"{part.name} does not hold the head's tokens after saving")
            digest = file_digest(part)
            part.replace(final)
        except (ServerError, SlotFileError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise OcpcError(f"warmed the slot ({len(plan.tokens)} tokens) but could not save it: {exc}") from exc
        stat = final.stat()
        with self._guard:
            self._proven.add((plan.fingerprint, stat.st_size, stat.st_mtime_ns))
        note = self._record_entry(plan, final, slot, server, digest)
        self._collect_garbage()
        return (f"{why}: prefilled {timings.prompt_n} tokens and saved {stat.st_size / 1e6:.1f} MB "
                f"in {_ms(started)} ms{note}")

    # -- helpers -----------------------------------------------------------------------
    def _plan(self, body: ChatBody, head: Head, server: ServerIdentity, harness: str) -> HeadPlan:
        key = xxhash.xxh64_hexdigest(
            "\x00".join([head.tools_json, head.system_head, head.marker, head.model, harness]).encode()
        )
        with self._guard:
            if self._plans_for != server:
                self._plans, self._plans_for = {}, server
            cached = self._plans.get(key)
        if cached is not None:
            return cached
        rendered = render_head(self.client, body, head)
        plan = HeadPlan(
            fingerprint=fingerprint(FingerprintInputs(
                server=server, harness=harness, ocpc_version=__version__, head=head,
                rendered_head=rendered.head_text,
            )),
            tokens=rendered.tokens, probe=rendered.probe,
            tools_in_head=rendered.tools_in_head, harness=harness, model=head.model,
        )
        with self._guard:
            self._plans[key] = plan
        return plan

    def _record_entry(self, plan: HeadPlan, path: Path, slot: int, server: ServerIdentity,
                      digest: str) -> str:
        now = int(time.time())

        def change(index: Index) -> None:
            old = index.entries.get(plan.fingerprint)
            index.entries[plan.fingerprint] = Entry(
                file=path.name, bytes=path.stat().st_size, prefix_tokens=len(plan.tokens),
                created=old.created if old else now, last_used=now,
                model=server.model_path, server_build=server.build, harness=plan.harness,
                xxh64=digest,
            )
            index.current[slot_key(self.settings.base_url, slot)] = plan.fingerprint

        try:
            self.store.update(change)
        except StoreError as exc:
            log.error("%s", exc)
            return f" (not recorded: {exc})"
        return ""

    def _collect_garbage(self) -> None:
        """The same policy as `ocpc gc`, after each save: disk use stays bounded by itself."""
        try:
            plan = run_gc(self.settings, dry_run=False)
        except (OcpcError, OSError) as exc:  # cleanup must never fail a prepare
            log.error("gc after save failed: %s", exc)
            return
        if plan.disabled:
            log.error("gc after save: %s", plan.disabled)
        for decision in plan.to_delete:
            log.info("gc deleted %s: %s", decision.name, decision.reason)

    def _touch(self, plan: HeadPlan, path: Path, slot: int) -> None:
        now = int(time.time())

        def change(index: Index) -> None:
            entry = index.entries.get(plan.fingerprint)
            if entry is not None:
                entry.last_used = now
            index.current[slot_key(self.settings.base_url, slot)] = plan.fingerprint

        try:
            self.store.update(change)
        except StoreError as exc:
            log.error("could not record the use of %s: %s", path.name, exc)

    def _slot_now(self, slot: int) -> _SlotNow:
        for info in self.client.slots():
            if info.get("id") == slot:
                id_task, n_tokens = info.get("id_task"), info.get("n_prompt_tokens")
                return _SlotNow(id_task=id_task if isinstance(id_task, int) else None,
                                n_tokens=n_tokens if isinstance(n_tokens, int) else None)
        raise OcpcError(f"llama-server at {self.client.base_url} has no slot {slot}; "
                        "set OC_PREFIX_CACHE_SLOT to one of its slots")

    def _erase_quietly(self, slot: int) -> None:
        try:
            self.client.erase(slot)
        except ServerError as exc:
            log.warning("could not erase slot %d: %s", slot, exc)

    def _forget(self, slot: int) -> None:
        with self._guard:
            self._views.pop(slot, None)

    @contextmanager
    def _slot_lock(self, slot: int) -> Iterator[None]:
        """Serialise prepares per slot of this server, in this daemon and across daemons.

        Bounded: a prepare that cannot get the slot within LOCK_WAIT_S (another one is
        warming a head) fails open rather than queue past the plugin's patience.
        """
        with self._guard:
            lock = self._slot_locks.setdefault(slot, threading.Lock())
        if not lock.acquire(timeout=LOCK_WAIT_S):
            raise OcpcError(f"slot {slot} is busy with another prepare for over {LOCK_WAIT_S:.0f} s")
        try:
            key = xxhash.xxh64_hexdigest(slot_key(self.client.base_url, slot).encode())
            with file_lock(self.settings.home / f"slot-{key}.lock", timeout=LOCK_WAIT_S):
                yield
        finally:
            lock.release()

    def _record(self, result: PrepareResult) -> None:
        with self._guard:
            self.stats.counters[result.action] += 1
            if result.fingerprint:
                self._last[result.fingerprint] = result
            self.stats.events.append(result.to_json() | {"at": time.time()})
        level = logging.WARNING if result.action == "failed" else logging.INFO
        log.log(level, "%s %s %d tokens %.1f ms: %s", result.action, result.fingerprint,
                result.prefix_tokens, result.elapsed_ms, result.reason)


@dataclass(frozen=True)
class _SlotNow:
    id_task: int | None
    n_tokens: int | None


def _slot_holds(now: _SlotNow, view: SlotView, *, hybrid: bool) -> str | None:
    """Why the slot still serves this head, or None (then a restore is due).

    A slot now holding fewer tokens than the head was taken by a shorter prompt (a title
    request that did not pass through us). A hybrid slot that ran a turn since cannot
    roll back to the head's end (no checkpoint there), a transformer's can.
    """
    if view.id_task is None or now.id_task is None:
        return None
    if now.n_tokens is not None and now.n_tokens < view.prefix_tokens:
        return None
    if now.id_task == view.id_task and view.exact:
        return "the slot holds exactly this head"
    if not hybrid:
        return "the slot holds this head plus a turn; the transformer reuses the common prefix"
    return None


class _GateFailed(OcpcError):
    """A restore that must not be trusted; the caller rebuilds."""



def _same_conversation(view: SlotView, session: str, digests: tuple[str, ...], tools_digest: str) -> bool:
    if view.tools_digest != tools_digest:
        return False
    if session and view.session and session != view.session:
        return False
    return extends(view.digests, digests)


def _ms(started: float) -> int:
    return round((time.perf_counter() - started) * 1000)
