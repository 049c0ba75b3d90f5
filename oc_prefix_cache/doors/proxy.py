"""``ocpc proxy``: the front door for agents without a plugin hook (Claude Code, pi, any other).

An agent points its base URL here; every request goes on to llama-server. Chat requests
(``POST /v1/chat/completions``, ``POST /v1/messages``) are prepared first, exactly as the OpenCode
plugin's are (same ``Engine``, same tracker), on a slot chosen by ``engine/affinity.py``; all else
(``/health``, ``/v1/models``, ``/props``, ``/tokenize``, ``count_tokens``, the web UI) passes
untouched. Policies (docs/proxy.md):

* **Fail open.** Whatever goes wrong on our side (a prepare that fails or times out, a slot that
  stays busy past the deadline, a body we cannot parse, a bug), the request is forwarded anyway,
  and the failure is logged and counted (``GET /ocpc/status``). Upstream errors come back as the
  server sent them.
* **The slot is held** from the prepare to the end of the answer (``SlotTracker.hold``), so nothing
  of ours takes it in between; a request waiting for a held slot keeps its own deadline.
* **Prepares run in worker threads**, never on the event loop: a minutes-long warm stalls no stream.
* **Streams pass through as they arrive**, with back-pressure (a slow client slows the upstream
  read); a client that goes away cancels the upstream request (llama-server then stops the task).
  Bounds: connect, waiting for the answer's headers (prompt processing), the gap between chunks;
  none on a whole generation.
* **Not prepared, bytes unchanged**: a body over ``MAX_BODY_BYTES`` (streamed through, never a 413),
  a POST from a web page (an ``Origin`` other than the proxy's own, or a non-loopback ``Host``), a
  body that is not a JSON object (the server's own error comes back), a request whose harness
  adapter is switched off (``OC_PREFIX_CACHE_ADAPTERS``).
* **Anthropic requests** are sent upstream as chat completions (``chat/anthropic.py``, exact) so they
  can be pinned to a slot (b11434 drops ``id_slot`` from ``/v1/messages``), and the answer is
  translated back. The reuse numbers come from the answer itself (``timings``; for Anthropic
  clients the same numbers are the ``message_start`` usage the translator emits) and are reported
  to the engine in-process, which ties the slot's new contents to the conversation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from oc_prefix_cache import __version__
from oc_prefix_cache.chat import responses
from oc_prefix_cache.chat.anthropic import to_chat, upstream_bytes
from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import MAX_BODY_BYTES, Head, Skip, continuing
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.doors.forward import Bounds, Counters, Forwarder
from oc_prefix_cache.doors.guard import NETWORK_ROUTES, PROXY_ROUTES, Guard, Route, route_of
from oc_prefix_cache.doors.relay import (
    Learned,
    Receive,
    Scope,
    Send,
    Watcher,
    dump,
    headers_of,
    learn,
    path_of,
    read_body,
    rest,
    upstream_headers,
)
from oc_prefix_cache.doors.token import TokenFile
from oc_prefix_cache.engine.broker import Ask, Claim, SlotBroker, head_key, returning
from oc_prefix_cache.engine.prepare import PrepareResult
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.engine.wiring import Engine
from oc_prefix_cache.errors import ClientGone, TranslationError
from oc_prefix_cache.harness import (
    Adapter,
    Incoming,
    door_adapters,
    select,
)
from oc_prefix_cache.harness.routing_key import HEADER as ROUTING_HEADER
from oc_prefix_cache.harness.routing_key import routed_adapter
from oc_prefix_cache.settings import ADAPTER_NAMES, Settings

log = logging.getLogger("ocpc.proxy")

API_PATHS = {
    "/v1/chat/completions": "openai",
    "/chat/completions": "openai",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
    "/responses": "responses",
}
#: An Anthropic body too big to prepare is still read whole up to this, to forward it normalised
#: (Claude Code's in-message system entries make b11434 answer HTTP 500 on some templates).
MAX_NORMALISED_BYTES = 64 * 2**20


@dataclass
class Plan:
    """What to send upstream for one API request, and what the prepare said."""

    path: str  # upstream path (with query)
    body: bytes
    translate: bool = False  # an Anthropic request sent as a chat completion
    stream: bool = False
    slot: int | None = None
    result: PrepareResult | None = None
    why_not: str = ""  # why there was no prepare ("" when there was one)
    adapter: str = ""
    rule: str = ""  # the affinity rule that chose the slot
    conversation: str = ""  # the conversation's own name (engine/instances.py; "" for a request with none)
    ready_ms: float = 0.0  # from the request's arrival to its forward (parse, slot, prepare)
    # the answer's last bytes as relayed so far (a 200): what the reuse is learned from, also
    # when the client leaves the moment it has the final event (Codex does, after a restart)
    tail: bytearray = field(default_factory=bytearray)
    answered: bool = False


@dataclass(frozen=True)
class _Request:
    """An API request's facts, parsed once, before a slot is chosen for it."""

    api: str
    path: str
    adapter: Adapter
    body: dict[str, Any]  # as normalised
    chat: dict[str, Any]  # as chat completions (translated from Anthropic)
    chat_raw: bytes  # ``chat`` serialised (the client's bytes when nothing changed): what is prepared
    sent_raw: bytes  # the body as normalised, serialised (the client's bytes when nothing changed)
    changes: bool
    stream: bool
    session: str | None
    conversation: str  # "" for a request with no head worth caching (a title), or one the broker names
    key: ConversationKey | None  # a shared key, named by the broker as it takes the slot
    continuing: bool  # it carries earlier turns of its own (for naming under a shared key)
    n_slots: int
    slot: int | None  # the client's own id_slot
    head_key: str  # the head's cheap key ("" when not cut)


