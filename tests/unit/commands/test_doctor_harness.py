"""`ocpc doctor` for the harnesses wired to the proxy: installed and reaching a proxy,
installed but the proxy down (or the server behind it), and not installed.

The proxy is the real one (``oc_prefix_cache.doors.proxy``, served in a thread of the test), in
front of a stdlib stub of llama-server's ``GET /health``; both are shut down when the test ends.
A stub alone on the proxy's port stands for "something else listens there".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands import doctor
from oc_prefix_cache.doors.proxy import Proxy as ProxyApp
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.engine.wiring import engine_for_url
from oc_prefix_cache.install import aider, claude_code, cline, codex, kilo_code, pi, qwen_code
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.settings import Settings

runner = CliRunner()
Proxy = Callable[..., int]


def health_stub(status: int) -> ThreadingHTTPServer:
    """A stand-in llama-server whose ``GET /health`` answers ``status`` (503: loading)."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = b'{"status":"ok"}' if status == 200 else b'{"error":"Loading model"}'
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    """The ocpc proxy in front of a /health stub answering ``status``; OC_PREFIX_CACHE_PROXY_PORT
    points at it. ``real=False``: the stub alone listens on that port (not ocpc's proxy)."""
    stubs: list[ThreadingHTTPServer] = []
    proxies: list[ProxyServer] = []

    def start(status: int = 200, *, real: bool = True) -> int:
        stub = health_stub(status)
        stubs.append(stub)
        port = int(stub.server_address[1])
        if real:
            settings = Settings.from_env()
            upstream = f"http://127.0.0.1:{port}"
            server = ProxyServer(
                ProxyApp(settings=settings, engine=engine_for_url(settings, server_url=upstream)), port=0
            )
            server.start()
            proxies.append(server)
            port = int(server.url.rsplit(":", 1)[1])
        monkeypatch.setenv("OC_PREFIX_CACHE_PROXY_PORT", str(port))
        return port

    yield start
    for server in proxies:
        server.stop()
    for stub in stubs:
        stub.shutdown()
        stub.server_close()


@pytest.fixture
def proxy_down(monkeypatch: pytest.MonkeyPatch) -> int:
    port = free_port()  # nothing listens there
    monkeypatch.setenv("OC_PREFIX_CACHE_PROXY_PORT", str(port))
    return port


def claude_installed(home: Path) -> Path:
    config = home / ".claude" / "settings.json"
    claude_code.install(Settings.from_env(), config_path=config)
    return config


def pi_installed(home: Path) -> Path:
    config = home / ".pi" / "agent" / "models.json"
    pi.install(Settings.from_env(), config_path=config, provider_id="ocpc", model="qwen")
    return config


def checks(cwd: Path) -> dict[str, doctor.Check]:
    return {c.name: c for c in doctor.harness_checks(Settings.from_env(), cwd=cwd)}


def codex_installed(home: Path) -> Path:
    config = home / ".codex" / "config.toml"
    codex.install(Settings.from_env(), config_path=config, provider_id="ocpc")
    return config


def aider_installed(home: Path) -> Path:
    config = home / ".aider.conf.yml"
    aider.install(Settings.from_env(), config_path=config)
    return config


def qwen_installed(home: Path) -> Path:
    config = home / ".qwen" / "settings.json"
    qwen_code.install(Settings.from_env(), config_path=config)
    return config


def cline_installed(home: Path) -> Path:
    config = home / ".cline" / "data" / "settings" / "providers.json"
    cline.install(Settings.from_env(), config_path=config)
    return config


def kilo_installed(home: Path) -> Path:
    config = home / "config" / "kilo" / "kilo.json"
    kilo_code.install(Settings.from_env(), config_path=config, provider_id="ocpc", model="qwen")
    return config


INSTALLERS = {
    "claude-code": claude_installed,
    "pi": pi_installed,
    "codex": codex_installed,
    "aider": aider_installed,
    "qwen-code": qwen_installed,
    "cline": cline_installed,
    "kilo-code": kilo_installed,
}


@pytest.mark.parametrize("harness", INSTALLERS)
def test_installed_and_reaching_the_proxy_is_ok(
    harness: str, isolated_home: Path, tmp_path: Path, proxy: Proxy
) -> None:
    port = proxy()
    INSTALLERS[harness](isolated_home)
    check = checks(tmp_path)[harness]
    assert check.status == "ok" and f"answers at http://127.0.0.1:{port}, forwarding to" in check.detail, check


@pytest.mark.parametrize("harness", INSTALLERS)
def test_installed_but_the_proxy_is_down_fails_with_how_to_start_it(
    harness: str, isolated_home: Path, tmp_path: Path, proxy_down: int
) -> None:
    INSTALLERS[harness](isolated_home)
    check = checks(tmp_path)[harness]
    assert check.status == "fail" and f"nothing answers at http://127.0.0.1:{proxy_down}" in check.detail, check
    assert "ocpc launch" in check.fix and "ocpc proxy" in check.fix


@pytest.mark.parametrize("harness", INSTALLERS)
def test_proxy_up_but_its_server_down_warns(harness: str, isolated_home: Path, tmp_path: Path, proxy: Proxy) -> None:
    proxy(503)
    INSTALLERS[harness](isolated_home)
    check = checks(tmp_path)[harness]
    assert check.status == "warn" and "HTTP 503" in check.detail and "ocpc launch" in check.fix, check


