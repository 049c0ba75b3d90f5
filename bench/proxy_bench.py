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

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import ServerUnreachable

DATA = ROOT / "tests" / "data"


# -- the stub upstream ------------------------------------------------------------------------------


class Stub:
    """A llama-server stand-in for faults the real one cannot make on demand, and for timing.

    Behaviour per request, from the ``x-stub`` header (the proxy forwards it): ``stream:N`` (N SSE
    chunks, then a final chunk with ``timings``; the default, N=3), ``slow:N:MS`` (N chunks, MS apart),
    ``linger:MS`` (the whole answer, then MS before the stream ends), ``hang`` (never answers),
    ``500`` (an error answer). Every request is recorded in ``seen``.
    """

    def __init__(self, *, slots: int = 1) -> None:
        self.slots = slots
        self.seen: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()  # small writes go out at once, as llama-server's do (no Nagle delay)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stub._record(self, b"")
                if self.path.startswith("/props"):
                    self._json(200, {"total_slots": stub.slots})
                elif self.path.startswith("/slots"):
                    self._json(
                        200,
                        [
                            {"id": i, "id_task": 1, "n_prompt_tokens": 0, "is_processing": False}
                            for i in range(stub.slots)
                        ],
                    )
                else:
                    self._json(200, {"status": "ok", "path": self.path})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
                body = self._read_chunked() if chunked else self.rfile.read(length)
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
                if mode[0] == "linger":  # the whole answer, then the stream stays open MS before it ends
                    self._stream(3, 0.0, linger=float(mode[1]) / 1000)
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

            def _stream(self, n: int, gap: float, *, linger: float = 0.0) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(n):
                        self._chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"n":%d}\n\n' % i)
                        if gap:
                            time.sleep(gap)
                    self._chunk(
                        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
                        b'"timings":{"cache_n":100,"prompt_n":5,"predicted_n":%d}}\n\ndata: [DONE]\n\n' % n
                    )
                    if linger:
                        time.sleep(linger)
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
        self.seen.append(
            {
                "method": handler.command,
                "path": handler.path,
                "body": body,
                "headers": {k.lower(): v for k, v in handler.headers.items()},
            }
        )

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


# -- the arms --------------------------------------------------------------------------------------


