"""``ocpc gateway``'s front: where the agents' requests get their conversation key, before the gateway.

Many boxes (docs/scale.md): agents -> this front (loopback) -> smg (routes) -> each box's ocpc door
-> its llama-server. The adapters run here, not on the boxes, because they read what the gateway
does not forward: an agent's ``User-Agent`` (which adapter) and its session headers (which
conversation). smg forwards only ``authorization``, ``x-request-id*``, trace headers and
``x-smg-routing-key``; so the front puts the conversation's key (harness/routing_key.py) in that
one header, which smg hashes to pick the box and the box reads back to name the conversation.

What the front changes: it adds the routing key and sends the deployment's token as the request's
``Authorization`` (doors/token.py; the agent's own placeholder key is replaced). The body goes on
as the agent sent it: the box normalises it, as its proxy does for a local agent, so one place
decides what a request becomes. One exception, for the gateway's sake: smg's Responses schema
refuses a field it does not know with HTTP 400, and Codex sends one (``client_metadata``, which
llama-server ignores), so a Responses body goes on without such fields (``gateway-responses-fields``,
switchable off like every normalisation; docs/scale.md says what smg itself adds to it). A
request it cannot key (not JSON, too big, a title) goes on without a key: smg then picks any box,
which serves it as plain llama-server would.

A web page's request (a foreign ``Origin`` or ``Host``) is refused here with 403: the front would
send it with the deployment's token, and a page must not spend that (doors/guard.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache import __version__
from oc_prefix_cache.chat import responses
from oc_prefix_cache.chat.anthropic import to_chat
from oc_prefix_cache.chat.head import MAX_BODY_BYTES
from oc_prefix_cache.doors.forward import Bounds, Counters, Forwarder
from oc_prefix_cache.doors.guard import FRONT_ROUTES, Guard, Route, route_of
from oc_prefix_cache.doors.relay import Receive, Scope, Send, dump, headers_of, path_of, read_body, rest
from oc_prefix_cache.doors.token import TokenFile
from oc_prefix_cache.errors import TranslationError
from oc_prefix_cache.harness import Incoming, door_adapters, select
from oc_prefix_cache.harness.routing_key import HEADER, routing_key
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.front")

#: The top-level fields smg 1.13.0's Responses schema takes (its 400 for any other lists them).
#: Codex sends one more, ``client_metadata`` (turn ids; llama-server ignores it): smg refuses the
#: request whole (HTTP 400), so the front leaves out what smg would refuse ("gateway-responses-fields").
SMG_RESPONSES_FIELDS = frozenset(
    "include background input instructions max_output_tokens max_tool_calls metadata model conversation "
    "parallel_tool_calls previous_response_id reasoning service_tier store stream temperature tool_choice "
    "tools top_logprobs top_p truncation text user request_id priority frequency_penalty presence_penalty "
    "stop prompt prompt_cache_key prompt_cache_retention safety_identifier stream_options context_management "
    "top_k min_p repetition_penalty".split()
)
NORMALISATION = "gateway-responses-fields"

API_PATHS = {
    "/v1/chat/completions": "openai",
    "/chat/completions": "openai",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
    "/responses": "responses",
}


@dataclass(frozen=True)
class Keyed:
    """What the front read of one request: its adapter and its routing key (None: not keyed)."""

    adapter: str
    key: str | None
    why_not: str = ""
    body: bytes | None = None  # the body to send instead of the agent's (a normalisation), else None


class Front:
    """The ASGI application before the gateway. ``gateway``: smg's ``http://host:port``."""

    def __init__(self, *, settings: Settings, gateway: str, tokens: TokenFile, bounds: Bounds | None = None) -> None:
        self.settings = settings
        self.server = gateway  # what the door forwards to (ProxyServer logs it)
        self.tokens = tokens
        self.bounds = bounds or Bounds()
        self.counters = Counters()
        self.forward = Forwarder(server=gateway, bounds=self.bounds, counters=self.counters, who="gateway front")
        self.own_origins: frozenset[str] = frozenset()
        self._adapters, self._generic = door_adapters(markers=settings.markers, off=settings.normalisations_off)
        self._recent: deque[dict[str, Any]] = deque(maxlen=64)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.forward.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = headers_of(scope)
        self.counters.add("requests")
        kind = route_of(FRONT_ROUTES, scope["method"], scope["path"])
        guard = Guard(own_origins=self.own_origins)
        if kind is Route.OWN:
            refusal = guard.judge(kind, headers)
            if refusal is not None:
                self.counters.add("refused:ocpc")
                await self.forward.json_answer(send, refusal.status, {"error": refusal.reason})
            elif scope["path"] == "/ocpc/status" and scope["method"] == "GET":
                await self.forward.json_answer(send, 200, self.status())
            else:
                await self.forward.json_answer(send, 404, {"error": f"no such ocpc route: {scope['path']}"})
        elif kind is Route.PROBE:
            await self.forward.json_answer(send, 200, {"status": "ok"})
        elif kind is Route.API and guard.foreign(headers):  # it would go on with the token: never a page's
            self.counters.add("refused:foreign")
            await self.forward.json_answer(
                send, 403, {"error": "ocpc's gateway front serves programs on this machine, not web pages"}
            )
        elif kind is Route.API:
            await self._onward(scope, receive, send, headers)
        else:
            self.counters.add("refused:not_api")
            await self.forward.json_answer(
                send,
                404,
                {
                    "error": f"the gateway front forwards the agents' API only, not {scope['method']} {scope['path']}; "
                    "smg's own routes are the gateway's, and the slot API is each box's (`ocpc status` there)"
                },
            )

    async def _onward(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        """Every request goes on to the gateway with the token; an API request with its key."""
        sent = {k: v for k, v in headers.items() if k not in ("authorization", HEADER)}
        sent["authorization"] = f"Bearer {self.tokens.current()}"
        api = API_PATHS.get(scope["path"]) if scope["method"] == "POST" else None
        body: bytes | None = None
        if api is not None:
            raw, complete = await read_body(receive, limit=MAX_BODY_BYTES, declared=headers.get("content-length"))
            if complete:
                keyed = await asyncio.to_thread(self.key_of, api, headers, raw)
                body = keyed.body if keyed.body is not None else raw
            else:
                keyed = Keyed(adapter="", key=None, why_not="oversized")
                body = None
                await self.forward.relay(
                    scope, receive, send, headers=sent, path=path_of(scope), body=rest(raw, receive)
                )
                self._remember(scope["path"], keyed)
                return
            if keyed.key:
                sent[HEADER] = keyed.key
                self.counters.add(f"keyed:{keyed.adapter}")
            else:
                self.counters.add(f"not_keyed:{keyed.why_not}")
            self._remember(scope["path"], keyed)
        await self.forward.relay(scope, receive, send, headers=sent, path=path_of(scope), body=body)

    def key_of(self, api: str, headers: dict[str, str], raw: bytes) -> Keyed:
        """The routing key of one request, read as the box's proxy reads it (same adapters, same
        normalisation); never raises: a request that cannot be keyed goes on without one."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                return Keyed(adapter="", key=None, why_not="not_json")
            incoming = Incoming(api=api, headers=headers, body=data)
            adapter = select(incoming, enabled=self.settings.adapters, adapters=self._adapters, fallback=self._generic)
            body, _ = adapter.normalise(incoming)
            chat = to_chat(body) if api == "anthropic" else responses.prepared(body) if api == "responses" else body
            key = adapter.key(incoming, chat)
        except (ValueError, RecursionError, TranslationError) as exc:
            return Keyed(adapter="", key=None, why_not=f"unreadable: {type(exc).__name__}")
        except Exception:  # noqa: BLE001 (a bug of ours: the request goes on, unkeyed)
            log.exception("keying a request failed; it goes on without a routing key")
            return Keyed(adapter="", key=None, why_not="internal")
        value = routing_key(adapter.name, key)
        sent = self._for_the_gateway(api, data)
        return Keyed(adapter=adapter.name, key=value, why_not="" if value else "no_conversation", body=sent)

    def _for_the_gateway(self, api: str, data: dict[str, Any]) -> bytes | None:
        """A Responses body without the fields smg's schema refuses (``SMG_RESPONSES_FIELDS``); None
        when nothing is left out (the agent's bytes go on) or the normalisation is switched off."""
        if api != "responses" or NORMALISATION in self.settings.normalisations_off:
            return None
        kept = {k: v for k, v in data.items() if k in SMG_RESPONSES_FIELDS}
        if len(kept) == len(data):
            return None
        self.counters.add(f"normalised:{NORMALISATION}")
        return dump(kept)

    def _remember(self, path: str, keyed: Keyed) -> None:
        self._recent.append(
            {"at": time.time(), "path": path, "adapter": keyed.adapter, "key": keyed.key, "why_not": keyed.why_not}
        )

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "gateway": self.server,
            "counters": self.counters.snapshot(),
            "recent": list(self._recent),
        }

    def close(self) -> None:
        """Nothing runs in threads of its own (ProxyServer calls this after it stops)."""