@dataclass(frozen=True)
class NetworkDoor:
    """A box's door beyond loopback (``ocpc launch --listen``): the address it answers to, and the
    deployment's token it asks of every request (doors/guard.py says what it serves)."""

    host: str
    tokens: TokenFile
    #: the names it answers to (``Host``): the address or name it was given, and what that resolves to
    names: frozenset[str] = frozenset()

    @classmethod
    def on(cls, host: str, tokens: TokenFile) -> NetworkDoor:
        names = {host.lower()}
        try:
            names |= {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except OSError:
            pass  # the bind says what is wrong with it
        return cls(host=host, tokens=tokens, names=frozenset(names))


class Proxy:
    """The ASGI application. One per (server, process); the ``Engine`` may be the daemon's."""

    def __init__(
        self,
        *,
        settings: Settings,
        engine: Engine,
        bounds: Bounds | None = None,
        own_origins: frozenset[str] = frozenset(),
        workers: int = 32,
        network: NetworkDoor | None = None,
        beside: Proxy | None = None,
    ) -> None:
        """``beside``: the loopback proxy of the same box, when this is its network door: both count
        and list their requests in one place (its ``/ocpc/status``, since this door serves none)."""
        self.settings = settings
        self.engine = engine
        self.server = engine.server
        self.tracker: SlotTracker = engine.tracker
        self.bounds = bounds or Bounds()
        self.own_origins = own_origins  # the proxy's own URL(s): the server's web UI through the proxy
        self.broker: SlotBroker = engine.broker  # shared with the daemon's front door
        self.counters: Counters = beside.counters if beside is not None else Counters()
        # Two pools: prepares may wait minutes for a held slot; the reports and releases that free
        # those slots must never queue behind them (one pool, all workers waiting: a deadlock until
        # the deadlines ran out)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ocpc-prepare")
        self._releases = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ocpc-release")
        self.forward = Forwarder(server=self.server, bounds=self.bounds, counters=self.counters)
        self._adapters, self._generic = door_adapters(markers=settings.markers, off=settings.normalisations_off)
        self.network = network
        # the last requests, for status and tests
        self._recent: deque[dict[str, Any]] = beside._recent if beside is not None else deque(maxlen=64)
        self._recent_guard: threading.Lock = beside._recent_guard if beside is not None else threading.Lock()

    # -- ASGI ----------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = headers_of(scope)
        self.counters.add("requests")
        kind = route_of(NETWORK_ROUTES if self.network else PROXY_ROUTES, scope["method"], scope["path"])
        refusal = self.guard.judge(kind, headers)
        if refusal is None and self.network is not None:
            headers.pop("authorization", None)  # the deployment's token is ours: llama-server never sees it
        try:
            if refusal is not None:
                self.counters.add(f"refused:{kind.value}")
                challenge = ((b"www-authenticate", b'Bearer realm="ocpc"'),) if refusal.status == 401 else ()
                await self.forward.json_answer(send, refusal.status, {"error": refusal.reason}, extra=challenge)
            elif kind is Route.OWN:
                await self._own(scope, send)
            elif kind is Route.API and scope["method"] == "POST" and scope["path"] in API_PATHS:
                await self._api(scope, receive, send, api=API_PATHS[scope["path"]], headers=headers)
            else:
                self.counters.add("passed_through")
                await self.forward.relay(scope, receive, send, headers=headers, path=path_of(scope), body=None)
        except ClientGone:
            self.counters.add("client_disconnected")

    @property
    def guard(self) -> Guard:
        """This door's guard (doors/guard.py): its own origins are known once its server is bound; a
        network door's names are its address, and its tokens are read as they are now (a rotation
        needs no restart)."""
        if self.network is not None:
            names = self.network.names or frozenset({self.network.host})
            return Guard(hosts=names, own_origins=frozenset(), tokens=self.network.tokens.accepted())
        return Guard(own_origins=self.own_origins)

    async def _own(self, scope: Scope, send: Send) -> None:
        """ocpc's own routes (the guard let the request through)."""
        if scope["path"] == "/ocpc/status" and scope["method"] == "GET":
            await self.forward.json_answer(send, 200, self.status())
        else:
            await self.forward.json_answer(
                send, 404, {"error": f"no such ocpc route: {scope['method']} {scope['path']}"}
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        await self.forward.aclose()

    def close(self) -> None:
        """After the server stopped: the worker threads and the blocking client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "server": self.server,
            "counters": self.counters.snapshot(),
            "slots": self.broker.table.snapshot(),
            "recent": self._recent_list(),
            "prepare": self.engine.status(),
        }

    def _recent_list(self) -> list[dict[str, Any]]:
        with self._recent_guard:
            return list(self._recent)

    # -- chat requests -------------------------------------------------------------------
    async def _api(self, scope: Scope, receive: Receive, send: Send, *, api: str, headers: dict[str, str]) -> None:
        arrived = time.perf_counter()
        # one deadline for the whole request, counted from its arrival: the wait for a planning
        # worker, the wait for a slot and the prepare all draw from it (more requests waiting than
        # workers once got their whole bound again on top of their time in the queue)
        deadline = Deadline.after(self.bounds.prepare_s)
        raw, complete = await read_body(receive, limit=MAX_BODY_BYTES, declared=headers.get("content-length"))
        if not complete:  # too big to prepare: forwarded as it is (normalised when it can be), never a 413
            self.counters.add("not_prepared:oversized")
            if api == "anthropic":
                raw, complete = await read_body(
                    receive, limit=MAX_NORMALISED_BYTES, declared=headers.get("content-length"), first=raw
                )
            body = (
                await asyncio.wrap_future(self._pool.submit(self._unprepared, api, headers, raw))
                if complete
                else rest(raw, receive)
            )  # a parse of up to 64 MiB: off the event loop
            await self.forward.relay(scope, receive, send, headers=headers, path=path_of(scope), body=body)
            return
        refusal = self.guard.foreign(headers)  # a web page's request goes on, never prepared
        if refusal:
            self.counters.add(f"not_prepared:{refusal}")
            await self.forward.relay(scope, receive, send, headers=headers, path=path_of(scope), body=raw)
            return
        # What this request takes (a slot, its hold) is given back in the ``finally`` below, which
        # spans the whole request: from the take to the last byte sent, or to the error.
        claim = Claim(self.broker)
        gone = threading.Event()
        planning = self._pool.submit(self._plan, api, headers, raw, path_of(scope), gone, claim, deadline)
        plan: Plan | None = None
        learned: Learned | None = None
        try:
            watch = asyncio.ensure_future(_until_disconnect(receive, gone))
            try:
                plan = await asyncio.wrap_future(planning)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug of ours: the request goes on unchanged
                log.exception("planning a request failed; forwarding it unchanged")
                self.counters.add("fail_open:internal")
                plan = Plan(
                    path=path_of(scope), body=self._unprepared(api, headers, raw), why_not=f"internal error: {exc}"
                )
            finally:
                watch.cancel()
            plan.ready_ms = (time.perf_counter() - arrived) * 1000
            if gone.is_set():  # left while it waited: nothing to forward, nobody to answer
                self.counters.add("client_disconnected")
                return
            learned = await self._forward(scope, receive, send, headers=headers, plan=plan)
        finally:
            if planning.done():  # shielded: the slot is given back even when this request is cancelled
                await asyncio.shield(asyncio.wrap_future(self._releases.submit(self._finish, plan, learned, claim)))
            else:  # shutting down mid-prepare: nothing more is done for it, and the slot goes back once
                gone.set()  # the planning worker lets go of it (release is thread-safe and idempotent)
                planning.add_done_callback(lambda _: claim.release())

    def _plan(
        self,
        api: str,
        headers: dict[str, str],
        raw: bytes,
        path: str,
        gone: threading.Event,
        claim: Claim,
        deadline: Deadline,
    ) -> Plan:
        """In a worker thread: parse, take a slot, prepare it. ``gone``: set when the client left
        (then nothing is prepared, parked or evicted for it). What it takes goes into ``claim``,
        which the request gives back whatever happens here."""
        request = self._parse(api, headers, raw, path)
        if isinstance(request, Plan):
            return request
        taken = claim.take(self._ask(request), deadline=deadline, gone=gone)
        plan = self._upstream_plan(request, taken.slot)
        plan.rule, plan.conversation = taken.rule, taken.conversation
        if taken.why_not and not gone.is_set():
            self.counters.add("fail_open:slot_busy")
            plan.why_not = taken.why_not
        if gone.is_set():
            self.counters.add("client_gone_before_prepare")
            plan.why_not = "the client went away while its request waited for a slot"
            return plan
        if taken.hold is None:
            return plan
        with taken.hold.inside():
            plan.result = self.engine.prepare(
                request.chat_raw,
                headers,
                slot=plan.slot,
                deadline=deadline,
                harness=request.adapter.name,
                session=request.session or "",
                head_of=request.adapter.head,
                conversation=taken.conversation,
            )
        self.counters.add(f"prepare:{plan.result.action}")
        if plan.result.action == "failed":
            self.counters.add("fail_open:prepare_failed")
        if plan.result.fingerprint:
            self.broker.table.learn_head(request.head_key, plan.result.fingerprint)
        if request.changes:
            self.counters.add("normalised:" + request.adapter.name)
        return plan

    def _parse(self, api: str, headers: dict[str, str], raw: bytes, path: str) -> _Request | Plan:
        """The request's facts, or the plan of a request that is not ours to prepare."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            self.counters.add("not_prepared:not_json")
            return Plan(path=path, body=raw, why_not="the body is not a JSON object: the server answers it")
        incoming, adapter = self._adapter_for(api, headers, data)
        if adapter.name not in self.settings.adapters:  # its harness's adapter is off: hands off its bytes
            self.counters.add("not_prepared:adapter_off")
            return Plan(path=path, body=raw, why_not=f"the {adapter.name} adapter is switched off")
        body, changes = adapter.normalise(incoming)
        stream = bool(body.get("stream"))
        try:
            chat = to_chat(body) if api == "anthropic" else responses.prepared(body) if api == "responses" else body
            # serialised before a slot is taken: a body that cannot be (a lone surrogate) takes none
            sent_raw = dump(body) if changes else raw
            chat_raw = dump(chat) if api in ("anthropic", "responses") else sent_raw
            if "id_slot" in body and not changes:
                dump(body)  # re-serialised with its slot once one is chosen: it must be able to be
        except (TranslationError, ValueError) as exc:  # the server translates it itself, normalised
            self.counters.add("not_prepared:untranslatable")
            forwarded = self._unprepared(api, headers, raw) if api == "anthropic" else raw
            return Plan(path=path, body=forwarded, stream=stream, why_not=f"not translatable: {exc}")
        n_slots = self.broker.n_slots()
        asked = body.get("id_slot", -1) if api in ("openai", "responses") else -1
        client_slot = isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked < n_slots
        if not client_slot and asked != -1:  # -1 (llama.cpp's "any slot") or none: ours to choose
            self.counters.add("not_prepared:unknown_slot")
            return Plan(
                path=path,
                body=raw,
                stream=stream,
                why_not=f"id_slot {asked!r} is not a slot of this server: the server answers it",
            )
        down = self.engine.stood_down()
        if down is not None:  # restores cannot serve here: the request goes as it would without ocpc
            self.counters.add("not_prepared:stood_down")
            if api == "anthropic":
                return Plan(
                    path="/v1/chat/completions",
                    body=upstream_bytes(chat_raw, id_slot=None),
                    translate=True,
                    stream=stream,
                    why_not=f"standing down: {down}",
                )
            return Plan(path=path, body=raw, stream=stream, why_not=f"standing down: {down}")
        key = adapter.key(incoming, chat)
        head = adapter.head(chat)
        side = isinstance(head, Skip)  # a title or summary: no conversation to keep a slot for
        # a shared key is named by the broker as it takes the slot (engine/instances.py): its turns so far
        shared = not side and key.shared
        return _Request(
            api=api,
            path=path,
            adapter=adapter,
            body=body,
            chat=chat,
            chat_raw=chat_raw,
            sent_raw=sent_raw,
            changes=bool(changes),
            stream=stream,
            session=None if key.shared else key.name,
            n_slots=n_slots,
            conversation="" if side or key.shared else key.name,
            key=key if shared else None,
            continuing=shared and isinstance(head, Head) and continuing(chat["messages"], head),
            slot=asked if client_slot else None,
            head_key=head_key(head) if isinstance(head, Head) else "",
        )

    def _adapter_for(self, api: str, headers: dict[str, str], data: dict[str, Any]) -> tuple[Incoming, Adapter]:
        """The request as the adapters see it, and the one that recognises it (else the generic)."""
        incoming = Incoming(api=api, headers=headers, body=data)
        # keyed by ocpc's front before a gateway: the key it sent names the conversation. Read on the
        # network door only, where the deployment's token vouches for it (on loopback, any local
        # program could claim another conversation's key with it)
        routed = routed_adapter(headers.get(ROUTING_HEADER), (*self._adapters, self._generic)) if self.network else None
        if routed is not None:
            return incoming, routed
        return incoming, select(incoming, enabled=ADAPTER_NAMES, adapters=self._adapters, fallback=self._generic)

    def _unprepared(self, api: str, headers: dict[str, str], raw: bytes) -> bytes:
        """The bytes a request that gets no prepare is forwarded with: its harness's documented
        normalisations still apply (a raw Claude Code body has ``role: system`` entries inside its
        messages, which b11434 answers with HTTP 500 on the Qwen3.5 template: a session past the
        body limit failed every turn). Unchanged when nothing applies or anything goes wrong."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                return raw
            incoming, adapter = self._adapter_for(api, headers, data)
            if adapter.name not in self.settings.adapters:
                return raw
            body, changes = adapter.normalise(incoming)
            if not changes:
                return raw
            self.counters.add("normalised_unprepared:" + adapter.name)
            return dump(body)
        except Exception:  # noqa: BLE001 (a fallback must not fail: the bytes as they came)
            log.exception("normalising a request that goes unprepared failed; forwarding it unchanged")
            return raw

    def _ask(self, request: _Request) -> Ask:
        key = request.key
        return Ask(
            conversation=request.conversation,
            head_key=request.head_key,
            n_slots=request.n_slots,
            client_slot=request.slot,
            default_slot=self.settings.slot,
            returning=returning(request.chat),
            key=key,
            raw=request.chat_raw if key else b"",
            continuing=request.continuing,
            rewrites_history=key.rewrites_history if key else False,
        )

    def _upstream_plan(self, request: _Request, slot: int) -> Plan:
        """What goes upstream on ``slot``: pinned to it when the server has several."""
        pinned = request.n_slots > 1
        if request.api == "anthropic":
            up = upstream_bytes(request.chat_raw, id_slot=slot if pinned else None)
            plan = Plan(path="/v1/chat/completions", body=up, translate=True, stream=request.stream, slot=slot)
        else:  # chat completions; a Responses body as it is (b11434 keeps its id_slot: chat/responses.py)
            forwarded = request.sent_raw
            if pinned and request.slot is None:  # the slot prepared is the slot that runs it
                forwarded = (
                    _with_slot(forwarded, slot)
                    if "id_slot" not in request.body
                    else dump({**request.body, "id_slot": slot})
                )
            plan = Plan(path=request.path, body=forwarded, stream=request.stream, slot=slot)
        plan.adapter = request.adapter.name
        return plan

    def _finish(self, plan: Plan | None, learned: Learned | None, claim: Claim) -> None:
        """In a worker thread, after the answer (or the error): report what it reused, then give
        back what the request took. The give-back cannot be skipped: it is this method's
        ``finally``, and this method runs in the request's own ``finally``."""
        try:
            if plan is not None:
                self._remember(plan, learned)
                self._report(plan, learned)
        finally:
            claim.release()

    def _remember(self, plan: Plan, learned: Learned | None) -> None:
        result = plan.result
        with self._recent_guard:
            self._recent.append(
                {
                    "at": time.time(),
                    "path": plan.path,
                    "adapter": plan.adapter,
                    "slot": plan.slot,
                    "rule": plan.rule,
                    "conversation": plan.conversation,
                    "action": result.action if result else None,
                    "prefix_tokens": result.prefix_tokens if result else None,
                    "reason": (result.reason if result else plan.why_not)[:200],
                    "ready_ms": round(plan.ready_ms, 3),
                    "door": "network" if self.network is not None else "loopback",
                    "cache_n": learned.cache_n if learned else None,
                    "prompt_n": learned.prompt_n if learned else None,
                }
            )

    def _report(self, plan: Plan, learned: Learned | None) -> None:
        result = plan.result
        try:
            if result is not None and result.prepare_id and learned is not None and learned.cache_n is not None:
                verdict = self.engine.report(
                    fingerprint=result.fingerprint or "",
                    cache_n=learned.cache_n,
                    prompt_n=learned.prompt_n or 0,
                    prepare_id=result.prepare_id,
                    predicted_n=learned.predicted_n,
                    prompt_ms=learned.prompt_ms,
                    door="proxy",
                )
                self.counters.add(f"report:{verdict['verdict']}")
            elif result is not None and result.prepare_id:
                self.counters.add("report:none")  # cancelled, failed or no timings in the answer
        except Exception:
            log.exception("reporting a request's reuse failed")
            self.counters.add("fail_open:report")

    # -- forwarding ----------------------------------------------------------------------
    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, *, headers: dict[str, str], plan: Plan
    ) -> Learned | None:
        sent = upstream_headers(headers, identity=True)
        if plan.translate:
            sent["content-type"] = "application/json"
        watcher = Watcher(receive)
        try:
            learned = await watcher.run(
                self.forward.stream(scope, send, method="POST", path=plan.path, headers=sent, body=plan.body, plan=plan)
            )
            if learned is None and watcher.gone and plan.answered:  # it left after (part of) a 200 answer
                learned = learn(bytes(plan.tail))
            return learned
        finally:
            if watcher.gone:
                self.counters.add("client_disconnected")


async def _until_disconnect(receive: Receive, gone: threading.Event) -> None:
    """While a request is planned (its body read): note a client that leaves (uvicorn answers
    ``http.disconnect`` again to the forward's own watch afterwards)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


def _with_slot(raw: bytes, slot: int | None) -> bytes:
    """``id_slot`` added as the object's first key, the rest of the bytes as they were."""
    start = raw.find(b"{")
    if slot is None or start < 0:
        return raw
    rest = raw[start + 1 :].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return raw[: start + 1] + b'"id_slot":' + str(slot).encode() + sep + raw[start + 1 :]
