"""A recording HTTP proxy on 127.0.0.1, for the tests that run with proxy variables set.

Many workplaces set ``HTTP_PROXY`` and its kin, and httpx honours them by default: ocpc's
loopback calls, prompts included, went to that proxy (issue 36; ``oc_prefix_cache/loopback.py``).
tests/conftest.py points every proxy variable, upper- and lower-case, at one of these for the
whole run, with ``NO_PROXY`` unset, and fails a test when anything aimed at this machine
(127.0.0.0/8, ::1, localhost) reached it: ocpc must reach llama-server and its own doors
directly, whatever the variables say.

A request for a host elsewhere (an agent's npm install at start-up, its telemetry, ``ocpc
install``'s npm run, a download) is let through, as a workplace's proxy would: a ``CONNECT``
tunnel or the plain request, directly or through the proxy the real environment had. It is
recorded as outward, and fails nothing: those go out on purpose.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")
AGENTS_NO_PROXY = "127.0.0.1,localhost"  # what ocpc doctor tells a user to set for the agents


@dataclass(frozen=True)
class Hit:
    line: str  # the request line (CONNECT host:port, or METHOD absolute-URL), or what came instead
    host: str

    @property
    def local(self) -> bool:
        """Aimed at this machine: what must never reach a proxy."""
        host = self.host.strip("[]").lower()
        if host in ("", "localhost") or host.endswith(".localhost"):
            return True  # an unreadable request counts as local: nothing explains it otherwise
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return address.is_loopback or address.is_unspecified


def _target(line: str) -> tuple[str, int, bool]:
    """Host, port, and whether it is a CONNECT, from a proxy request line."""
    parts = line.split()
    if len(parts) < 2:
        return "", 0, False
    if parts[0].upper() == "CONNECT":
        where = urlsplit(f"//{parts[1]}")
        return where.hostname or "", where.port or 443, True
    where = urlsplit(parts[1])
    return where.hostname or "", where.port or (443 if where.scheme == "https" else 80), False


class RecordingProxy:
    """The stub: records each request's first line; answers one aimed at this machine with a
    502, and passes one for elsewhere on (through ``upstream``, the real environment's proxy,
    when there was one)."""

    def __init__(self, upstream: str | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        up = urlsplit(upstream) if upstream else None
        self._upstream = (up.hostname or "", up.port or 80) if up is not None and up.hostname else None
        self._lock = threading.Lock()
        self._hits: list[Hit] = []
        self.outward: list[Hit] = []  # every request let through, for the record
        threading.Thread(target=self._accept, name="proxy-stub", daemon=True).start()

    def env(self) -> dict[str, str]:
        return {name: self.url for name in PROXY_VARS}

    def take(self) -> list[Hit]:
        """The requests aimed at this machine since the last call (each reported once)."""
        with self._lock:
            hits, self._hits = self._hits, []
        return hits

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5.0)
            head = b""
            try:
                while b"\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
            except OSError:
                pass
            line = (
                head.split(b"\r\n", 1)[0].decode("latin-1")[:300]
                if b"\r\n" in head
                else f"(no request line: {head[:60]!r})"
            )
            host, port, tunnel = _target(line)
            hit = Hit(line, host)
            if hit.local:
                with self._lock:
                    self._hits.append(hit)
                try:
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                except OSError:
                    pass
                return
            with self._lock:
                self.outward.append(hit)
            self._pass_on(conn, head, host, port, tunnel)

    def _pass_on(self, conn: socket.socket, head: bytes, host: str, port: int, tunnel: bool) -> None:
        try:
            if self._upstream is not None:  # the real proxy takes the request as it came
                out = socket.create_connection(self._upstream, timeout=10)
                out.sendall(head)
            else:
                out = socket.create_connection((host, port), timeout=10)
                if tunnel:
                    conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    _, _, rest = head.partition(b"\r\n\r\n")
                    if rest:
                        out.sendall(rest)
                else:  # absolute-form to origin-form: "GET http://h/p HTTP/1.1" -> "GET /p HTTP/1.1"
                    first, _, rest = head.partition(b"\r\n")
                    method, target, version = first.split(b" ", 2)
                    path = urlsplit(target.decode("latin-1"))
                    origin = (path.path or "/") + (f"?{path.query}" if path.query else "")
                    out.sendall(b" ".join((method, origin.encode("latin-1"), version)) + b"\r\n" + rest)
        except (OSError, ValueError):
            try:
                conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            except OSError:
                pass
            return
        with out:
            conn.settimeout(None)
            out.settimeout(None)
            back = threading.Thread(target=_pipe, args=(out, conn), daemon=True)
            back.start()
            _pipe(conn, out)
            back.join(timeout=600)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def upstream_of(environ: Mapping[str, str]) -> str | None:
    """The proxy the real environment sends outward traffic to, if any."""
    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        value = environ.get(name, "").strip()
        if value.startswith("http://") or (value and "://" not in value):
            return value if "://" in value else f"http://{value}"
    return None


def agent_env(env: Mapping[str, str]) -> dict[str, str]:
    """An agent's environment as a user behind a proxy would have it after `ocpc doctor`'s advice:
    the proxy variables (this run's stub) and ``NO_PROXY`` keeping 127.0.0.1 out of them. Only the
    agents get ``NO_PROXY``: ocpc's own processes must stay direct without it."""
    stub = {name: os.environ[name] for name in PROXY_VARS if os.environ.get(name)}
    return {**env, **stub, "NO_PROXY": AGENTS_NO_PROXY, "no_proxy": AGENTS_NO_PROXY}
