"""The one guard every route of every door goes through: who may drive ocpc, and through it the server.

ocpc's doors listen on loopback, but a web page in the user's browser can still reach them: it
may POST ``text/plain`` to ``127.0.0.1`` without a preflight, and a DNS-rebinding page (a name of
the attacker's that later resolves to ``127.0.0.1``) can even read the answers of GET requests.
So each door names the kind of every route it serves (``Route``), and ``Guard.judge`` decides
for all of them by the same rules, from the two headers a browser cannot leave out or forge:

* **ocpc's own routes** (the daemon's every route, ``/ocpc/*`` on the proxy and the router):
  local programs only. Any ``Origin`` (a browser always sends one on a cross-site request, and on
  every POST), or a ``Host`` that is not one of the door's own names, is refused with 403: they
  show conversation keys, session ids and slot holdings, and they make ocpc prefill and park.
* **llama-server's control routes through a door** (``/slots`` and its save, restore and erase
  actions; a router's ``/models/load`` and ``/models/unload``; ``/lora-adapters``): refused the same
  way, except that the door's own origin (the server's web UI opened through the door) is not
  foreign. A page must not erase a slot or read what it holds.
* **the agents' API** (chat completions, messages, responses): forwarded as it comes from any
  origin, the way llama-server itself answers it, but never prepared for a foreign origin or
  host: a page must not make ocpc prefill, save or evict heads (``foreign``).
* **everything else** (the web UI, ``/props``, ``/health``, ``/v1/models``, ``/tokenize``):
  passed through untouched, as llama-server would answer it.

* **a box's network door** (``ocpc launch --listen``, many boxes: docs/scale.md) serves the agents'
  API and nothing else, to requests that carry the deployment's token (``Authorization: Bearer``,
  doors/token.py), with 401 to those that do not; ``GET /health`` answers without it (the gateway's
  probe, which says nothing). ocpc's own routes, the slot API and the rest of llama-server's routes
  stay on loopback: 403 there. The token is required because the door was told to listen on a
  network, whatever its address: a door on 127.0.0.2 asks for it exactly as one on a LAN does.

Pure: no I/O. The doors map a refusal to their own answer; tests/unit/doors/test_guard.py walks every
route each door declares (``DAEMON_ROUTES``, ``PROXY_ROUTES``) with a foreign ``Origin`` and a
foreign ``Host``.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from oc_prefix_cache.doors.token import bearer

#: A network door listening on every address answers to any name (the token guards it).
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
#: The names a loopback door answers to (``Host`` without its port).
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


class Route(Enum):
    OWN = "ocpc"  # ocpc's own: local programs only
    CONTROL = "server-control"  # llama-server's slot, model and adapter control, through a door
    API = "agents-api"  # the agents' API: forwarded from anyone, prepared only for local programs
    PASS = "pass-through"  # the rest of llama-server's routes: untouched
    PROBE = "probe"  # a network door's health probe: answered without the token


@dataclass(frozen=True)
class RouteRule:
    """One route of a door: its method (``*``: any), a path pattern (a regular expression matched
    against the path without its query) and its kind; ``example`` is a real path of it, for the
    test that walks every route."""

    method: str
    pattern: str
    kind: Route
    example: str

    def matches(self, method: str, path: str) -> bool:
        return self.method in ("*", method) and re.fullmatch(self.pattern, path) is not None


#: Every route of the plugin's daemon: all of them ocpc's own (an unknown path is too: 404 after the guard).
DAEMON_ROUTES: tuple[RouteRule, ...] = (
    RouteRule("GET", "/health", Route.OWN, "/health"),
    RouteRule("GET", "/v1/status", Route.OWN, "/v1/status"),
    RouteRule("POST", "/v1/prepare", Route.OWN, "/v1/prepare"),
    RouteRule("POST", "/v1/report", Route.OWN, "/v1/report"),
    RouteRule("POST", "/v1/park", Route.OWN, "/v1/park"),
    RouteRule("*", ".*", Route.OWN, "/anything/else"),
)

#: Every route of the proxy (and of the router's proxy, which serves the same paths), first match wins.
PROXY_ROUTES: tuple[RouteRule, ...] = (
    RouteRule("*", "/ocpc(/.*)?", Route.OWN, "/ocpc/status"),
    RouteRule("*", "/slots(/.*)?", Route.CONTROL, "/slots/0"),
    RouteRule("POST", "/models/(load|unload)", Route.CONTROL, "/models/unload"),
    RouteRule("POST", "/lora-adapters", Route.CONTROL, "/lora-adapters"),
    RouteRule("POST", "/(v1/)?(chat/completions|messages|responses)", Route.API, "/v1/chat/completions"),
    RouteRule("*", ".*", Route.PASS, "/props"),
)


#: The agents' API as a path: what a gateway forwards and a box's network door serves.
AGENT_API = "/(v1/)?(chat/completions|messages|messages/count_tokens|responses|completions)"

#: Every route of a box's network door: the agents' API (with the token), a probe, and nothing else.
NETWORK_ROUTES: tuple[RouteRule, ...] = (
    RouteRule("GET", "/health", Route.PROBE, "/health"),
    RouteRule("GET", "/(v1/)?models", Route.API, "/v1/models"),
    RouteRule("POST", AGENT_API, Route.API, "/v1/chat/completions"),
    RouteRule("*", "/ocpc(/.*)?", Route.OWN, "/ocpc/status"),
    RouteRule("*", "/slots(/.*)?", Route.CONTROL, "/slots/0"),
    RouteRule("*", ".*", Route.PASS, "/props"),
)

#: Every route of ``ocpc gateway``'s front: the agents' API goes on to the gateway with the token;
#: nothing else does (smg's own routes, ``/workers`` and the rest, accept that token as its API key:
#: a web page or a stray request must never reach them through the front). Its ``/health`` is its own.
FRONT_ROUTES: tuple[RouteRule, ...] = (
    RouteRule("*", "/ocpc(/.*)?", Route.OWN, "/ocpc/status"),
    RouteRule("GET", "/health", Route.PROBE, "/health"),
    RouteRule("GET", "/(v1/)?models", Route.API, "/v1/models"),
    RouteRule("POST", AGENT_API, Route.API, "/v1/chat/completions"),
    RouteRule("*", ".*", Route.CONTROL, "/workers"),
)


def route_of(rules: tuple[RouteRule, ...], method: str, path: str) -> Route:
    """The kind of ``method path`` (query left out) under a door's rules: the first that matches."""
    bare = path.split("?", 1)[0]
    for rule in rules:
        if rule.matches(method, bare):
            return rule.kind
    return Route.OWN  # a door's table ends with a catch-all; should one not, the strictest rule


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str


