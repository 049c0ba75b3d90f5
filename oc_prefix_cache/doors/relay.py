"""The ASGI plumbing of the proxy: reading a request body, watching for a client that leaves,
relaying a body, and reading an answer's reuse numbers without parsing its text."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.anthropic import dump_json, to_message
from oc_prefix_cache.errors import ClientGone

log = logging.getLogger("ocpc.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_DECODER = json.JSONDecoder()


@dataclass
class Learned:
    """What the answer said about reuse."""

    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    prompt_ms: float | None = None


class Watcher:
    """Runs the forward and cancels it when the client goes away (``http.disconnect``).

    The request body must be read before anyone else calls ``receive``: with a streamed body
    (``after=True``) the watch starts once ``track`` has seen its end.
    """

    def __init__(self, receive: Receive, *, after: bool = False) -> None:
        self._receive = receive
        self._body_done = asyncio.Event()
        if not after:
            self._body_done.set()
        self.gone = False

    async def track(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in body:
            yield chunk
        self._body_done.set()

    async def run(self, work: Awaitable[Learned | None]) -> Learned | None:
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._watch())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():  # the client went away (or we were cancelled): cancel upstream
                self.gone = watch.done() and not watch.cancelled()
                task.cancel()
            watch.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if self.gone:
                log.info("client went away; upstream request cancelled")
                return None
            raise
        except OSError:  # uvicorn's ClientDisconnected: a send after the client left
            self.gone = True
            log.info("client went away mid-answer; upstream request closed")
            return None

    async def _watch(self) -> None:
        await self._body_done.wait()
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return  # (after a complete answer uvicorn says the same: only counts while the task runs)


async def read_body(receive: Receive, *, limit: int, declared: str | None, first: bytes = b"") -> tuple[bytes, bool]:
    """The body, and whether it ended within ``limit`` (else: what was read, for ``rest``).
    ``first``: what an earlier, smaller read already took of it."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return first, False
    parts: list[bytes] = [first]
    size = len(first)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        parts.append(part)
        size += len(part)
        if not message.get("more_body", False):
            return b"".join(parts), True
        if size > limit:
            return b"".join(parts), False


async def rest(first: bytes, receive: Receive) -> AsyncIterator[bytes]:
    if first:
        yield first
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def headers_of(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def path_of(scope: Scope) -> str:
    query: bytes = scope.get("query_string") or b""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    return raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")


def upstream_headers(headers: dict[str, str], *, identity: bool) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones; ``identity``: an uncompressed answer, which
    the proxy reads (any client accepts identity)."""
    out = {k: v for k, v in headers.items() if k not in HOP_BY_HOP}
    if identity:
        out.pop("accept-encoding", None)
    return out


def dump(data: Any) -> bytes:
    """Compact JSON bytes, as the server writes them (``anthropic.dump_json``)."""
    return dump_json(data).encode()


def translated_whole(raw: bytes) -> bytes:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    return dump(to_message(data)) if isinstance(data, dict) else raw


_RESPONSES_USAGE = re.compile(
    rb'"input_tokens":(\d+),"output_tokens":(\d+),"total_tokens":\d+,'
    rb'"input_tokens_details":\{"cached_tokens":(\d+)\}'
)


def _learn_usage(tail: bytes) -> Learned | None:
    """A whole Responses answer has no ``timings``, only its ``usage`` (``input_tokens`` counts
    the reused ones too), in the server's own compact form."""
    found = _RESPONSES_USAGE.findall(tail)
    if not found:
        return None
    prompt, generated, cached = (int(x) for x in found[-1])
    return Learned(cache_n=cached, prompt_n=prompt - cached, predicted_n=generated)


def learn(tail: bytes) -> Learned | None:
    """The reuse numbers of an answer: its last ``timings`` object (a stream's final chunk has it;
    a whole answer has one). Found by position, so a long answer costs no parse of its text."""
    at = tail.rfind(b'"timings":')
    if at < 0:
        return _learn_usage(tail)
    try:
        timings, _ = _DECODER.raw_decode(tail[at + len(b'"timings":') :].decode(errors="replace").lstrip())
    except ValueError:
        return None
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        ms = timings.get("prompt_ms")
        return Learned(
            cache_n=timings["cache_n"],
            prompt_n=timings.get("prompt_n"),
            predicted_n=timings.get("predicted_n"),
            prompt_ms=float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None,
        )
    return None