class Proxied:
    """An in-process `ocpc proxy` (uvicorn in a thread), as `ocpc launch` runs it."""

    def __init__(self, upstream: str, home: Path, *, watch: bool = False) -> None:
        from oc_prefix_cache.doors.proxy import Proxy
        from oc_prefix_cache.doors.proxy_server import ProxyServer
        from oc_prefix_cache.engine.wiring import engine_for_url
        from oc_prefix_cache.settings import Settings

        settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(home)})
        self.proxy = Proxy(settings=settings, engine=engine_for_url(settings, server_url=upstream))
        self.server = ProxyServer(self.proxy, port=0, watch=watch)  # watch: as `ocpc proxy` runs it
        self.url = self.server.url

    def __enter__(self) -> Proxied:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def client(timeout: float) -> httpx.Client:
    """A client whose small writes go out at once (headers and body are separate writes)."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return loopback.client(timeout=timeout, transport=httpx.HTTPTransport(socket_options=nodelay))


def timed_stream(client: httpx.Client, url: str, raw: bytes, headers: dict[str, str]) -> tuple[float, bytes]:
    for attempt in (1, 2):  # llama-server closes idle keep-alive connections after 5 s: reconnect once
        started = time.perf_counter()
        try:
            with client.stream("POST", url, content=raw, headers=headers) as response:
                data = b"".join(response.iter_raw())
            break
        except ServerUnreachable:  # the loopback mapper's word for a dropped connection
            if attempt == 2:
                raise
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, data[:300]
    return elapsed, data


def alternate(
    http: httpx.Client,
    runs: int,
    direct: str,
    proxied: str,
    raw: bytes,
    headers: dict[str, str],
    *,
    direct_raw: bytes | None = None,
) -> dict[str, Any]:
    """Direct and proxied requests in turn (ABAB...): medians and the median paired difference."""
    a: list[float] = []
    b: list[float] = []
    for i in range(runs):
        order = [(direct, a, direct_raw or raw), (proxied, b, raw)]
        for url, sink, body in order if i % 2 == 0 else order[::-1]:
            sink.append(timed_stream(http, url, body, headers)[0])
    diffs = [y - x for x, y in zip(a, b, strict=False)]
    return {
        "direct_ms": statistics.median(a) * 1e3,
        "proxy_ms": statistics.median(b) * 1e3,
        "added_ms": statistics.median(diffs) * 1e3,
        "runs": runs,
    }


def generic_body(size: int) -> bytes:
    """An OpenAI chat body of about ``size`` bytes with no marker (the proxy's prepare skips it)."""
    messages = [{"role": "system", "content": "You are terse."}]
    while len(json.dumps(messages)) < size:
        messages += [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    return json.dumps(
        {"model": "m", "stream": True, "messages": messages + [{"role": "user", "content": "go"}]}
    ).encode()


def stub_arm(runs: int, chunks: int, home: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Stub() as stub, Proxied(stub.url, home) as proxy, client(60) as http:
        for label, n, size in (
            ("request (3 chunks, 50 KB body)", 3, 50_000),
            (f"stream ({chunks} chunks)", chunks, 2_000),
        ):
            raw = generic_body(size)
            path = "/v1/chat/completions"
            alternate(http, 2, stub.url + path, proxy.url + path, raw, {"x-stub": f"stream:{n}"})  # warm-up
            row = alternate(http, runs, stub.url + path, proxy.url + path, raw, {"x-stub": f"stream:{n}"})
            row["ready_ms"] = statistics.median(r["ready_ms"] for r in proxy.proxy.status()["recent"][-runs:])
            if n > 3:
                row["added_per_chunk_ms"] = row["added_ms"] / n
            out[label] = row
    return out


def hit_body(size: int) -> tuple[bytes, dict[str, str]]:
    """An OpenCode request (the captured body) grown to ``size`` bytes: real history up to 50 KB,
    then padding in a field the server ignores (so a 500 KB body fits the tiny model's context)."""
    body = json.loads((DATA / "opencode-1.18.33" / "02_projA_turn1_main_request.json").read_text())
    body = {**body, "stream": True, "max_tokens": 1}
    body.pop("stream_options", None)
    messages = list(body["messages"])
    while len(json.dumps({**body, "messages": messages})) < min(size, 50_000) - 1200:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more " * 200}]
    body["messages"] = messages
    pad = size - len(json.dumps(body))
    if pad > 1000:
        body["ocpc_bench_pad"] = "p" * pad
    ua = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"
    return json.dumps(body).encode(), {"user-agent": ua, "x-session-id": "bench", "content-type": "application/json"}


def start_server(ctx: int, model: str = "qwen35", parallel: int = 1) -> Any:
    from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig
    from oc_prefix_cache.rig.build import ensure_rig
    from oc_prefix_cache.rig.tiny_models import ensure_model
    from oc_prefix_cache.settings import Settings

    settings = Settings.from_env()
    rig = ensure_rig(settings)
    home = Path(tempfile.mkdtemp(prefix="ocpc-bench-"))
    config = ServerConfig(
        binary=rig.server,
        model=ensure_model(rig, model),
        port=free_port(),
        slot_dir=home / "slots",
        ctx_size=ctx,
        parallel=parallel,
        extra_args=("--logit-bias", "151645+30"),
    )
    server = LlamaServer(config=config, log_path=home / "llama-server.log")
    server.start()
    return server, home


def hit_arm(runs: int, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server, home = start_server(65536, "qwen3", parallel=2)  # a transformer: a repeat costs one token
    try:
        with Proxied(server.url, home) as proxy, client(300) as http:
            for size in sizes:
                raw, headers = hit_body(size)
                path = "/v1/chat/completions"
                timed_stream(http, proxy.url + path, raw, headers)  # warm the head, bind the conversation
                time.sleep(0.2)
                # the direct arm on slot 1, the proxy's conversation on slot 0: neither evicts the other
                direct = raw.replace(b"{", b'{"id_slot": 1, ', 1)
                row = alternate(http, runs, server.url + path, proxy.url + path, raw, headers, direct_raw=direct)
                recent = proxy.proxy.status()["recent"][-runs:]
                actions = [r["action"] for r in recent]
                row["hits"] = f"{actions.count('hit')}/{len(actions)}"
                events = [e for e in proxy.proxy.engine.status()["events"] if e["action"] == "hit"][-runs:]
                row["prepare_ms"] = statistics.median(e["elapsed_ms"] for e in events) if events else -1.0
                row["ready_ms"] = statistics.median(r["ready_ms"] for r in recent)  # arrival -> forward
                out[f"hit, {len(raw) // 1000} KB body"] = row
    finally:
        server.stop()
    return out


def claude_code_arm(runs: int) -> dict[str, Any]:
    """A new Claude Code session's first request (A1, a fresh session id each time): the slot erased
    and no prepare (every token processed) vs through the proxy (the head restored first)."""
    from oc_prefix_cache.chat.anthropic import to_chat, upstream_body
    from oc_prefix_cache.harness import ClaudeCodeAdapter, Incoming

    data = json.loads((DATA / "claude-code-2.1.332" / "A1.json").read_text())
    pairs = data["headers"].items() if isinstance(data["headers"], dict) else data["headers"]
    headers = {
        str(k).lower(): str(v)
        for k, v in pairs
        if str(k).lower() not in ("content-length", "host", "authorization", "connection")
    }
    body = data["body_json"]
    normalised, _ = ClaudeCodeAdapter().normalise(Incoming(api="anthropic", headers=headers, body=body))
    cold = json.dumps(upstream_body(to_chat(normalised))).encode()
    server, home = start_server(32768)
    rows: dict[str, list[tuple[float, int]]] = {"without the head": [], "with the head (proxy)": []}
    try:
        with Proxied(server.url, home) as proxy, client(300) as http:
            for i in range(runs + 1):
                session = f"00000000-0000-4000-8000-{i:012d}"
                loopback.post(f"{server.url}/slots/0?action=erase", timeout=30)
                elapsed, answer = timed_stream(
                    http, server.url + "/v1/chat/completions", cold, {"content-type": "application/json"}
                )
                if i:
                    rows["without the head"].append((elapsed, _processed(answer)))
                elapsed, answer = timed_stream(
                    http,
                    proxy.url + "/v1/messages?beta=true",
                    json.dumps(body).encode(),
                    {**headers, "x-claude-code-session-id": session},
                )
                if i:  # the first round warms the head file (a one-off per configuration)
                    rows["with the head (proxy)"].append((elapsed, _processed(answer)))
    finally:
        server.stop()
    return {
        label: {
            "time_ms": statistics.median(t for t, _ in row) * 1e3,
            "tokens_processed": statistics.median(n for _, n in row),
            "runs": len(row),
        }
        for label, row in rows.items()
    }


def _processed(answer: bytes) -> int:
    """Tokens the server processed: chat ``timings.prompt_n``, or Anthropic ``input_tokens``."""
    text = answer.decode(errors="replace")
    for key in ('"prompt_n":', '"input_tokens":'):
        at = text.rfind(key) if key == '"prompt_n":' else text.find(key)
        if at >= 0:
            return int(text[at + len(key) :].split(",")[0].split("}")[0])
    return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few requests of each arm (CI)")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = 5 if args.smoke else args.runs
    home = Path(tempfile.mkdtemp(prefix="ocpc-bench-"))
    os.environ.setdefault("OC_PREFIX_CACHE_HOME", str(home))
    results: dict[str, Any] = {"stub": stub_arm(runs, max(1000, args.chunks if not args.smoke else 1000), home)}
    results["real server"] = hit_arm(runs, [50_000] if args.smoke else [50_000, 500_000])
    if not args.smoke:
        results["claude-code first request"] = claude_code_arm(max(3, runs // 40))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for arm, rows in results.items():
        print(f"== {arm}")
        for label, row in rows.items():
            print(
                f"  {label:34} "
                + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )


if __name__ == "__main__":
    from oc_prefix_cache.llama.supervisor import stop_on_sigterm

    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    main()