def host_name(host: str | None) -> str:
    """The name in a ``Host`` header, without its port or IPv6 brackets ("" when none)."""
    value = (host or "").strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value[1:]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class Guard:
    """A door's guard: the names it answers to, and its own origins (the door's own URLs: the
    server's web UI opened through it)."""

    hosts: frozenset[str] = LOOPBACK_NAMES
    own_origins: frozenset[str] = field(default_factory=frozenset)
    #: a network door's accepted tokens (doors/token.py); None: a loopback door, which asks for none.
    #: An empty set (the token file became unreadable) refuses everyone.
    tokens: frozenset[str] | None = None

    def judge(self, kind: Route, headers: Mapping[str, str]) -> Refusal | None:
        """None when ``headers`` (lower-cased names) may use a route of this kind; else why not."""
        if self.tokens is not None:
            return self._judge_network(kind, headers)
        if kind in (Route.API, Route.PASS, Route.PROBE):
            return None
        origin = headers.get("origin")
        if origin is not None and (kind is Route.OWN or origin.rstrip("/") not in self.own_origins):
            return Refusal(
                403,
                "requests from web pages are refused: ocpc's and the slots' routes are for programs on this machine",
            )
        name = host_name(headers.get("host"))
        if name not in self.hosts:
            return Refusal(403, f"Host {name!r} is not a name of this door ({', '.join(sorted(self.hosts))})")
        return None

    def _judge_network(self, kind: Route, headers: Mapping[str, str]) -> Refusal | None:
        """The token first (a request without it learns nothing, not even the door's names), then
        the route (the agents' API only), then the name it was sent to: the door's own address or
        name, any when it listens on every address (0.0.0.0, ::)."""
        if kind is Route.PROBE:
            return None
        given = bearer(headers)
        # each accepted token compared in constant time: the answer's timing tells nothing
        if given is None or not any([hmac.compare_digest(given.encode(), t.encode()) for t in self.tokens or ()]):
            return Refusal(
                401,
                "this box's door asks for the deployment's token (Authorization: Bearer, the file `ocpc token` "
                "writes); send it through `ocpc gateway`, or with smg's --api-key",
            )
        if kind is not Route.API:
            return Refusal(
                403,
                "only the agents' API is served on a box's network door; "
                "ocpc's and the server's other routes stay on loopback",
            )
        name = host_name(headers.get("host"))
        if not self.hosts & WILDCARD_HOSTS and name not in self.hosts:
            return Refusal(403, f"Host {name!r} is not a name of this door ({', '.join(sorted(self.hosts))})")
        return None

    def foreign(self, headers: Mapping[str, str]) -> str:
        """Why an agents' API request must not be prepared ("" when it may): a web page's origin or a
        name that is not this door's (a rebound DNS name)."""
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self.own_origins:
            return "foreign_origin"
        return "" if host_name(headers.get("host")) in self.hosts else "foreign_host"
