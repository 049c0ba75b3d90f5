"""What `ocpc proxy` adds to a request: direct vs through the proxy, arms alternated in one run.

Arms (each request goes once direct and once through the proxy, in alternating order):

* **stub**: a stub upstream (this file's ``Stub``) streaming ``--chunks`` SSE chunks (>= 1,000): the
  proxy's cost per request and per streamed chunk, with no model time at all.
* **hit**: the real llama-server (rig, tiny model), a conversation turn the prepare answers ``hit``
  (the same Claude Code-sized OpenAI body sent again), for a 50 KB and a 500 KB body.
* **claude-code**: a new Claude Code session's first request (the captured A1 body, a new session
  id) with and without the head in the slot: tokens processed and time to the answer.

``--smoke`` runs a few requests of each (CI: it only proves the bench runs). Prints a table and,
with ``--json``, the numbers. Full runs are in docs/proxy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data"


# -- the stub upstream ------------------------------------------------------------------------------


class Stub:
    """A llama-server stand-in for faults the real one cannot make on demand, and for timing.

    Behaviour per request, from the ``x-stub`` header (the proxy forwards it): ``stream:N`` (N SSE
    chunks, then a final chunk with ``timings``; the default, N=3), ``slow:N:MS`` (N chunks, MS apart),
    ``hang`` (never answers), ``500`` (an error answer). Every request is recorded in ``seen``.
    """

    def __init__(self, *, slots: int = 1) -> None:
        self.slots = slots
        self.seen: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stub._record(self, b"")
                if self.path.startswith("/props"):
                    self._json(200, {"total_slots": stub.slots})
                elif self.path.startswith("/slots"):
                    self._json(200, [{"id": i, "id_task": 1, "n_prompt_tokens": 0, "is_processing": False}
                                     for i in range(stub.slots)])
                else:
                    self._json(200, {"status": "ok", "path": self.path})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else self._read_chunked()
                stub._record(self, body)
                mode = (self.headers.get("x-stub") or "stream:3").split(":")
                if mode[0] == "hang":
                    stub.stopping.wait(60)
                    self.close_connection = True
                    return
                if mode[0] == "500":
                    self._json(500, {"error": {"code": 500, "message": "stub failure", "type": "server_error"}})
                    return
                if self.path.split("?")[0] not in ("/v1/chat/completions", "/v1/messages"):
                    self._json(200, {"echo": len(body)})
                    return
                n = int(mode[1]) if len(mode) > 1 else 3
                gap = float(mode[2]) / 1000 if len(mode) > 2 else 0.0
                self._stream(n, gap)

            def _read_chunked(self) -> bytes:
                parts = []
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()

            def _json(self, status: int, data: Any) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _stream(self, n: int, gap: float) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(n):
                        self._chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"n":%d}\n\n' % i)
                        if gap:
                            time.sleep(gap)
                    self._chunk(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
                                b'"timings":{"cache_n":100,"prompt_n":5,"predicted_n":%d}}\n\ndata: [DONE]\n\n' % n)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    stub.seen[-1]["cut"] = True

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _record(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        self.seen.append({"method": handler.command, "path": handler.path, "body": body,
                          "headers": {k.lower(): v for k, v in handler.headers.items()}})

    def __enter__(self) -> Stub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
