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
