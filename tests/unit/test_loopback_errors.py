"""Every loopback call fails with ocpc's errors, made at one edge (oc_prefix_cache/loopback.py):
httpx's at its clients' transport (the request, and the answer's body as it is read), the h11
upstream client's (doors/upstream.py) with the proxy's stale-connection rule.

Real sockets on 127.0.0.1: a tiny threading server whose each connection does what a test says
(answer, hang, close mid-answer). No mock of httpx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.doors.upstream import Upstream
from oc_prefix_cache.errors import ServerHTTPError, ServerTimeout, ServerUnreachable, UpstreamError, UpstreamStale

Handler = Callable[[socket.socket, int], None]  # a connection, and its number (0, 1, ...)


class Sockets:
    """Accepts connections on 127.0.0.1 and hands each to ``handler`` in a thread of its own."""

    def __init__(self, handler: Handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._handler = handler
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self._conns.append(conn)
            number = len(self._conns) - 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        try:
            self._handler(conn, number)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._conns:
            conn.close()
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], Sockets]]:
    started: list[Sockets] = []

    def start(handler: Handler) -> Sockets:
        started.append(Sockets(handler))
        return started[-1]

    yield start
    for server in started:
        server.close()


def read_request(conn: socket.socket) -> bool:
    """One request's head and body off ``conn``; False when the client closed it instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return False
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    while len(body) < length:
        more = conn.recv(65536)
        if not more:
            return False
        body += more
    return True


def answer(status: int = 200, body: bytes = b'{"ok": true}', *, length: int | None = None) -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body) if length is None else length}\r\n\r\n"
    ).encode() + body


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    return f"http://127.0.0.1:{port}"


# -- httpx's, at the clients' transport ----------------------------------------------------------


def test_a_refused_connection_is_server_unreachable() -> None:
    url = refused_url()
    with pytest.raises(ServerUnreachable) as caught:
        loopback.get(f"{url}/slots", timeout=2.0, what="llama-server")
    assert str(caught.value) == f"cannot reach llama-server at {url}/slots: connection refused: is it running?"
    assert isinstance(caught.value.__cause__, httpx.ConnectError)  # the library's, kept as the cause


def test_the_asyncio_client_maps_as_well() -> None:
    url = refused_url()

    async def call() -> None:
        async with loopback.async_client(what="ocpc's proxy") as http:
            await http.get(f"{url}/health")

    with pytest.raises(ServerUnreachable, match="cannot reach ocpc's proxy at .*: connection refused"):
        asyncio.run(call())


def test_a_server_that_never_answers_is_server_timeout_within_the_bound(serve) -> None:
    hung = serve(lambda conn, _: (read_request(conn), time.sleep(10)))
    started = time.monotonic()
    with pytest.raises(ServerTimeout) as caught:
        loopback.get(f"{hung.url}/props", timeout=httpx.Timeout(0.5, connect=0.5), what="llama-server")
    assert time.monotonic() - started < 3.0
    assert str(caught.value).startswith(f"llama-server at {hung.url}/props did not answer within 0.5 s")


def test_a_server_that_closes_mid_answer_is_server_unreachable_while_the_body_is_read(serve) -> None:
    def cut(conn: socket.socket, _: int) -> None:
        read_request(conn)
        conn.sendall(answer(body=b'{"partial": ', length=1000))
        conn.close()

    server = serve(cut)
    with loopback.stream("GET", f"{server.url}/slots", timeout=5.0, what="llama-server") as response:
        assert response.status_code == 200  # the head came: the break is in the body's iteration
        with pytest.raises(ServerUnreachable) as caught:
            for _ in response.iter_bytes():
                pass
    assert not isinstance(caught.value, httpx.HTTPError)
    assert f"the answer of llama-server at {server.url}/slots broke off" in str(caught.value)
    with pytest.raises(ServerUnreachable):  # read whole by the client: the same
        loopback.get(f"{server.url}/slots", timeout=5.0)


def test_an_error_status_is_server_http_error_with_its_status(serve) -> None:
    def refuse(conn: socket.socket, _: int) -> None:
        while read_request(conn):
            conn.sendall(answer(404, json.dumps({"error": {"message": "no such slot"}}).encode()))

    server = serve(refuse)
    with loopback.client(server.url) as http:
        response = http.post("/slots/7", params={"action": "erase"}, json={})
        with pytest.raises(ServerHTTPError) as caught:
            loopback.raise_for_status(response)
    assert caught.value.status == 404
    assert str(caught.value) == f"POST {server.url}/slots/7?action=erase -> HTTP 404: no such slot"
    ok = serve(lambda conn, _: (read_request(conn), conn.sendall(answer())))
    response = loopback.get(f"{ok.url}/health")
    assert loopback.raise_for_status(response) is response


