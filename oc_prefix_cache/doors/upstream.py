"""The proxy's client to llama-server: HTTP/1.1 over asyncio streams, parsed by h11.

One exchange through ``httpx.AsyncClient`` costs ~1.5 ms of the proxy's time on loopback
against ~0.3 ms over a bare asyncio connection (measured, docs/proxy.md); on a hit that is
most of what the proxy adds to a request. This client does only what the proxy needs:
one upstream (loopback), kept-alive connections in a small pool, a request with a body
(bytes or streamed), the answer's status and headers, then its body as it arrives
(transfer coding removed, content coding left alone). A connection is returned to the pool
only after a whole exchange; one abandoned mid-answer (the client went away) is closed, so
llama-server sees the disconnect and stops the task.

Errors: ``UpstreamError`` (refused, reset, malformed, a connect past ``connect_s``), with
``UpstreamStale`` for a kept-alive connection the server had closed (safe to send again);
``loopback.upstream_errors`` makes them from the library's, here as for every other loopback
call. The caller bounds waiting for headers and chunk gaps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import UpstreamError

READ_SIZE = 65536


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    reused: bool = False

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Connections to one host:port. Not thread-safe: use from one event loop."""

    def __init__(self, host: str, port: int, *, connect_s: float, keep: int = 32) -> None:
        self.host, self.port = host, port
        self.connect_s = connect_s
        self._idle: list[_Conn] = []
        self._keep = keep
        self._authority = f"{host}:{port}".encode()

    async def send(
        self, method: str, target: str, *, headers: list[tuple[bytes, bytes]], body: bytes | AsyncIterator[bytes]
    ) -> Answer:
        conn = await self._connection()
        try:
            with loopback.upstream_errors(self.host, self.port, "exchange", reused=conn.reused):
                await self._write(conn, method, target, headers, body)
                return await self._head(conn)
        except BaseException:
            conn.close()
            raise

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _release(self, conn: _Conn) -> None:
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE and len(self._idle) < self._keep:
            conn.h11.start_next_cycle()
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()

    async def _connection(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        with loopback.upstream_errors(self.host, self.port, "connect"):
            async with asyncio.timeout(self.connect_s):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        return _Conn(reader, writer)

    async def _write(
        self,
        conn: _Conn,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterator[bytes],
    ) -> None:
        fixed = isinstance(body, bytes)
        sent = [(b"host", self._authority), *headers]
        sent.append(
            (b"content-length", str(len(body)).encode())
            if isinstance(body, bytes)
            else (b"transfer-encoding", b"chunked")
        )
        conn.writer.write(conn.h11.send(h11.Request(method=method, target=target, headers=sent)) or b"")
        if fixed:
            assert isinstance(body, bytes)
            if body:
                conn.writer.write(conn.h11.send(h11.Data(data=body)) or b"")
        else:
            assert not isinstance(body, bytes)
            async for part in body:
                if part:
                    conn.writer.write(conn.h11.send(h11.Data(data=part)) or b"")
                    await conn.writer.drain()
        conn.writer.write(conn.h11.send(h11.EndOfMessage()) or b"")
        await conn.writer.drain()

    async def _head(self, conn: _Conn) -> Answer:
        while True:
            event = await _next_event(conn)
            if isinstance(event, h11.Response):
                return Answer(self, conn, event.status_code, list(event.headers))
            if isinstance(event, h11.InformationalResponse):
                continue
            raise UpstreamError(f"unexpected {type(event).__name__} before the answer's headers")


@dataclass
class Answer:
    """An answer whose body is read with ``chunks()``; ``aclose()`` always."""

    upstream: Upstream
    conn: _Conn
    status_code: int
    headers: list[tuple[bytes, bytes]]
    _done: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            with loopback.upstream_errors(self.upstream.host, self.upstream.port, "answer"):
                event = await _next_event(self.conn)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise UpstreamError("the server closed the connection mid-answer")

    async def aclose(self) -> None:
        if self._done:
            self.upstream._release(self.conn)
        else:  # abandoned mid-answer: the server must see the disconnect
            self.conn.close()


async def _next_event(conn: _Conn) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
    while True:
        event = conn.h11.next_event()
        if event is h11.NEED_DATA:
            data = await conn.reader.read(READ_SIZE)
            if not data and conn.h11.their_state is h11.SEND_RESPONSE and conn.h11.our_state is h11.DONE:
                # a broken connection, as the socket would say it (loopback.upstream_errors maps it)
                raise ConnectionResetError("the server closed the connection before answering")
            conn.h11.receive_data(data)
            continue
        return event
