"""A small, time-bounded client for the llama-server endpoints ocpc uses.

Every method has its own timeout (a health check must not wait as long as a cold prefill).
Its calls fail with ``ServerError``s made at one edge (``loopback.py``: its clients' transport,
its ``socket_errors`` for the fast GET), each naming the URL and what to do; a method adds what
it was doing where that says more (which endpoint, what it meant for the request).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.errors import (
    ServerError,
    ServerHTTPError,
    ServerTimeout,
    ServerUnreachable,
    SlotRestoreFailed,
    SlotSaveDisabled,
)


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds per kind of call; ``connect`` bounds every call's connection."""

    connect: float = 1.0
    quick: float = 5.0  # /health, /props, /slots, /tokenize, /apply-template
    probe: float = 60.0  # a few-token /completion against a warm slot
    prefill: float = 900.0  # the deliberate cold prefill of a head
    slot_io: float = 120.0  # save / restore / erase: file I/O of up to GBs


@dataclass(frozen=True)
class Timings:
    """What the server says one request cost: the only trustworthy reuse signal."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int = 0  # tokens generated

    @classmethod
    def from_response(cls, data: dict[str, Any]) -> Timings:
        timings = data.get("timings")
        if not isinstance(timings, dict):
            raise ServerError("the server's answer carries no timings")
        try:
            return cls(
                cache_n=int(timings.get("cache_n", 0)),
                prompt_n=int(timings.get("prompt_n", 0)),
                prompt_ms=float(timings.get("prompt_ms", 0.0)),
                predicted_n=int(timings.get("predicted_n", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise ServerError(f"the server's timings are malformed: {timings!r:.200}") from exc


class SlotClient:
    """llama-server's slot API, every call bounded and its errors translated here.

    ``model``: the model's id behind a llama-server **router** (``--models-dir``): every call goes
    to the router with it (``"model"`` in a POST body, ``?model=`` on a GET) and reaches that
    model's child server. A call made inside ``background()`` (the watch, parks ahead, a warm start
    after a load) also says ``?autoload=false``: ocpc's own work on a model the router unloaded
    meanwhile must not load it again (and evict another); the router answers 400 instead.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeouts: Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        model: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # what ocpc's state is keyed by: the server, or the router and one of its models
        self.server_id = self.base_url if model is None else f"{self.base_url}#model={model}"
        self.timeouts = timeouts or Timeouts()
        # never through a proxy; a request the server dropped on a kept-alive connection it had
        # just closed (a router closes its side after proxying) goes once more: it never reached it
        self._http = loopback.client(self.base_url, transport=transport, what="llama-server", resend_stale=True)
        parts = urlsplit(self.base_url)
        # The hit path's one call, GET /slots, over a kept-alive http.client connection per
        # thread: 0.19 ms p50 against httpx's 0.45 ms (measured on loopback). Plain http only,
        # and not when a transport is given (tests count calls through it).
        self._fast = (parts.hostname or "", parts.port or 80) if parts.scheme == "http" and transport is None else None
        self._local = threading.local()
        # told of every evaluation's timings (ocpc's own prefills: the event log counts them)
        self.on_evaluate: Callable[[int, Timings], None] | None = None

    @contextmanager
    def background(self) -> Iterator[None]:
        """Calls in this block (this thread) never load a router's model (see the class)."""
        self._local.background = True
        try:
            yield
        finally:
            self._local.background = False

    def _routed(self, method: str, path: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The path and request arguments, with the router's model when there is one."""
        if self.model is None:
            return path, kwargs
        query = {"autoload": "false"} if getattr(self._local, "background", False) else {}
        if method == "GET":
            query = {"model": self.model} | query
        else:
            kwargs = kwargs | {"json": {**(kwargs.get("json") or {}), "model": self.model}}
        return path, kwargs | ({"params": {**(kwargs.get("params") or {}), **query}} if query else {})

    def ensure_loaded(self, *, deadline: Deadline) -> bool:
        """Behind a router: load this client's model if it is not (what the request would make the
        router do anyway), and wait for it within ``deadline``. True when it was loaded here. Without
        this, ocpc's first call to an unloaded model waited for the load past its own timeout."""
        if self.model is None:
            return False
        loaded = False
        while True:
            state = self._model_state(deadline)
            if state == "loaded":
                return loaded
            if state in ("unloaded", "sleeping", None):
                try:
                    self._send(
                        "POST",
                        "/models/load",
                        json={"model": self.model},
                        timeout=self._t(self._within(self.timeouts.quick, deadline, "load the model")),
                    )
                except ServerError as exc:
                    raise ServerUnreachable(
                        f"cannot ask the router at {self.base_url} to load {self.model}: {exc}"
                    ) from exc
                loaded = True
            deadline.bound(0.1, what=f"wait for the router to load {self.model}")
            time.sleep(0.1)

    def _model_state(self, deadline: Deadline) -> str | None:
        """The router's status of this client's model (``GET /models``: loads nothing)."""
        status = self.model_entry(deadline=deadline).get("status")
        return status.get("value") if isinstance(status, dict) else None

    def model_entry(self, *, deadline: Deadline) -> dict[str, Any]:
        """This client's model as the router's ``GET /models`` lists it (its status, and while it
        runs, the child's arguments: ``status.args``). Answered by the router: loads nothing."""
        try:
            data = self._send(
                "GET",
                "/models",
                timeout=self._t(self._within(self.timeouts.quick, deadline, "read the router's models")),
            ).json()
        except (ServerError, ValueError) as exc:
            raise ServerUnreachable(f"cannot read the router's models at {self.base_url}: {exc}") from exc
        for entry in data.get("data", []) if isinstance(data, dict) else []:
            if isinstance(entry, dict) and (
                entry.get("id") == self.model or self.model in (entry.get("aliases") or [])
            ):
                return entry
        raise ServerError(f"the router at {self.base_url} has no model {self.model!r}")

    def close(self) -> None:
        self._http.close()
        conn = getattr(self._local, "conn", None)
        if conn is not None:  # other threads' connections close with their sockets' owners
            conn.close()

    def __enter__(self) -> SlotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain reads -------------------------------------------------------------------
    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=self._t(self.timeouts.quick)).status_code == 200
        except ServerError:
            return False

    def props(self, *, deadline: Deadline | None = None) -> dict[str, Any]:
        return self._json("GET", "/props", timeout=self._within(self.timeouts.quick, deadline, "read /props"))

    def slots(self, *, deadline: Deadline | None = None) -> list[dict[str, Any]]:
        timeout = self._within(self.timeouts.quick, deadline, "read /slots")
        try:
            if self._fast is not None and self.model is None:
                data = json.loads(self._get_fast("/slots", timeout))
            else:
                data = self._call("GET", "/slots", timeout=timeout).json()
        except ValueError as exc:
            raise ServerError(f"{self.base_url}/slots answered with invalid JSON") from exc
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            raise ServerError(f"{self.base_url}/slots did not return a list of slots")
        return data

    def metrics(self, *, deadline: Deadline | None = None) -> dict[str, float] | None:
        """The server's Prometheus counters (``llamacpp:`` names), or None without ``--metrics``."""
        try:
            response = self._call(
                "GET", "/metrics", timeout=self._within(self.timeouts.quick, deadline, "read /metrics")
            )
        except ServerHTTPError:
            return None
        out: dict[str, float] = {}
        for line in response.text.splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line.partition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def lora_adapters(self, *, deadline: Deadline | None = None) -> list[dict[str, Any]]:
        """``GET /lora-adapters``: every loaded adapter with its global scale ([] on builds
        without the endpoint, which cannot change adapters at runtime)."""
        try:
            response = self._call(
                "GET", "/lora-adapters", timeout=self._within(self.timeouts.quick, deadline, "read /lora-adapters")
            )
        except ServerHTTPError as exc:
            if exc.status in (404, 405):
                return []
            raise
        try:
            data = response.json()
        except ValueError as exc:
            raise ServerError(f"{self.base_url}/lora-adapters answered with invalid JSON") from exc
        if not isinstance(data, list):
            raise ServerError(f"{self.base_url}/lora-adapters did not return a list of adapters")
        return [item for item in data if isinstance(item, dict)]

    def apply_template(self, body: dict[str, Any], *, deadline: Deadline | None = None) -> str:
        data = self._json(
            "POST",
            "/apply-template",
            json=body,
            timeout=self._within(self.timeouts.quick, deadline, "render the request"),
        )
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise ServerError(f"{self.base_url}/apply-template returned no prompt")
        return prompt

    def tokenize_pieces(self, content: str, *, deadline: Deadline | None = None) -> list[tuple[int, bytes]]:
        """Tokens of ``content`` as the server tokenizes a prompt, each with its bytes."""
        data = self._json(
            "POST",
            "/tokenize",
            json={"content": content, "add_special": True, "parse_special": True, "with_pieces": True},
            timeout=self._within(self.timeouts.quick, deadline, "tokenize the request"),
        )
        out: list[tuple[int, bytes]] = []
        for item in data.get("tokens", []):
            piece = item["piece"]
            raw = piece.encode() if isinstance(piece, str) else bytes(piece)
            out.append((int(item["id"]), raw))
        return out

    def tokenize(self, content: str, *, add_special: bool, deadline: Deadline | None = None) -> list[int]:
        """Token ids of ``content`` (special tokens parsed, as in a prompt)."""
        data = self._json(
            "POST",
            "/tokenize",
            json={"content": content, "add_special": add_special, "parse_special": True},
            timeout=self._within(self.timeouts.quick, deadline, "tokenize the request"),
        )
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ServerError(f"{self.base_url}/tokenize returned no token list")
        return tokens

    def detokenize(self, tokens: list[int], *, deadline: Deadline | None = None) -> str:
        """The text of ``tokens``, special tokens included (as a prompt has them)."""
        data = self._json(
            "POST",
            "/detokenize",
            json={"tokens": tokens},
            timeout=self._within(self.timeouts.quick, deadline, "detokenize"),
        )
        content = data.get("content")
        if not isinstance(content, str):
            raise ServerError(f"{self.base_url}/detokenize returned no text")
        return content

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(
        self, tokens: list[int], *, slot: int, prefill: bool = False, deadline: Deadline | None = None
    ) -> Timings:
        """Evaluate a token prompt in ``slot`` without generating (``n_predict: 0``)."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True}
        timeout = self.timeouts.prefill if prefill else self.timeouts.probe
        timeout = self._changing(timeout, deadline, f"evaluate {len(tokens)} tokens in slot {slot}")
        timings = Timings.from_response(self._json("POST", "/completion", json=body, timeout=timeout))
        if self.on_evaluate is not None:
            self.on_evaluate(slot, timings)
        return timings

    # -- slot actions --------------------------------------------------------------------
    def save(self, slot: int, filename: str, *, deadline: Deadline | None = None) -> dict[str, Any]:
        return self._slot_action(slot, "save", filename, deadline)

    def restore(self, slot: int, filename: str, *, deadline: Deadline | None = None) -> dict[str, Any]:
        try:
            return self._slot_action(slot, "restore", filename, deadline)
        except SlotSaveDisabled:
            raise
        except ServerHTTPError as exc:
            raise SlotRestoreFailed(
                f"llama-server refused to restore {filename} into slot {slot} ({exc}); "
                "the file is from another model or build, too big for -c, or missing"
            ) from exc

    def erase(self, slot: int, *, deadline: Deadline | None = None) -> dict[str, Any]:
        return self._slot_action(slot, "erase", None, deadline)

    def _slot_action(self, slot: int, action: str, filename: str | None, deadline: Deadline | None) -> dict[str, Any]:
        body = {"filename": filename} if filename is not None else {}
        timeout = self._changing(self.timeouts.slot_io, deadline, f"{action} slot {slot}")
        return self._json("POST", f"/slots/{slot}", params={"action": action}, json=body, timeout=timeout)

    def _get_fast(self, path: str, timeout: float) -> bytes:
        """GET over this thread's kept-alive connection; one retry on a fresh one (the server
        closes idle connections after 5 s). ``loopback.socket_errors`` maps its failures."""
        assert self._fast is not None
        for attempt in (1, 2):
            conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = http.client.HTTPConnection(*self._fast, timeout=min(timeout, self.timeouts.connect))
                self._local.conn = conn
            try:
                with loopback.socket_errors(f"{self.base_url}{path}", timeout=timeout, what="llama-server"):
                    if conn.sock is not None:
                        conn.sock.settimeout(timeout)
                    else:
                        conn.connect()
                        assert conn.sock is not None
                        conn.sock.settimeout(timeout)
                    conn.request("GET", path)
                    response = conn.getresponse()
                    body = response.read()
            except ServerError as exc:
                conn.close()
                self._local.conn = None
                if attempt == 2 or isinstance(exc, ServerTimeout):
                    raise
                continue
            if response.status == 503:
                raise ServerUnreachable(f"llama-server at {self.base_url} is still loading the model")
            if response.status >= 400:
                raise ServerHTTPError(
                    f"GET {self.base_url}{path} -> HTTP {response.status}: {body[:300]!r}", status=response.status
                )
            return body
        raise AssertionError("unreachable")

    # -- the one translation boundary ----------------------------------------------------
    @staticmethod
    def _within(timeout: float, deadline: Deadline | None, what: str) -> float:
        return timeout if deadline is None else deadline.bound(timeout, what=what)

    @staticmethod
    def _changing(timeout: float, deadline: Deadline | None, what: str) -> float:
        return timeout if deadline is None else deadline.before_slot_change(timeout, what=what)

    def _t(self, read: float) -> httpx.Timeout:
        return httpx.Timeout(read, connect=min(self.timeouts.connect, read))

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request (sent once more when the server had closed its kept-alive connection: the
        client's ``resend_stale``); failures are ``ServerError``s (the client's transport)."""
        return self._http.request(method, path, **kwargs)

    def _json(self, method: str, path: str, *, timeout: float, **kwargs: Any) -> dict[str, Any]:
        response = self._call(method, path, timeout=timeout, **kwargs)
        try:
            data = response.json()
        except ValueError as exc:
            raise ServerError(f"{self.base_url}{path} answered with invalid JSON") from exc
        if not isinstance(data, dict):
            raise ServerError(f"{self.base_url}{path} answered with {type(data).__name__}, not an object")
        return data

    def _call(self, method: str, path: str, *, timeout: float, **kwargs: Any) -> httpx.Response:
        path, kwargs = self._routed(method, path, kwargs)
        response = self._send(method, path, timeout=self._t(timeout), **kwargs)
        if response.status_code == 501 and path.startswith("/slots/"):
            raise SlotSaveDisabled(
                f"llama-server at {self.base_url} has no --slot-save-path; start it with `ocpc launch` or add the flag",
                status=501,
            )
        if response.status_code == 503:
            raise ServerUnreachable(f"llama-server at {self.base_url} is still loading the model")
        return loopback.raise_for_status(response)
