"""The daemon: a loopback-only HTTP front for the ``Engine``.

Endpoints (JSON):
- ``POST /v1/prepare``: body = the exact provider request body; harness metadata in
  headers (User-Agent, x-session-id); the caller's own deadline in ``x-ocpc-budget-ms``
  (how long it will wait; default 240 s, the first plugin's bound). Answers a
  ``PrepareResult`` (with a ``prepare_id``). A plugin that sends ``x-ocpc-pin: 1`` pins its
  request to the slot the answer names (``slot``, ``pin``): on ``-np N`` the daemon then takes a
  slot as the proxy does (``engine/broker.py``: the conversation's own, else a free one) and lends it
  until the report, so neither front door sends a request onto the other's running one.
- ``POST /v1/report``: ``{fingerprint, cache_n, prompt_n[, predicted_n, prepare_id]}`` from the real request.
- ``POST /v1/park``: ``{timeout_s}``: park the live conversations now (before a stop).
- ``GET /v1/status`` and ``GET /health``.

The standard library's threading HTTP server is enough: requests are few (one per
OpenCode request), the hit path is CPU-light, and slow paths run in their own thread
with per-slot serialisation inside the Engine. It never crashes on input: bad bodies
get a 4xx with a reason, oversized ones a 413 before they are read.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from oc_prefix_cache import __version__
from oc_prefix_cache.chat.head import MAX_BODY_BYTES, Head, continuing
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.slotfile import fingerprint_of
from oc_prefix_cache.doors.guard import DAEMON_ROUTES, Guard, route_of
from oc_prefix_cache.doors.router import LoadWatch, RouterCheck
from oc_prefix_cache.engine.broker import Ask, Claim, head_key, returning
from oc_prefix_cache.engine.prepare import PrepareResult
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.engine.wiring import Background, Engine, build_engine
from oc_prefix_cache.errors import BadRequestBody, ConfigError, OcpcError
from oc_prefix_cache.harness import Incoming, OpenCodeAdapter
from oc_prefix_cache.harness.base import head_by_markers
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.server_info import port_of, read_runtime
from oc_prefix_cache.settings import LOOPBACK_HOSTS, Settings

log = logging.getLogger("ocpc.daemon")
MAX_REPORT_BYTES = 64 * 1024


MAX_ISSUED = 512  # prepares of a router's models whose report may still come


class Daemon:
    """Owns the Engine (behind a router, one per model) and the HTTP server; ``serve_forever``
    or ``start`` in a thread."""

    def __init__(
        self,
        *,
        settings: Settings,
        server_url: str | None = None,
        host: str | None = None,
        port: int | None = None,
        server_binary: Path | None = None,
        watch_interval: float = 1.0,
        tracker: SlotTracker | None = None,
    ) -> None:
        host = host or settings.daemon_host
        if host not in LOOPBACK_HOSTS:
            raise ConfigError(f"--host {host!r}: the daemon listens on loopback only ({sorted(LOOPBACK_HOSTS)})")
        self.settings = settings
        self.server_url = (server_url or settings.base_url).rstrip("/")
        self.client = SlotClient(self.server_url)
        self.store = Store(index_path=settings.index_path, lock_path=settings.lock_path)
        port_ = port_of(self.server_url)
        self.tracker = tracker or SlotTracker(lock_dir=settings.home)
        self.background = Background()
        self._runtime = read_runtime(settings, port_) if port_ else None  # how `ocpc launch` started it
        self.engine = build_engine(
            settings=settings,
            client=self.client,
            store=self.store,
            tracker=self.tracker,
            server_binary=server_binary,
            schedule=self.background.submit,
            runtime=self._runtime,
        )
        # behind a llama-server router (doors/router.py): one Engine per model, by the body's `model`
        self._guard = threading.Lock()
        self._router = RouterCheck(self.server_url)
        self._models: dict[str, Engine] = {}
        self.loads = LoadWatch(
            self.server_url,
            engine_for=self.model_engine,  # warm starts after loads
            made=self._made_engine,
        )
        self._issued: OrderedDict[str, Engine] = OrderedDict()  # prepare_id -> the Engine that made it
        self._server_binary = server_binary
        server_class = _Server6 if ":" in host else _Server
        try:
            self.httpd = server_class((host, settings.daemon_port if port is None else port), _Handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port or settings.daemon_port}: {exc}") from exc
        self.httpd.daemon = self
        self._thread: threading.Thread | None = None
        self._watch_interval = watch_interval
        self._serving = False
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="ocpc-watch", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        log.info("ocpc daemon %s on %s for llama-server %s", __version__, self.url, self.server_url)
        if not self._watcher.is_alive():
            self._watcher.start()
        self._serving = True
        self.httpd.serve_forever(poll_interval=0.2)

    def _watch(self) -> None:
        """Notice server restarts between requests (see ``Engine.watch``)."""
        while not self._stopping.wait(self._watch_interval):
            try:
                if self._router.is_router():
                    self.loads.tick()
            except Exception:  # the watcher must outlive any surprise
                log.exception("the router's load watch failed; trying again")
            for engine in self.engines():
                try:
                    engine.watch()
                except Exception:  # the watcher must outlive any surprise
                    log.exception("restart watch failed; trying again")

    def start(self) -> None:
        """Serve in a background thread (tests, launcher)."""
        self._thread = threading.Thread(target=self.serve_forever, name="ocpc-daemon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None or self._serving:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.background.stop()
        for engine in self.engines():
            engine.flush_usage()
        self.client.close()
        if self._thread:
            self._thread.join(timeout=5)

    def prepare(
        self, raw: bytes, headers: dict[str, str], *, deadline: Deadline, gone: threading.Event | None = None
    ) -> dict[str, Any]:
        """The prepare's answer. A pinning plugin gets a slot of the broker's choice, held until
        its report (``report``) or until the watch takes it back: on ``-np N`` its request is
        pinned there (``pin``); on a single-slot server the slot is the one there is and the body
        stays as it is, but it is held all the same. Why: ``ocpc launch`` runs the proxy beside
        the daemon, and a proxied request prepared (restored, cleared) the one slot under the
        plugin's request, which then missed, and the two doors' requests came to run over each
        other (4 agents on ``-np 1``: every prepare after the first minute skipped or failed,
        0.82x plain's turns). A caller that does not pin gets the configured slot, unheld.

        ``gone``: set once the plugin closed its connection (it gave up on this prepare and sent
        its request without an answer). Then nothing is prepared once the slot is had, and a slot
        prepared already goes back at once: no report will come for it."""
        lower = {k.lower(): v for k, v in headers.items()}
        engine = self._engine_for(raw)
        broker = engine.broker
        if lower.get("x-ocpc-pin") != "1":
            return self._issue(engine, engine.prepare(raw, headers, deadline=deadline, harness="opencode")).to_json()
        n_slots = broker.n_slots()
        claim = Claim(broker)
        lent = False
        try:  # the slot goes back in the ``finally`` unless it was lent until the plugin's report
            ask = self._ask(engine, raw, lower, n_slots)
            taken = claim.take(ask, deadline=deadline, gone=gone)
            if gone is not None and gone.is_set():
                engine.count("client_gone_before_prepare")
                log.info(
                    "slot %d: the plugin went away while its prepare waited for the slot; nothing prepared", taken.slot
                )
                return PrepareResult("failed", reason="the plugin went away before its slot was free").to_json() | {
                    "slot": taken.slot,
                    "pin": False,
                }
            if taken.hold is None:
                engine.count("failed:slot_busy")
                return PrepareResult("failed", reason=taken.why_not).to_json() | {"slot": taken.slot, "pin": False}
            with taken.hold.inside():
                proven = taken.conversation if ask.key is None and taken.conversation else None  # a session id
                result = engine.prepare(
                    raw,
                    headers,
                    slot=taken.slot,
                    deadline=deadline,
                    harness="opencode",
                    conversation=taken.conversation or None,
                    session=proven if proven is not None else ("" if ask.key else None),
                )
            self._issue(engine, result)
            if gone is not None and gone.is_set():
                engine.count("client_gone_during_prepare")  # its request went out unpinned: no report comes
            elif result.prepare_id and result.fingerprint:
                broker.lend(result.prepare_id, taken)  # until the plugin reports on this answer
                lent = True
            # else no report will come (skipped, a title): nothing to keep it for
            return result.to_json() | {"slot": taken.slot, "pin": n_slots > 1}
        finally:
            if not lent:
                claim.release()

    def engines(self) -> list[Engine]:
        """The server's Engine, and behind a router each model's."""
        return [self.engine, *self._models.values()]

    def _engine_for(self, raw: bytes) -> Engine:
        """The Engine of the request's model behind a router (made on first use), else the one."""
        try:
            return self._model_engine(raw)
        except Exception:  # noqa: BLE001 (choosing must never fail a request: the server's own Engine)
            log.exception("choosing the router model's Engine failed; using the server's")
            return self.engine

    def _model_engine(self, raw: bytes) -> Engine:
        if not self._router.is_router():
            return self.engine
        try:
            name = json.loads(raw).get("model")
        except (ValueError, AttributeError, RecursionError):
            return self.engine
        model = self._router.models.canonical(name) if isinstance(name, str) else None
        if model is None:
            return self.engine  # a model the router does not know: the request fails open as it would
        return self.model_engine(model)

    def _made_engine(self, model: str) -> Engine | None:
        with self._guard:
            return self._models.get(model)

    def model_engine(self, model: str) -> Engine:
        """The Engine of one model of the router (made on first use; ``ocpc launch``'s proxy
        shares them, as it shares the server's Engine otherwise)."""
        with self._guard:
            engine = self._models.get(model)
            if engine is None:
                engine = self._models[model] = build_engine(
                    settings=self.settings,
                    client=SlotClient(self.server_url, model=model),
                    store=self.store,
                    tracker=self.tracker,
                    server_binary=self._server_binary,
                    schedule=self.background.submit,
                    runtime=self._runtime,
                )
                log.info("router model %s: its own Engine (%s)", model, engine.server)
            return engine

    def _issue(self, engine: Engine, result: PrepareResult) -> PrepareResult:
        """Remember which Engine made ``result``, for its report (the newest ``MAX_ISSUED``)."""
        if result.prepare_id and engine is not self.engine:
            with self._guard:
                self._issued[result.prepare_id] = engine
                while len(self._issued) > MAX_ISSUED:
                    self._issued.popitem(last=False)
        return result

    def _ask(self, engine: Engine, raw: bytes, headers: dict[str, str], n_slots: int) -> Ask:
        """What the broker needs before the prepare: the conversation (``x-session-id``; none for
        a request with no head, such as a title) and the head's cheap key."""
        try:
            data = json.loads(raw)
            head = head_by_markers(data, self.settings.markers) if isinstance(data, dict) else None
        except (ValueError, RecursionError, BadRequestBody):
            data, head = None, None
        conversation, key, going_on = "", None, False
        if isinstance(data, dict) and isinstance(
            head, Head
        ):  # the plugin's own session header, as OpenCode's adapter reads it
            key = OpenCodeAdapter(markers=self.settings.markers).key(
                Incoming(api="openai", headers=headers, body=data), data
            )
            conversation = "" if key.shared else key.name  # a shared key: named by the broker as it takes the slot
            going_on = key.shared and continuing(data["messages"], head)
        return Ask(
            key=key if key is not None and key.shared else None,
            raw=raw,
            continuing=going_on,
            conversation=conversation,
            head_key=head_key(head) if isinstance(head, Head) else "",
            n_slots=n_slots,
            default_slot=self.settings.slot,
            returning=isinstance(data, dict) and returning(data),
        )

    def report(self, **fields: Any) -> dict[str, Any]:
        """The plugin's report: learned from, and the slot lent to its request is free again."""
        with self._guard:
            engine = self._issued.pop(fields.get("prepare_id") or "", self.engine)
        try:
            return engine.report(**fields)
        finally:
            if fields.get("prepare_id"):
                engine.broker.returned(fields["prepare_id"])

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": __version__, "server": {"url": self.server_url}}
        try:
            data["server"]["healthy"] = self.client.health()
            data["server"]["slots"] = self.client.slots()
        except OcpcError as exc:
            data["server"]["error"] = str(exc)
        data["daemon"] = self.engine.status()
        if self._models:
            data["models"] = {model: engine.status() for model, engine in list(self._models.items())}
        if self._router.is_router():
            data["loaded"] = self.loads.status()
        data["disk"] = _disk_files(self.settings.slot_dir)
        try:
            data["index"] = self.store.load().to_json()
        except OcpcError as exc:
            data["index"] = {"error": str(exc)}
        return data


def _disk_files(slot_dir: Path) -> list[dict[str, Any]]:
    out = []
    try:
        for path in sorted(slot_dir.iterdir()):
            fp = fingerprint_of(path.name)
            if fp:
                stat = path.stat()
                out.append({"fingerprint": fp, "file": path.name, "bytes": stat.st_size, "mtime": int(stat.st_mtime)})
    except OSError:
        pass
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    daemon: Daemon


class _Server6(_Server):
    address_family = socket.AF_INET6


def _watch_departure(sock: socket.socket, gone: threading.Event, answered: threading.Event) -> None:
    """Until ``answered``: set ``gone`` once the client closes its end of ``sock``. A plugin that
    waits for a prepare's answer sends nothing, so a readable socket is its close (or a reset);
    bytes there (another request, pipelined) end the watch without a verdict. Why: a plugin
    that gave up sent its request unpinned, and the daemon went on to take a slot, prepare it and
    lend it for a report that never came: work for nobody, and a slot kept from the other front
    door until the lease was taken back (10 s or more)."""
    try:
        with selectors.DefaultSelector() as watch:
            watch.register(sock, selectors.EVENT_READ)
            while not answered.is_set():
                if watch.select(timeout=0.25):
                    if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        gone.set()
                    return
    except ConnectionError:  # reset by the client: it is gone too
        gone.set()
    except (OSError, ValueError) as exc:  # emptied or closed under us once answered: no verdict
        log.debug("departure watch ended: %s", exc)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle or stalled client does not hold a thread for ever

    def setup(self) -> None:
        super().setup()
        # The prepare's answer comes as two writes (headers at once, then the body): without
        # TCP_NODELAY the second waits for the first's delayed ACK (~40 ms, measured).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        """A client that gave up (the plugin's timeout) is normal, not an error to print."""
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError) as exc:
            log.info("client %s went away before the answer: %s", self.address_string(), exc)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        refusal = self._refusal(need_json=False)
        if refusal is not None:
            self.close_connection = True
            self._send(*refusal)
            return
        if self.path == "/health":
            self._send(HTTPStatus.OK, {"status": "ok", "version": __version__})
        elif self.path == "/v1/status":
            self._send(HTTPStatus.OK, self.server.daemon.status())
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: GET {self.path}"})

    def do_POST(self) -> None:
        received = time.monotonic()  # the caller's budget counts from its send, not from our read
        refusal = self._refusal()
        if refusal is not None:
            self.close_connection = True
            self._send(*refusal)
            return
        if self.path == "/v1/prepare":
            raw = self._read_body(MAX_BODY_BYTES)
            if raw is not None:
                self._prepare(raw, Deadline.from_budget_ms(self.headers.get("x-ocpc-budget-ms"), received=received))
        elif self.path == "/v1/report":
            raw = self._read_body(MAX_REPORT_BYTES)
            if raw is not None:
                self._report(raw)
        elif self.path == "/v1/park":
            raw = self._read_body(MAX_REPORT_BYTES)
            if raw is not None:
                self._park(raw)
        elif self._read_body(MAX_BODY_BYTES) is not None:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: POST {self.path}"})

    def _refusal(self, *, need_json: bool = True) -> tuple[HTTPStatus, dict[str, Any]] | None:
        """Only local programs may drive or read the daemon, never a web page in a browser
        (doors/guard.py: every route of the daemon is ocpc's own), and POSTs are JSON only (a page can
        POST text/plain without a preflight)."""
        headers = {k.lower(): v for k, v in self.headers.items()}
        refusal = Guard().judge(route_of(DAEMON_ROUTES, self.command, self.path), headers)
        if refusal is not None:
            return HTTPStatus(refusal.status), {"error": refusal.reason}
        if need_json and (self.headers.get("Content-Type") or "").split(";")[0].strip().lower() != "application/json":
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "send Content-Type: application/json"}
        return None

    def _prepare(self, raw: bytes, deadline: Deadline) -> None:
        """Headers at once, the answer when done: the plugin bounds the two separately.

        A daemon that does not send headers within a few hundred ms is down or hung, and
        the plugin goes on; one that did is working (maybe a minutes-long first warm-up,
        which the real request would have to wait for anyway) and is given longer.
        """
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Ocpc-State", "working")
        # One chunk, sent when the answer is ready: the connection stays open for the next
        # prepare (a new connection and handler thread per turn cost ~0.3-0.5 ms of the hit path)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        headers = {k: v for k, v in self.headers.items()}
        gone, answered = threading.Event(), threading.Event()
        if self.headers.get("x-ocpc-pin") == "1":  # only a pinning plugin's prepare takes a slot, or waits for one
            threading.Thread(
                target=_watch_departure, args=(self.connection, gone, answered), name="ocpc-departure", daemon=True
            ).start()
        try:
            answer = self.server.daemon.prepare(raw, headers, deadline=deadline, gone=gone)
        except Exception as exc:  # a bug of ours: an answer all the same (the headers are out), and the request goes on
            log.exception("a prepare crashed; answering failed")
            answer = PrepareResult("failed", reason=f"internal error: {type(exc).__name__}: {exc}").to_json()
        finally:
            answered.set()
        body = json.dumps(answer).encode()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))

    def _report(self, raw: bytes) -> None:
        try:
            data = json.loads(raw)
            fp = data["fingerprint"]
            cache_n, prompt_n = data["cache_n"], data["prompt_n"]
            prepare_id = data.get("prepare_id") or ""
            predicted_n = data.get("predicted_n")
            prompt_ms = data.get("prompt_ms")  # plugin 0.3.1
            if not isinstance(prompt_ms, (int, float)) or isinstance(prompt_ms, bool) or prompt_ms < 0:
                prompt_ms = None
            if (
                not isinstance(fp, str)
                or not isinstance(prepare_id, str)
                or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for v in (cache_n, prompt_n, 0 if predicted_n is None else predicted_n)
                )
            ):
                raise TypeError(
                    "fingerprint and prepare_id must be strings; cache_n, prompt_n (and predicted_n) whole numbers >= 0"
                )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"bad report: {exc}"})
            return
        self._send(
            HTTPStatus.OK,
            self.server.daemon.report(
                fingerprint=fp,
                cache_n=cache_n,
                prompt_n=prompt_n,
                prepare_id=prepare_id,
                predicted_n=predicted_n,
                prompt_ms=prompt_ms,
            ),
        )

    def _park(self, raw: bytes) -> None:
        """Park the live conversations before the server stops (`ocpc park`, systemd ExecStop)."""
        try:
            data = json.loads(raw or b"{}")
            seconds = float(data.get("timeout_s", 10.0)) if isinstance(data, dict) else 10.0
            if not 0 < seconds <= 300:
                raise ValueError("timeout_s must be in (0, 300]")
        except (ValueError, TypeError) as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"bad park request: {exc}"})
            return
        deadline = Deadline.after(seconds)
        results = [r for p in self.server.daemon.engines() for r in p.park_live(deadline=deadline)]
        self._send(HTTPStatus.OK, {"slots": results})

    def _read_body(self, limit: int) -> bytes | None:
        raw_length = self.headers.get("Content-Length")
        try:
            length = int(raw_length) if raw_length is not None else -1
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._send(HTTPStatus.LENGTH_REQUIRED, {"error": "a Content-Length header is required"})
            return None
        if length > limit:
            self.close_connection = True  # do not read a huge body just to drop it
            self._send(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body of {length} bytes is over the {limit}-byte limit"}
            )
            return None
        return self.rfile.read(length)

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
