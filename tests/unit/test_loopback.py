"""ocpc's calls to llama-server and to its own doors never go to a proxy from the environment
(issue 36, defect 3).

httpx honours ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` (any case) by default, and does not
leave 127.0.0.1 out of them: a stub proxy received a whole ``/apply-template`` body with the
user's prompt, every prepare failed open, ``ocpc launch``'s health wait never succeeded, router
detection and ``ocpc park`` failed. The class is closed by one factory (``oc_prefix_cache/
loopback.py``, ``trust_env=False``) and by ``test_no_http_client_is_built_outside_the_loopback_
factory`` below, which fails on any other way of making a request in the package or the benches.
The rig suite runs with every proxy variable pointing at a recording stub (tests/conftest.py).
No server here: a stand-in answers each path's request.
"""

from __future__ import annotations

import ast
import json
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands import doctor, status, top
from oc_prefix_cache.doors import router
from oc_prefix_cache.llama import server_info
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.supervisor import Supervised
from oc_prefix_cache.settings import Settings
from tests.helpers import ROOT
from tests.proxy_stub import NO_PROXY_VARS, PROXY_VARS, RecordingProxy

# -- the guard: one place builds the clients ----------------------------------------------------

# what makes an httpx request or a client that reads the environment's proxies
MAKERS = {"Client", "AsyncClient", "get", "post", "put", "patch", "delete", "head", "options", "request", "stream"}
FACTORY = "oc_prefix_cache/loopback.py"
# downloads from PyPI go outward and keep honouring the proxy variables (a workplace needs them)
OUTWARD = {"oc_prefix_cache/rig/build.py", "oc_prefix_cache/rig/real_models.py"}


def _violations(source: str, rel: str) -> list[str]:
    """Each call in ``source`` (the file ``rel``) that makes an httpx request or client other than
    through loopback.py."""
    tree = ast.parse(source, filename=rel)
    modules = {"httpx"}  # the names the httpx module is bound to here (``import httpx as h``)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "httpx"}
        elif isinstance(node, ast.ImportFrom) and node.module == "httpx":
            found += [f"{rel}:{node.lineno}: from httpx import {a.name}" for a in node.names if a.name in MAKERS]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id in modules and node.func.attr in MAKERS:
            trusts = not any(
                k.arg == "trust_env" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in node.keywords
            )
            if rel == FACTORY and node.func.attr in ("Client", "AsyncClient") and not trusts:
                continue  # the factory itself, with trust_env=False
            if rel in OUTWARD and node.func.attr in ("Client", "AsyncClient"):
                continue  # an outward download: honours the proxy variables on purpose
            found.append(f"{rel}:{node.lineno}: httpx.{node.func.attr}(...)")
    return found


