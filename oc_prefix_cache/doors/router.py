"""Router mode: ocpc in front of a llama-server router (``--models-dir`` / ``--models-preset``).

A router serves several models behind one URL, each in a child server it starts on demand and
stops when ``--models-max`` is reached (the least recently used one goes) or when it sleeps. Its
API is the child's, with the model named in every call: ``"model"`` in a POST body, ``?model=``
on a GET (b11434, ``server-models.cpp``). So ocpc keeps one Engine per model, each on a
``SlotClient(model=...)`` and keyed ``<router>#model=<id>``: its own tracker state, slots, files
(fingerprints cover the model, so one slot folder serves all) and counters.

The router gives no hook before it unloads a model. ocpc does not need one: a conversation left
idle is parked ahead (engine/park_ahead.py) within seconds, and a model loaded again is a new process (its
child, the restart witness: ``server_info.child_process``), which the tracker takes for a restart;
the conversation's next turn restores its park and processes only its new tokens. ocpc's own
calls to a model outside a request (the watch, parks ahead, warm starts) never load it
(``autoload=false``), so they never evict another.

``LoadWatch`` notices each load however it came (a request, ocpc's own ``ensure_loaded``, another
client, ``POST /models/load``): once a second it reads the router's ``GET /models`` (the router
answers it: nothing is loaded) and, for a model running in a child it had not seen (or that woke
from sleep), warm-starts that model's slots (``Engine.warm_loaded``: engine/warm_start.py's choice for
the model's key, yielding every slot a request has), so a new session after the load finds its
head in place.

``RouterProxy`` is the proxy's front for a router: the request's ``model`` (canonical id, from
the router's ``/models``) picks that model's ``Proxy``; anything else goes through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.head import MAX_BODY_BYTES
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.doors.guard import PROXY_ROUTES, Guard, Route, route_of
from oc_prefix_cache.doors.proxy import API_PATHS, Proxy
from oc_prefix_cache.doors.relay import Receive, Scope, Send, read_body
from oc_prefix_cache.engine.wiring import Engine
from oc_prefix_cache.errors import ClientGone, OcpcError, ServerError
from oc_prefix_cache.llama.client import SlotClient, Timeouts
from oc_prefix_cache.llama.server_info import child_process, flag_value, process_start
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.router")
MODELS_TTL_S = 30.0  # the router's model list (ids and aliases) is read again after this long
WARM_ON_LOAD_S = 300.0  # a warm start after a load gives up after this long


def is_router(url: str, *, timeout: float = 2.0) -> bool:
    """Whether ``url`` is a llama-server router (its own ``/props`` says ``role: router``)."""
    try:
        data = loopback.get(
            f"{url.rstrip('/')}/props", timeout=httpx.Timeout(timeout, connect=0.5), what="llama-server"
        ).json()
    except (ServerError, ValueError):
        return False
    return isinstance(data, dict) and data.get("role") == "router"


class RouterCheck:
    """Whether the server is a router, asked until it says so (it may not be up yet when asked
    first), at most every ``every_s``; with the router's ``Models`` once it is one."""

    def __init__(self, url: str, *, every_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.models = Models(self.url)
        self._every_s = every_s
        self._guard = threading.Lock()
        self._yes = False
        self._asked = float("-inf")

    def is_router(self) -> bool:
        if self._yes:
            return True
        with self._guard:
            if time.monotonic() - self._asked >= self._every_s:
                self._asked = time.monotonic()
                self._yes = is_router(self.url, timeout=1.0)
            return self._yes


def read_models(url: str, *, timeout: float = 2.0) -> list[dict[str, Any]] | None:
    """The router's ``GET /models`` entries (answered by the router itself: loads nothing), or
    None when it cannot be read."""
    try:
        data = loopback.get(
            f"{url.rstrip('/')}/models", timeout=httpx.Timeout(timeout, connect=0.5), what="the router"
        ).json()
    except (ServerError, ValueError) as exc:
        log.debug("cannot read the router's models (%s)", exc)  # the load watch asks every second
        return None
    entries = data.get("data") if isinstance(data, dict) else data
    return (
        [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
        if isinstance(entries, list)
        else None
    )


def status_of(entry: dict[str, Any]) -> str:
    """A ``GET /models`` entry's status: loaded, loading, unloaded, sleeping, ... ("?" unknown)."""
    status = entry.get("status")
    value = status.get("value") if isinstance(status, dict) else None
    return value if isinstance(value, str) else "?"


def models_view(url: str, *, timeouts: Timeouts) -> list[dict[str, Any]] | None:
    """Each model of the router, for ``ocpc top`` and ``ocpc status``: its id and status, and for a
    loaded one its model file, context and slots (``/props`` and ``/slots`` of its child, asked
    with ``autoload=false``: looking never loads a model). None when the router's list cannot be
    read. A loaded model whose child cannot be read carries ``error``."""
    entries = read_models(url, timeout=timeouts.quick)
    if entries is None:
        return None
    out: list[dict[str, Any]] = []
    for entry in entries:
        view: dict[str, Any] = {"id": entry["id"], "status": status_of(entry)}
        if view["status"] == "loaded":
            with SlotClient(url, timeouts=timeouts, model=entry["id"]) as client, client.background():
                try:
                    props, slots = client.props(), client.slots()
                except OcpcError as exc:  # unloaded in between, or busy loading
                    view["error"] = str(exc)
                else:
                    view.update(
                        model_path=props.get("model_path"),
                        n_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
                        slots=slots,
                    )
        out.append(view)
    return out


@dataclass(frozen=True)
class Running:
    """One model as the load watch last saw it: its status and the child that runs it."""

    status: str
    child: tuple[int, int] | None  # (pid, start time), when visible on this machine
    port: str | None  # the child's port (a fresh one per load)


class LoadWatch:
    """Warm-starts each model the router loads (see the module docstring). ``tick`` once a second
    (the watch); a model's warm start runs in its own thread, one at a time per model."""

    def __init__(
        self,
        url: str,
        *,
        engine_for: Callable[[str], Engine],
        made: Callable[[str], Engine | None],
        warm_s: float = WARM_ON_LOAD_S,
        enabled: bool = True,
    ) -> None:
        """``engine_for``: a model's Engine, made on first use; ``made``: only one made already."""
        self.url = url.rstrip("/")
        self._engine_for, self._made = engine_for, made
        self._warm_s = warm_s
        self.enabled = enabled  # off: loads are only noticed (a bench's control arm)
        self._guard = threading.Lock()
        self._seen: dict[str, Running] = {}
        self._warming: set[str] = set()

    def tick(self) -> list[str]:
        """Read the router's models once; start a warm start for each new load. Returns those models."""
        entries = read_models(self.url)
        if entries is None:
            return []
        started = []
        for entry in entries:
            model, status = entry["id"], status_of(entry)
            args = (entry.get("status") or {}).get("args")
            port = flag_value([str(a) for a in args], ("--port",)) if isinstance(args, list) else None
            with self._guard:
                before = self._seen.get(model)
            now = Running(
                status=status, child=self._child(entry, before, port) if status == "loaded" else None, port=port
            )
            with self._guard:
                self._seen[model] = now
            if status != "loaded":
                # its child ended (or its context, asleep): what ocpc knew of its slots is gone with it.
                # Also where no look saw it loaded: a request loads a model and the next request's
                # model unloads it, both within a second
                why = f"the router shows it {status}"
                if before is not None and before.status == "loaded":
                    self._engine_for(model).process_ended(why)
                elif (made := self._made(model)) is not None:
                    made.process_ended(why, if_known=True)
            if status != "loaded" or (
                before is not None
                and before.status == "loaded"
                and (before.port, before.child) == (now.port, now.child)
            ):
                continue
            woke = before is not None and before.status == "sleeping" and before.port == now.port
            if self._start(model, woke=woke):
                started.append(model)
        return started

    @staticmethod
    def _child(entry: dict[str, Any], before: Running | None, port: str | None) -> tuple[int, int] | None:
        """The child process: the one seen before while it still runs on the same port (a /proc
        read), else found again (a scan of /proc)."""
        if (
            before is not None
            and before.child is not None
            and before.port == port
            and process_start(before.child[0]) == before.child[1]
        ):
            return before.child
        return child_process(entry)

    def status(self) -> dict[str, str]:
        """Each model's status as last read."""
        with self._guard:
            return {model: running.status for model, running in self._seen.items()}

    def _start(self, model: str, *, woke: bool) -> bool:
        with self._guard:
            if not self.enabled or model in self._warming:
                return False
            self._warming.add(model)
        log.info("the router %s %s: warm start of its slots", "woke" if woke else "loaded", model)

        def work() -> None:
            try:
                engine = self._engine_for(model)
                for line in engine.warm_loaded(woke=woke, deadline=Deadline.after(self._warm_s)):
                    log.info("warm start after the load of %s: %s", model, line)
            except Exception:  # a warm start must never take the watch down
                log.exception("warm start after the load of %s failed", model)
            finally:
                with self._guard:
                    self._warming.discard(model)

        threading.Thread(target=work, name=f"ocpc-warm-load-{model}"[:60], daemon=True).start()
        return True


class Models:
    """The router's models by name and alias -> canonical id (``GET /models``, read again every
    ``MODELS_TTL_S``; answered by the router itself, so it loads nothing)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._guard = threading.Lock()
        self._names: dict[str, str] = {}
        self._read_at = float("-inf")

    def canonical(self, name: str) -> str | None:
        with self._guard:
            if (
                name not in self._names
                and time.monotonic() - self._read_at > 1.0
                or time.monotonic() - self._read_at > MODELS_TTL_S
            ):
                self._names = self._read() or self._names
                self._read_at = time.monotonic()
            return self._names.get(name)

    def _read(self) -> dict[str, str] | None:
        entries = read_models(self.url)
        if entries is None:
            log.info("cannot read the router's models at %s", self.url)
            return None
        names: dict[str, str] = {}
        for entry in entries:
            names[entry["id"]] = entry["id"]
            for alias in entry.get("aliases") or []:
                if isinstance(alias, str):
                    names.setdefault(alias, entry["id"])
        return names


class _Engines:
    """The watch and usage flush of every model's Engine, as ``ProxyServer`` runs a Engine's,
    and the load watch's tick before them."""

    def __init__(self, proxies: Callable[[], list[Proxy]], loads: LoadWatch) -> None:
        self._proxies = proxies
        self._loads = loads

    def watch(self) -> None:
        self._loads.tick()
        for proxy in self._proxies():
            proxy.engine.watch()

    def flush_usage(self) -> None:
        for proxy in self._proxies():
            proxy.engine.flush_usage()


class RouterProxy:
    """The proxy in front of a router: one ``Proxy`` (and Engine) per model, made on first use."""

    def __init__(
        self, *, settings: Settings, server_url: str, make: Callable[[str | None], Proxy], warm_on_load: bool = True
    ) -> None:
        """``warm_on_load``: warm-start a model's slots when the router loads it (``LoadWatch``,
        run by the watch: ``ProxyServer(watch=True)``; under ``ocpc launch`` the daemon runs it)."""
        self.settings = settings
        self.server = server_url.rstrip("/")
        self.models = Models(self.server)
        self._make = make
        self._guard = threading.Lock()
        self._proxies: dict[str | None, Proxy] = {}
        self._origins: frozenset[str] = frozenset()
        self.loads = LoadWatch(
            self.server,
            engine_for=lambda model: self.proxy_for(model).engine,
            made=self._made_engine,
            enabled=warm_on_load,
        )
        self.engine = _Engines(self._all, self.loads)

    @property
    def own_origins(self) -> frozenset[str]:
        return self._origins

    @own_origins.setter
    def own_origins(self, origins: frozenset[str]) -> None:
        with self._guard:
            self._origins = origins
            for proxy in self._proxies.values():
                proxy.own_origins = origins

    def _all(self) -> list[Proxy]:
        with self._guard:
            return list(self._proxies.values())

    def _made_engine(self, model: str) -> Engine | None:
        with self._guard:
            proxy = self._proxies.get(model)
        return proxy.engine if proxy is not None else None

    def proxy_for(self, model: str | None) -> Proxy:
        """The Proxy of a model id (None: a request that names no known model: passed through)."""
        with self._guard:
            proxy = self._proxies.get(model)
            if proxy is None:
                proxy = self._proxies[model] = self._make(model)
                proxy.own_origins = self._origins
                log.info("router model %s: its own Engine (%s)", model or "(none)", proxy.server)
            return proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        kind = route_of(PROXY_ROUTES, scope["method"], scope["path"])
        refusal = Guard(own_origins=self._origins).judge(kind, headers)  # the same guard as each model's proxy
        if refusal is not None:
            await _json_answer(send, refusal.status, {"error": refusal.reason})
            return
        if kind is Route.OWN:
            if scope["path"] == "/ocpc/status" and scope["method"] == "GET":
                await self._status(scope, receive, send)
            else:
                await _json_answer(send, 404, {"error": f"no such ocpc route: {scope['method']} {scope['path']}"})
            return
        if scope["method"] != "POST" or scope["path"] not in API_PATHS:
            await self.proxy_for(None)(scope, receive, send)  # passed through as it is
            return
        try:
            raw, complete = await read_body(receive, limit=MAX_BODY_BYTES, declared=headers.get("content-length"))
        except ClientGone:
            return
        model = await asyncio.to_thread(self._model_of, raw) if complete else None
        await self.proxy_for(model)(scope, _replay(raw, complete, receive), send)

    def _model_of(self, raw: bytes) -> str | None:
        try:
            name = json.loads(raw).get("model")
        except (ValueError, AttributeError, RecursionError):
            return None
        return self.models.canonical(name) if isinstance(name, str) else None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for proxy in self._all():
                    await proxy.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _status(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Each model's proxy status, under its id (``GET /ocpc/status``)."""
        with self._guard:
            items = list(self._proxies.items())
        await _json_answer(
            send,
            200,
            {
                "router": self.server,
                "models": {model or "": proxy.status() for model, proxy in items},
                "loaded": self.loads.status(),
            },
        )

    def close(self) -> None:
        for proxy in self._all():
            proxy.close()


async def _json_answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(raw: bytes, complete: bool, receive: Receive) -> Receive:
    """A ``receive`` that first gives back the body already read, then the client's own messages."""
    sent = False

    async def again() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": not complete}
        return await receive()

    return again
