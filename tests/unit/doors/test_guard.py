"""Every route of every door goes through one guard (issue 36, defect 5).

The class: a web page in the user's browser (a foreign ``Origin``) or a DNS-rebinding page (a
foreign ``Host``) must never read or drive ocpc's own routes or llama-server's slots through a
door; the agents' API is forwarded as llama-server would answer it, never prepared. These tests
walk each door's declared routes (``guard.DAEMON_ROUTES``, ``guard.PROXY_ROUTES``), so a route
added to a door is checked without a new test. The upstream is a stub: the question is what
the door lets through, not what the server does with it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as settings_of
from hypothesis import strategies as st

from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.doors.guard import DAEMON_ROUTES, PROXY_ROUTES, Guard, Route, host_name, route_of
from oc_prefix_cache.doors.proxy import Proxy
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.doors.router import RouterProxy
from oc_prefix_cache.engine.wiring import engine_for_url
from oc_prefix_cache.settings import Settings
from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("proxy_bench", ROOT / "bench" / "proxy_bench.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

FOREIGN = (
    {"origin": "http://evil.example"},
    {"host": "evil.example"},
    {"origin": "http://evil.example", "host": "evil.example:8766"},
    {"origin": "null"},
)
CHAT = {
    "model": "m",
    "messages": [{"role": "system", "content": "be brief <env>x"}, {"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "t", "parameters": {}}}],
}


def send(url: str, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    body = json.dumps(CHAT).encode() if method == "POST" else None
    with httpx.Client(trust_env=False, timeout=10) as client:
        return client.request(method, url + path, content=body, headers={"content-type": "application/json", **headers})


@pytest.fixture
def stub() -> Iterator[Any]:
    with bench.Stub(slots=2) as running:
        yield running


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})


def door_cases(rules: tuple[Any, ...]) -> list[tuple[str, str, Route]]:
    """(method, path, kind) for every route a door declares, each method where the rule takes any."""
    cases = []
    for rule in rules:
        for method in ("GET", "POST") if rule.method == "*" else (rule.method,):
            cases.append((method, rule.example, route_of(rules, method, rule.example)))
    return cases


def test_every_declared_route_classifies_as_its_rule_says() -> None:
    for rules in (DAEMON_ROUTES, PROXY_ROUTES):
        for rule in rules:
            method = "POST" if rule.method == "*" else rule.method
            assert route_of(rules, method, rule.example) is rule.kind, rule
    assert route_of(PROXY_ROUTES, "POST", "/slots/1?action=erase") is Route.CONTROL
    assert route_of(PROXY_ROUTES, "GET", "/slots") is Route.CONTROL
    assert route_of(PROXY_ROUTES, "POST", "/v1/messages") is Route.API
    assert route_of(PROXY_ROUTES, "GET", "/v1/chat/completions") is Route.PASS


def test_host_names_are_read_with_ports_and_brackets() -> None:
    assert [host_name(h) for h in ("127.0.0.1:8766", "[::1]:8766", "[::1]", "LOCALHOST", "evil:1", "", None)] == [
        "127.0.0.1",
        "::1",
        "::1",
        "localhost",
        "evil",
        "",
        "",
    ]
    guard = Guard(own_origins=frozenset({"http://127.0.0.1:8766"}))
    assert guard.judge(Route.CONTROL, {"origin": "http://127.0.0.1:8766/", "host": "127.0.0.1:8766"}) is None
    assert guard.judge(Route.OWN, {"origin": "http://127.0.0.1:8766", "host": "127.0.0.1:8766"}) is not None


def test_the_daemon_refuses_every_route_to_web_pages(settings: Settings, stub: Any) -> None:
    daemon = Daemon(settings=settings, server_url=stub.url, port=0)
    daemon.start()
    try:
        for method, path, _ in door_cases(DAEMON_ROUTES):
            for headers in FOREIGN:
                answer = send(daemon.url, method, path, headers)
                assert answer.status_code == 403, (method, path, headers, answer.text)
        assert send(daemon.url, "GET", "/health", {}).status_code == 200  # a local program is served
        assert not [s for s in stub.seen if s["method"] == "POST"], "a refused prepare reached the server"
    finally:
        daemon.stop()


@pytest.mark.parametrize("front", ["proxy", "router"])
def test_the_proxy_and_the_router_guard_every_route(front: str, settings: Settings, stub: Any) -> None:
    if front == "proxy":
        app: Proxy | RouterProxy = Proxy(settings=settings, engine=engine_for_url(settings, server_url=stub.url))
    else:
        app = RouterProxy(
            settings=settings,
            server_url=stub.url,
            warm_on_load=False,
            make=lambda model: Proxy(
                settings=settings, engine=engine_for_url(settings, server_url=stub.url, model=model)
            ),
        )
    server = ProxyServer(app, port=0)
    server.start()
    try:
        for method, path, kind in door_cases(PROXY_ROUTES):
            for headers in FOREIGN:
                before = len(stub.seen)
                answer = send(server.url, method, path, headers)
                reached = [s["path"] for s in stub.seen[before:]]
                if kind in (Route.OWN, Route.CONTROL):
                    assert answer.status_code == 403, (front, method, path, headers, answer.text)
                    assert not reached, (front, method, path, headers, reached)
                else:  # forwarded as the server would answer it; an API request is never prepared
                    assert answer.status_code == 200, (front, method, path, headers)
                    assert path in [p.split("?")[0] for p in reached], (path, reached)
        own = json.loads(send(server.url, "GET", "/ocpc/status", {}).text)
        assert own  # a local program reads it
        proxies = [app] if isinstance(app, Proxy) else list(app._all())
        counters: dict[str, int] = {}
        for proxy in proxies:
            for key, value in proxy.counters.snapshot().items():
                counters[key] = counters.get(key, 0) + value
        assert not any(key.startswith("prepare:") for key in counters), counters
        assert send(server.url, "POST", "/slots/0?action=erase", {}).status_code == 200  # local: passed on
    finally:
        server.stop()


# -- a box's network door (many boxes, issue 39) ----------------------------------------------------

NETWORK_HOST = "127.0.0.2"


def network_proxy(settings: Settings, stub: Any, token_path: Path) -> Proxy:
    from oc_prefix_cache.doors import token
    from oc_prefix_cache.doors.proxy import NetworkDoor

    token.create(token_path)
    door = NetworkDoor.on(NETWORK_HOST, token.TokenFile(token_path))
    return Proxy(settings=settings, engine=engine_for_url(settings, server_url=stub.url), network=door)


def test_a_network_door_serves_only_the_agents_api_and_only_with_the_token(
    settings: Settings, stub: Any, tmp_path: Path
) -> None:
    """Every route the network door declares, and every route the loopback proxy declares, walked
    without the token, with a wrong one and with the right one: only the agents' API (and the probe)
    is ever served, the token never reaches the server, and the door answers to its address only."""
    from oc_prefix_cache.doors.guard import NETWORK_ROUTES

    token_path = tmp_path / "secret" / "token"
    server = ProxyServer(network_proxy(settings, stub, token_path), host=NETWORK_HOST, port=0)
    server.start()
    good = {"authorization": f"Bearer {token_path.read_text().strip()}"}
    try:
        for method, path, kind in door_cases(NETWORK_ROUTES) + door_cases(PROXY_ROUTES):
            kind = route_of(NETWORK_ROUTES, method, path)
            for headers, authorised in (
                ({}, False),
                ({"authorization": "Bearer nope-nope-nope-nope"}, False),
                (good, True),
            ):
                before = len(stub.seen)
                answer = send(server.url, method, path, headers)
                reached = stub.seen[before:]
                if kind is Route.PROBE:
                    assert answer.status_code == 200, (method, path)
                elif kind is Route.API and authorised:
                    assert answer.status_code == 200, (method, path, answer.text)
                    assert all("authorization" not in {k.lower() for k in s.get("headers", {})} for s in reached), (
                        reached
                    )
                else:
                    assert answer.status_code == (403 if authorised else 401), (
                        method,
                        path,
                        headers,
                        answer.text,
                    )
                    assert not reached, (method, path, headers, reached)
        # its own address only: a rebound name with the right token is still refused
        assert send(server.url, "POST", "/v1/chat/completions", {**good, "host": "evil.example"}).status_code == 403
    finally:
        server.stop()


def test_a_network_door_takes_a_rotated_token_at_once_and_the_previous_one_until_it_is_retired(
    settings: Settings, stub: Any, tmp_path: Path
) -> None:
    from oc_prefix_cache.doors import token

    token_path = tmp_path / "secret" / "token"
    server = ProxyServer(network_proxy(settings, stub, token_path), host=NETWORK_HOST, port=0)
    server.start()
    try:
        old = token.read(token_path)
        new = token.rotate(token_path)
        for value in (old, new):
            assert send(server.url, "GET", "/v1/models", {"authorization": f"Bearer {value}"}).status_code == 200
        assert token.retire(token_path)
        assert send(server.url, "GET", "/v1/models", {"authorization": f"Bearer {old}"}).status_code == 401
        assert send(server.url, "GET", "/v1/models", {"authorization": f"Bearer {new}"}).status_code == 200
        token_path.chmod(0o644)  # a token file others can read is no secret: nobody gets in
        assert send(server.url, "GET", "/v1/models", {"authorization": f"Bearer {new}"}).status_code == 401
    finally:
        server.stop()


@given(value=st.text(max_size=80))
@settings_of(max_examples=300, deadline=None)
def test_no_authorization_value_but_the_token_itself_passes_a_network_guard(value: str) -> None:
    token = "s3cret-token-of-the-deployment"
    guard = Guard(hosts=frozenset({NETWORK_HOST}), tokens=frozenset({token}))
    headers = {"host": NETWORK_HOST, "authorization": value}
    admitted = guard.judge(Route.API, headers) is None
    assert admitted == (
        value.strip().partition(" ")[0].lower() == "bearer" and value.strip().partition(" ")[2].strip() == token
    )
    assert guard.judge(Route.OWN, headers) is not None and guard.judge(Route.CONTROL, headers) is not None
    assert Guard(hosts=frozenset({NETWORK_HOST}), tokens=frozenset()).judge(Route.API, headers) is not None
    # without the token, a request learns nothing of the door: 401 whatever it asks and whatever name it uses
    if not admitted:
        for kind in (Route.API, Route.OWN, Route.CONTROL, Route.PASS):
            refusal = guard.judge(kind, {**headers, "host": "elsewhere.example"})
            assert refusal is not None and refusal.status == 401 and NETWORK_HOST not in refusal.reason


def test_a_door_listening_on_every_address_answers_to_any_name_with_the_token() -> None:
    token = "s3cret-token-of-the-deployment"
    headers = {"authorization": f"Bearer {token}", "host": "box1.lan:8766"}
    assert Guard(hosts=frozenset({"0.0.0.0"}), tokens=frozenset({token})).judge(Route.API, headers) is None
    refusal = Guard(hosts=frozenset({"10.0.0.5"}), tokens=frozenset({token})).judge(Route.API, headers)
    assert refusal is not None and refusal.status == 403


def test_the_gateway_front_sends_the_token_with_the_agents_api_only_and_never_for_a_web_page(
    settings: Settings, stub: Any, tmp_path: Path
) -> None:
    """The front puts the deployment's token on what it forwards, and smg takes that token as its API
    key on its own routes too (``/workers``: a worker added there gets the token on its probes). So:
    every route any door declares, walked from a local program and from a web page; only the agents'
    API of a local program ever reaches the gateway (the stub stands in for smg)."""
    from oc_prefix_cache.doors import token
    from oc_prefix_cache.doors.front import Front
    from oc_prefix_cache.doors.guard import FRONT_ROUTES, NETWORK_ROUTES

    token_path = tmp_path / "secret" / "token"
    token.create(token_path)
    server = ProxyServer(Front(settings=settings, gateway=stub.url, tokens=token.TokenFile(token_path)), port=0)
    server.start()
    cases = {(m, p) for rules in (FRONT_ROUTES, PROXY_ROUTES, NETWORK_ROUTES) for m, p, _ in door_cases(rules)}
    cases |= {("GET", "/workers"), ("POST", "/workers"), ("GET", "/metrics"), ("POST", "/v1/messages/count_tokens")}
    try:
        for method, path in sorted(cases):
            kind = route_of(FRONT_ROUTES, method, path)
            for headers in ({}, *FOREIGN):
                before = len(stub.seen)
                answer = send(server.url, method, path, headers)
                reached = stub.seen[before:]
                if kind is Route.API and not headers:
                    assert answer.status_code == 200 and reached, (method, path)
                else:
                    assert not reached, (method, path, headers, reached)
                    local_own = kind is Route.OWN and not headers
                    allowed = (200,) if kind is Route.PROBE else (200, 404) if local_own else (403, 404)
                    assert answer.status_code in allowed, (method, path, headers)
    finally:
        server.stop()