def test_any_status_but_success_is_an_error_as_httpx_said(serve) -> None:
    """A redirect from a loopback server is not an answer ocpc can use: refused, as httpx's own
    ``raise_for_status`` refused it (ocpc's doors and llama-server never redirect)."""

    def redirect(conn: socket.socket, _: int) -> None:
        while read_request(conn):
            conn.sendall(answer(302, b"").replace(b"content-type", b"location: /elsewhere\r\ncontent-type"))

    server = serve(redirect)
    response = loopback.get(f"{server.url}/v1/park")
    with pytest.raises(ServerHTTPError) as caught:
        loopback.raise_for_status(response)
    assert caught.value.status == 302


def test_an_answer_cut_mid_body_is_never_sent_again(serve) -> None:
    """Only a request the server dropped before answering goes again: once an answer has begun,
    the server acted on the request (a slot save, a completion), and sending it twice would repeat
    that. One connection, one request, whatever ``resend_stale`` says."""
    requests: list[int] = []

    def cut(conn: socket.socket, number: int) -> None:
        if read_request(conn):
            requests.append(number)
            conn.sendall(answer(body=b'{"partial": ', length=1000))
        conn.close()

    server = serve(cut)
    with loopback.client(server.url, resend_stale=True) as http, pytest.raises(ServerUnreachable):
        http.post("/slots/0", params={"action": "save"}, json={"filename": "x.bin"})
    assert requests == [0]


def closes_its_kept_alive_connection(conn: socket.socket, number: int) -> None:
    """The first connection answers one request, then takes the next and closes without an
    answer (a kept-alive connection the server had just closed); later ones answer each request."""
    if number == 0:
        read_request(conn)
        conn.sendall(answer())
        read_request(conn)
        conn.close()
        return
    while read_request(conn):
        conn.sendall(answer())


def test_a_request_dropped_on_a_kept_alive_connection_goes_again_only_when_asked(serve) -> None:
    server = serve(closes_its_kept_alive_connection)
    with loopback.client(server.url, resend_stale=True) as http:  # the slot client's
        assert http.post("/tokenize", json={"content": "a"}).status_code == 200
        assert http.post("/tokenize", json={"content": "b"}).status_code == 200  # sent again, on a fresh one
    server = serve(closes_its_kept_alive_connection)
    with loopback.client(server.url, what="llama-server") as http:
        assert http.get("/health").status_code == 200
        with pytest.raises(ServerUnreachable, match="cannot reach llama-server at .*/health: server disconnected"):
            http.get("/health")


# -- the proxy's h11 upstream client ------------------------------------------------------------


async def exchange(upstream: Upstream) -> bytes:
    response = await upstream.send("POST", "/v1/chat/completions", headers=[], body=b'{"messages": []}')
    try:
        return b"".join([part async for part in response.chunks()])
    finally:
        await response.aclose()


def test_a_kept_alive_connection_the_server_closed_is_upstream_stale(serve) -> None:
    server = serve(closes_its_kept_alive_connection)

    async def twice() -> None:
        upstream = Upstream("127.0.0.1", server.port, connect_s=2.0)
        try:
            assert await exchange(upstream) == b'{"ok": true}'
            with pytest.raises(UpstreamStale, match=f"a kept-alive connection to 127.0.0.1:{server.port} was closed"):
                await exchange(upstream)  # the pooled connection, closed as the request went
            assert await exchange(upstream) == b'{"ok": true}'  # sent again: a fresh one answers
        finally:
            await upstream.aclose()

    asyncio.run(twice())


def test_a_fresh_connection_closed_before_an_answer_is_upstream_error_not_stale(serve) -> None:
    server = serve(lambda conn, _: (read_request(conn), conn.close()))

    async def once() -> None:
        upstream = Upstream("127.0.0.1", server.port, connect_s=2.0)
        with pytest.raises(UpstreamError) as caught:
            await exchange(upstream)
        assert not isinstance(caught.value, UpstreamStale)
        assert str(caught.value) == "ConnectionResetError: the server closed the connection before answering"

    asyncio.run(once())


def test_a_refused_upstream_is_upstream_error() -> None:
    port = int(refused_url().rsplit(":", 1)[1])

    async def once() -> None:
        with pytest.raises(UpstreamError) as caught:
            await exchange(Upstream("127.0.0.1", port, connect_s=2.0))
        assert not isinstance(caught.value, UpstreamStale)
        assert str(caught.value) == f"cannot connect to 127.0.0.1:{port}: Connect call failed ('127.0.0.1', {port})"

    asyncio.run(once())


def test_an_upstream_answer_cut_short_is_upstream_error(serve) -> None:
    def cut(conn: socket.socket, _: int) -> None:
        read_request(conn)
        conn.sendall(answer(body=b'{"partial": ', length=1000))
        conn.close()

    server = serve(cut)

    async def once() -> None:
        with pytest.raises(UpstreamError, match="the answer broke off"):
            await exchange(Upstream("127.0.0.1", server.port, connect_s=2.0))

    asyncio.run(once())