def test_no_http_client_is_built_outside_the_loopback_factory() -> None:
    """Every httpx client or request in the package and the benches comes from loopback.py (which
    builds each with trust_env=False), but the outward downloads (rig/build.py, rig/real_models.py)."""
    files = sorted((ROOT / "oc_prefix_cache").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    assert len(files) > 50, files
    found = [v for path in files for v in _violations(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, (
        "an httpx client or request outside oc_prefix_cache/loopback.py honours HTTP_PROXY & co.: "
        "ocpc's loopback calls (prompts in them) would go to that proxy; use loopback.client/get/post:\n"
        + "\n".join(found)
    )


def test_the_factory_is_all_trust_env_false_and_the_guard_sees_a_stray_call() -> None:
    factory = (ROOT / FACTORY).read_text()
    tree = ast.parse(factory)
    built = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("Client", "AsyncClient")
    ]
    assert built and all(
        any(k.arg == "trust_env" and getattr(k.value, "value", None) is False for k in n.keywords) for n in built
    )
    stray = (
        "import httpx as h\nfrom httpx import get\n\n\ndef f():\n"
        "    return h.get('http://127.0.0.1:1/'), h.Client(trust_env=False)\n"
    )
    assert [v.split(": ", 1)[1] for v in _violations(stray, "oc_prefix_cache/stray.py")] == [
        "from httpx import get",
        "httpx.get(...)",
        "httpx.Client(...)",
    ]
    # an outward download may build its own client; anything else there may not
    assert _violations("import httpx\nhttpx.Client(follow_redirects=True)\n", "oc_prefix_cache/rig/build.py") == []
    assert _violations("import httpx\nhttpx.get('https://pypi.org')\n", "oc_prefix_cache/rig/build.py") == [
        "oc_prefix_cache/rig/build.py:2: httpx.get(...)"
    ]


# -- each loopback path, with every proxy variable pointing at a recording stub -------------------


class _Stand(BaseHTTPRequestHandler):
    """llama-server, a router, the daemon and the proxy in one: what each path reads."""

    ANSWERS: dict[tuple[str, str], Any] = {
        ("GET", "/health"): {"status": "ok"},
        ("GET", "/props"): {"role": "router", "model_path": "m.gguf", "total_slots": 1},
        ("GET", "/models"): {"data": [{"id": "m1", "status": {"value": "loaded"}}]},
        ("GET", "/slots"): [{"id": 0, "is_processing": False, "n_ctx": 4096}],
        ("GET", "/v1/status"): {"server": {"url": "http://127.0.0.1:1"}, "daemon": {"counters": {}}},
        ("GET", "/ocpc/status"): {"server": "http://127.0.0.1:1", "prepare": {}},
        ("POST", "/v1/park"): {"slots": [{"slot": 0, "parked": True, "why": "answered directly"}]},
    }

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        data = self.ANSWERS.get((method, self.path.split("?", 1)[0]))
        body = json.dumps(data if data is not None else {"error": "no such path"}).encode()
        self.send_response(200 if data is not None else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._answer("POST")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stand)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingProxy]:
    """Every proxy variable, upper- and lower-case, set to a stub of this test's own; NO_PROXY unset."""
    stub = RecordingProxy()
    for name in PROXY_VARS:
        monkeypatch.setenv(name, stub.url)
    for name in NO_PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    yield stub
    stub.close()


def _settings(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    port = url.rsplit(":", 1)[1]
    env = {
        "OC_PREFIX_CACHE_BASE_URL": url,
        "OC_PREFIX_CACHE_DAEMON_PORT": port,
        "OC_PREFIX_CACHE_PROXY_PORT": port,
        "OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # `ocpc park` reads them from the environment
    return Settings.from_env(env)


def _slot_client(url: str, settings: Settings) -> Any:
    with SlotClient(url) as client:
        return client.props(), client.health()


def _park(url: str, settings: Settings) -> Any:
    result = CliRunner().invoke(app, ["park", "--timeout", "2"])
    assert result.exit_code == 0, result.output
    return result.output


def _health_wait(url: str, settings: Settings) -> Any:
    child = Supervised(
        "stand-in", [sys.executable, "-c", "import time; time.sleep(30)"], f"{url}/health", settings.home / "child.log"
    )
    settings.home.mkdir(parents=True, exist_ok=True)
    try:
        child.start(timeout=5.0)
        return child.state.value
    finally:
        child.stop()


PATHS: dict[str, Callable[[str, Settings], Any]] = {
    "SlotClient (every prepare's calls)": _slot_client,
    "router detection": lambda url, s: router.is_router(url, timeout=2.0),
    "the router's models": lambda url, s: router.read_models(url, timeout=2.0),
    "ocpc status (the daemon's)": lambda url, s: status.daemon_part(s)["up"],
    "ocpc doctor's daemon check": lambda url, s: not doctor._daemon(s).detail.startswith("no ocpc daemon"),
    "ocpc doctor's proxy probe": lambda url, s: doctor.probe_proxy(url).status == 200,
    "a server answering /health": lambda url, s: server_info._answers_health(url),
    "the daemon's server": lambda url, s: server_info.daemon_server_url(s) is not None,
    "ocpc top's doors": lambda url, s: sorted(top._doors(s)) == ["daemon", "proxy"],
    "ocpc park": _park,
    "ocpc launch's health wait": _health_wait,
}


@pytest.mark.parametrize("name", list(PATHS))
def test_each_loopback_path_goes_directly_whatever_the_proxy_variables_say(
    name: str, stand: str, behind_a_proxy: RecordingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(stand, tmp_path, monkeypatch)
    result = PATHS[name](stand, settings)
    reached = [hit.line for hit in behind_a_proxy.take()]
    assert not reached, f"{name} sent its request to the proxy in HTTP_PROXY & co.: {reached}"
    assert result and result != (None, False), f"{name} did not get the stand-in's answer: {result!r}"


def test_a_socks_all_proxy_neither_breaks_nor_catches_a_client(stand: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ALL_PROXY=socks5://...`` made a default httpx client raise at construction (it wants socksio)."""
    for name in (*PROXY_VARS, *NO_PROXY_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:9")
    monkeypatch.setenv("all_proxy", "socks5://127.0.0.1:9")
    with SlotClient(stand) as client:
        assert client.props()["role"] == "router"
    assert router.is_router(stand)
