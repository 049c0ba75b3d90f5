"""Router mode: ocpc in front of a llama-server router (``--models-dir`` / ``--models-preset``).

A router serves several models behind one URL, each in a child server it starts on demand and
stops when ``--models-max`` is reached (the least recently used one goes) or when it sleeps. Its
API is the child's, with the model named in every call: ``"model"`` in a POST body, ``?model=``
on a GET (b11434, ``server-models.cpp``). So ocpc keeps one Preparer per model, each on a
``SlotClient(model=...)`` and keyed ``<router>#model=<id>``: its own tracker state, slots, files
(fingerprints cover the model, so one slot folder serves all) and counters.

The router gives no hook before it unloads a model. ocpc does not need one: a conversation left
idle is parked ahead (ahead.py) within seconds, and a model loaded again is a new process whose
slots show no task, which the tracker takes for a restart; the conversation's next turn restores
its park and processes only its new tokens. ocpc's own looks at a model (the watch) never load
it (``autoload=false``), so they never evict another.

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
from typing import Any

import httpx

from .head import MAX_BODY_BYTES
from .proxy import API_PATHS, Proxy
from .relay import ClientGone, Receive, Scope, Send, read_body
from .settings import Settings

log = logging.getLogger("ocpc.router")
MODELS_TTL_S = 30.0  # the router's model list (ids and aliases) is read again after this long


def is_router(url: str, *, timeout: float = 2.0) -> bool:
    """Whether ``url`` is a llama-server router (its own ``/props`` says ``role: router``)."""
    try:
        data = httpx.get(f"{url.rstrip('/')}/props", timeout=httpx.Timeout(timeout, connect=0.5)).json()
    except (httpx.HTTPError, ValueError):
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
            if name not in self._names and time.monotonic() - self._read_at > 1.0 or \
                    time.monotonic() - self._read_at > MODELS_TTL_S:
                self._names = self._read() or self._names
                self._read_at = time.monotonic()
            return self._names.get(name)

    def _read(self) -> dict[str, str] | None:
        try:
            data = httpx.get(f"{self.url}/models", timeout=httpx.Timeout(2.0, connect=0.5)).json()
        except (httpx.HTTPError, ValueError) as exc:
            log.info("cannot read the router's models (%s)", exc)
            return None
        entries = data.get("data") if isinstance(data, dict) else data
        names: dict[str, str] = {}
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                names[entry["id"]] = entry["id"]
                for alias in entry.get("aliases") or []:
                    if isinstance(alias, str):
                        names.setdefault(alias, entry["id"])
        return names


class _Preparers:
    """The watch and usage flush of every model's Preparer, as ``ProxyServer`` runs a Preparer's."""

    def __init__(self, proxies: Callable[[], list[Proxy]]) -> None:
        self._proxies = proxies

    def watch(self) -> None:
        for proxy in self._proxies():
            proxy.preparer.watch()

    def flush_usage(self) -> None:
        for proxy in self._proxies():
            proxy.preparer.flush_usage()


class RouterProxy:
    """The proxy in front of a router: one ``Proxy`` (and Preparer) per model, made on first use."""

    def __init__(self, *, settings: Settings, server_url: str, make: Callable[[str | None], Proxy]) -> None:
        self.settings = settings
        self.server = server_url.rstrip("/")
        self.models = Models(self.server)
        self._make = make
        self._guard = threading.Lock()
        self._proxies: dict[str | None, Proxy] = {}
        self._origins: frozenset[str] = frozenset()
        self.preparer = _Preparers(self._all)

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

    def proxy_for(self, model: str | None) -> Proxy:
        """The Proxy of a model id (None: a request that names no known model: passed through)."""
        with self._guard:
            proxy = self._proxies.get(model)
            if proxy is None:
                proxy = self._proxies[model] = self._make(model)
                proxy.own_origins = self._origins
                log.info("router model %s: its own Preparer (%s)", model or "(none)", proxy.server)
            return proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/ocpc/status" and scope["method"] == "GET":
            await self._status(scope, receive, send)
            return
        if scope["method"] != "POST" or scope["path"] not in API_PATHS:
            await self.proxy_for(None)(scope, receive, send)  # passed through as it is
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
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
        body = json.dumps({"router": self.server, "models": {
            model or "": proxy.status() for model, proxy in items}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def close(self) -> None:
        for proxy in self._all():
            proxy.close()


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
