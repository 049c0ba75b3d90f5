"""Forwarding one request upstream and its answer back: the part every door shares.

The proxy (doors/proxy.py) forwards what it prepared, the front (doors/front.py) what it keyed; both
stream the answer back as it arrives, with back-pressure, under the same bounds (``Bounds``), and
turn an upstream that is down or silent into a gateway's answer (502, 504) rather than an exception.
One place, so a bound added for one door (a client that stalls, a kept-alive connection the server
closed) holds for every door.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from oc_prefix_cache.chat.anthropic import StreamTranslator
from oc_prefix_cache.chat.head import MAX_BODY_BYTES
from oc_prefix_cache.doors.relay import (
    HOP_BY_HOP,
    Learned,
    Receive,
    Scope,
    Send,
    Watcher,
    learn,
    read_body,
    rest,
    translated_whole,
    upstream_headers,
)
from oc_prefix_cache.doors.upstream import Answer, Upstream
from oc_prefix_cache.errors import ClientGone, OcpcError, UpstreamError, UpstreamStale

log = logging.getLogger("ocpc.proxy")

TAIL_BYTES = 64 * 1024  # the end of an answer, kept to read its timings from


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """How long a door waits for each step; no bound on a whole generation."""

    connect_s: float = 5.0  # llama-server is local: a refused or silent connect is quick to tell
    headers_s: float = 1800.0  # the server answers after processing the prompt: long prompts take minutes
    chunk_gap_s: float = 600.0  # between two chunks of an answer (a long prompt mid-stream, a tool call)
    prepare_s: float = 240.0  # the prepare and the wait for a held slot (then the request goes on anyway)
    slots_ttl_s: float = 30.0  # how long the server's slot count is trusted
    client_stall_s: float = 60.0  # a client that reads nothing this long (a Ctrl-Z'd agent) gives its slot up


@dataclass
class Counters:
    """A door's counters (``/ocpc/status``): thread-safe, since prepares run in worker threads."""

    counts: Counter[str] = field(default_factory=Counter)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str) -> None:
        with self.guard:
            self.counts[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self.guard:
            return dict(sorted(self.counts.items()))


class Relayed(Protocol):
    """What the forwarder reads and writes of a prepared request's plan (``proxy.Plan``)."""

    translate: bool  # an Anthropic request sent as a chat completion: its answer is translated back
    stream: bool
    tail: bytearray  # the answer's last bytes as relayed so far
    answered: bool  # the answer was a 200


class Forwarder:
    """One upstream (an ``http://host:port`` on loopback, or a box behind a gateway), its kept
    connections, the bounds, and the door's counters."""

    def __init__(self, *, server: str, bounds: Bounds, counters: Counters, who: str = "proxy") -> None:
        self.server, self.bounds, self.counters, self.who = server, bounds, counters, who
        self._client: Upstream | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def json_answer(
        self, send: Send, status: int, payload: dict[str, Any], *, extra: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        body = json.dumps(payload).encode()
        await self.send_within(
            send,
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            },
        )
        await self.send_within(send, body_message(body, more=False))

    async def relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        headers: dict[str, str],
        path: str,
        body: bytes | AsyncIterator[bytes] | None,
    ) -> None:
        """Pass a request through unchanged (its body as read so far, or the rest as it comes)."""
        if body is None:
            raw, complete = await read_body(receive, limit=MAX_BODY_BYTES, declared=headers.get("content-length"))
            body = raw if complete else rest(raw, receive)
        streamed = not isinstance(body, bytes)
        watcher = Watcher(receive, after=streamed)
        if streamed:
            body = watcher.track(body)  # type: ignore[arg-type]
        try:
            await watcher.run(
                self.stream(
                    scope,
                    send,
                    method=scope["method"],
                    path=path,
                    headers=upstream_headers(headers, identity=False),
                    body=body,
                    plan=None,
                )
            )
        finally:
            if watcher.gone:
                self.counters.add("client_disconnected")

    async def stream(
        self,
        scope: Scope,
        send: Send,
        *,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | AsyncIterator[bytes],
        plan: Relayed | None,
    ) -> Learned | None:
        upstream = self._http()
        sent = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        for attempt in (1, 2):
            try:
                async with asyncio.timeout(self.bounds.headers_s):
                    response = await upstream.send(method, path, headers=sent, body=body)
                break
            except UpstreamStale as exc:  # a kept-alive connection the server had closed
                if attempt == 1 and isinstance(body, bytes):
                    log.info("llama-server closed an idle connection as it was reused (%s); sending again", exc)
                    continue
                await self.upstream_failed(send, exc)
                return None
            except (UpstreamError, TimeoutError) as exc:
                await self.upstream_failed(send, exc)
                return None
        try:
            return await self.answer(send, response, plan)
        finally:
            await response.aclose()

    async def answer(self, send: Send, response: Answer, plan: Relayed | None) -> Learned | None:
        translate = plan is not None and plan.translate and response.status_code == 200
        dropped = HOP_BY_HOP - {"content-length"} | ({"content-type", "content-length"} if translate else set())
        out_headers = [(k, v) for k, v in response.headers if k.decode("latin-1").lower() not in dropped]
        if translate:
            kind = b"text/event-stream" if plan and plan.stream else b"application/json; charset=utf-8"
            out_headers.append((b"content-type", kind))
        await self.send_within(
            send, {"type": "http.response.start", "status": response.status_code, "headers": out_headers}
        )
        translator = StreamTranslator() if translate and plan and plan.stream else None
        whole = translate and not (plan and plan.stream)
        tail = plan.tail if plan is not None else bytearray()
        if plan is not None:
            plan.answered = response.status_code == 200
        chunks = response.chunks()
        while True:
            try:
                async with asyncio.timeout(self.bounds.chunk_gap_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (UpstreamError, TimeoutError) as exc:
                self.counters.add("upstream_failed:mid_answer")
                log.warning("upstream answer broke off (%s: %s)", type(exc).__name__, exc)
                if translator is not None:
                    await self.send_within(send, body_message(translator.close(), more=True))
                break
            if plan is not None:
                tail += chunk
                if len(tail) > 2 * TAIL_BYTES and not whole:
                    del tail[:-TAIL_BYTES]
            if whole:
                continue
            if translator is not None:
                chunk = translator.feed(chunk)
                if not chunk:
                    continue
            await self.send_within(send, body_message(chunk, more=True))
            await asyncio.sleep(0)  # let a lost connection be noticed before the next write
        last = b""
        if translator is not None:
            last = translator.close()
        elif whole:
            last = translated_whole(bytes(tail))
        await self.send_within(send, body_message(last, more=False))
        return learn(bytes(tail)) if plan is not None and response.status_code == 200 else None

    async def send_within(self, send: Send, message: dict[str, Any]) -> None:
        """One message to the client, bounded: uvicorn's ``send`` waits while the client's socket is
        full, and a client that stopped reading would hold its slot (and every request routed
        there) for ever. Every send of an answer goes through here, the first and the last
        included (an unbounded last send once let a client that stalled just then keep its slot).
        Past the bound the answer is cut and the upstream request cancelled."""
        try:
            async with asyncio.timeout(self.bounds.client_stall_s):
                await send(message)
        except TimeoutError:
            self.counters.add("client_stalled")
            log.warning(
                "the client read nothing for %g s; its answer is cut and its slot freed", self.bounds.client_stall_s
            )
            raise ClientGone() from None

    async def upstream_failed(self, send: Send, exc: BaseException) -> None:
        """The server is down, refused or did not answer in time: say so, as a gateway does."""
        timeout = isinstance(exc, TimeoutError)
        status = 504 if timeout else 502
        self.counters.add("upstream_failed:timeout" if timeout else "upstream_failed:unreachable")
        what = (
            f"llama-server at {self.server} did not answer within {self.bounds.headers_s:g} s"
            if timeout
            else f"cannot reach llama-server at {self.server}: {type(exc).__name__}: {exc}"
        )
        log.warning("%s", what)
        body = json.dumps(
            {
                "error": {
                    "code": status,
                    "type": "proxy_error",
                    "message": f"ocpc {self.who}: {what}; is it running? (`ocpc status`)",
                }
            }
        ).encode()
        await self.send_within(
            send,
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            },
        )
        await self.send_within(send, body_message(body, more=False))

    def _http(self) -> Upstream:
        if self._client is None:
            parts = urlsplit(self.server)
            if parts.scheme != "http" or not parts.hostname:
                raise OcpcError(f"the proxy forwards to a plain http llama-server on this machine, not {self.server}")
            self._client = Upstream(parts.hostname, parts.port or 80, connect_s=self.bounds.connect_s)
        return self._client


def body_message(chunk: bytes, *, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": more}