@pytest.mark.parametrize("harness", INSTALLERS)
def test_something_else_on_the_proxy_port_warns(
    harness: str, isolated_home: Path, tmp_path: Path, proxy: Proxy
) -> None:
    proxy(real=False)  # e.g. a llama-server started on the proxy's port: /health answers, /ocpc/status not
    INSTALLERS[harness](isolated_home)
    check = checks(tmp_path)[harness]
    assert check.status == "warn" and "not the ocpc proxy" in check.detail and "ocpc proxy" in check.fix, check


def test_not_installed_harnesses_have_no_check(isolated_home: Path, tmp_path: Path, proxy: Proxy) -> None:
    proxy()
    assert checks(tmp_path) == {}
    claude_installed(isolated_home)
    assert list(checks(tmp_path)) == ["claude-code"]


def test_a_config_no_longer_pointing_at_the_proxy_warns(isolated_home: Path, tmp_path: Path, proxy: Proxy) -> None:
    proxy()
    config = claude_installed(isolated_home)
    config.write_text(config.read_text().replace("http://127.0.0.1:", "http://127.0.0.1:1"))
    check = checks(tmp_path)["claude-code"]
    assert check.status == "warn" and "not to the proxy" in check.detail, check
    pi_config = pi_installed(isolated_home)
    pi_config.write_text(
        pi_config.read_text().replace('"sendSessionAffinityHeaders": true', '"sendSessionAffinityHeaders": false')
    )
    check = checks(tmp_path)["pi"]
    assert check.status == "warn" and "session-affinity" in check.detail, check


def test_claude_settings_without_the_capability_line_warn_to_reinstall(
    isolated_home: Path, tmp_path: Path, proxy: Proxy
) -> None:
    """An install by an older ocpc (no CLAUDE_CODE_MODEL_CAPABILITIES) works, but every new session
    processes Claude Code's environment again: doctor says so, and how to fix it."""
    proxy()
    config = claude_installed(isolated_home)
    config.write_text(config.read_text().replace('"-mid_conv_system,-per_turn_effort"', '"-per_turn_effort"'))
    check = checks(tmp_path)["claude-code"]
    assert check.status == "warn" and "CLAUDE_CODE_MODEL_CAPABILITIES" in check.detail, check
    assert "ocpc install --harness claude-code" in check.fix


def test_a_project_setting_that_overrides_the_proxy_warns(isolated_home: Path, tmp_path: Path, proxy: Proxy) -> None:
    """A project's .claude/settings.local.json env wins over ~/.claude/settings.json
    (seen on Claude Code 2.1.332): there, Claude Code bypasses the proxy."""
    proxy()
    claude_installed(isolated_home)
    project = tmp_path / "project"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.local.json").write_text('{"env": {"ANTHROPIC_BASE_URL": "http://10.0.0.5:80"}}')
    check = checks(project)["claude-code"]
    assert check.status == "warn" and "settings.local.json" in check.detail, check
    assert checks(tmp_path)["claude-code"].status == "ok"


@pytest.mark.parametrize(
    "harness, moved",
    [
        ("codex", ('base_url = "http://127.0.0.1:', 'base_url = "http://127.0.0.1:1')),
        ("aider", ("openai-api-base: http://127.0.0.1:", "openai-api-base: http://127.0.0.1:1")),
        ("qwen-code", ('"baseUrl": "http://127.0.0.1:', '"baseUrl": "http://127.0.0.1:1')),
        ("cline", ('"baseUrl": "http://127.0.0.1:', '"baseUrl": "http://127.0.0.1:1')),
    ],
)
def test_a_toml_yaml_or_json_config_sent_elsewhere_warns(
    harness: str, moved: tuple[str, str], isolated_home: Path, tmp_path: Path, proxy: Proxy
) -> None:
    proxy()
    config = INSTALLERS[harness](isolated_home)
    config.write_text(config.read_text().replace(*moved))
    check = checks(tmp_path)[harness]
    assert check.status == "warn" and "not to the proxy" in check.detail and f"--harness {harness}" in check.fix, check
    config.write_text("not: [valid")
    assert checks(tmp_path)[harness].status == "warn"


def test_a_config_deleted_since_install_warns(isolated_home: Path, tmp_path: Path, proxy: Proxy) -> None:
    proxy()
    pi_installed(isolated_home).unlink()
    check = checks(tmp_path)["pi"]
    assert check.status == "warn" and "is gone" in check.detail and "--harness pi" in check.fix, check


def test_cli_doctor_lists_each_installed_harness(
    isolated_home: Path, tmp_path: Path, proxy_down: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    claude_installed(isolated_home)
    pi_installed(isolated_home)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OC_PREFIX_CACHE_DAEMON_PORT", str(free_port()))
    result = runner.invoke(app, ["doctor", "--json", "--server", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    by_name = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert by_name["claude-code"]["status"] == "fail" and by_name["pi"]["status"] == "fail"
    assert {"server", "index", "daemon", "opencode"} <= set(by_name)
    # OpenCode not installed is a choice when another harness is: no warning for it then
    assert by_name["opencode"]["status"] == "ok" and "not installed" in by_name["opencode"]["detail"]
