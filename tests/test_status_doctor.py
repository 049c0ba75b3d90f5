"""`ocpc status` and `ocpc doctor` against the real rig: healthy, and broken in named ways."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.daemon import Daemon
from oc_prefix_cache.llama_process import free_port
from oc_prefix_cache.settings import Settings

from .helpers import PROJ_A, UA, capture_bytes

pytestmark = pytest.mark.rig
runner = CliRunner()


@pytest.fixture
def pointed_at(monkeypatch) -> Iterator:
    """Point ocpc's settings at a server URL and a daemon port for this test."""
    daemons: list[Daemon] = []

    def point(url: str, *, with_daemon: bool = True) -> Daemon | None:
        monkeypatch.setenv("OC_PREFIX_CACHE_BASE_URL", url)
        monkeypatch.setenv("OC_PREFIX_CACHE_DAEMON_PORT", str(free_port()))
        if not with_daemon:
            return None
        daemon = Daemon(settings=Settings.from_env())
        daemon.start()
        daemons.append(daemon)
        return daemon

    yield point
    for daemon in daemons:
        daemon.stop()


def doctor() -> tuple[int, dict]:
    result = runner.invoke(app, ["doctor", "--json"])
    return result.exit_code, json.loads(result.stdout)


def checks(data: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in data["checks"]}


def status() -> dict:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_healthy_setup(llama_server, pointed_at) -> None:
    server = llama_server("qwen35", extra_args=("--checkpoint-min-step", "1024"))
    daemon = pointed_at(server.url)
    assert runner.invoke(app, ["install", "--base-url", server.url]).exit_code == 0
    assert daemon.preparer.prepare(capture_bytes(PROJ_A), {"User-Agent": UA}).action == "warmed"

    code, data = doctor()
    states = checks(data)
    assert code == 0 and data["ok"], data
    assert states["server"] == states["slot-save-path"] == states["checkpoint-min-step"] == "ok"
    assert states["opencode"] == states["daemon"] == states["index"] == states["slots"] == "ok"
    assert states["build"] == "warn"  # an sdist build with a hybrid model: said, not broken
    template = next(c for c in data["checks"] if c["name"] == "template")
    assert "head 7,145 tokens" in template["detail"] and "of which tools" in template["detail"]
    assert not list(Settings.from_env().slot_dir.glob("ocpc-doctor-*"))  # the probe save is cleaned up

    data = status()
    assert data["verdict"] == "warm: next session starts from cache"
    assert data["daemon"]["counters"]["warmed"] == 1
    assert data["server"]["flags"]["checkpoint_min_step"] == "1024"
    assert [f["current"] for f in data["disk"]["files"]] == [True]


def test_no_slot_save_path(llama_server, pointed_at) -> None:
    server = llama_server("qwen3", slot_dir=None)
    pointed_at(server.url)
    code, data = doctor()
    assert code == 1 and checks(data)["slot-save-path"] == "fail"
    fix = next(c["fix"] for c in data["checks"] if c["name"] == "slot-save-path")
    assert "--slot-save-path" in fix
    assert "without --slot-save-path" in status()["verdict"]


def test_server_down(pointed_at) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    pointed_at(url)
    code, data = doctor()
    assert code == 1 and checks(data)["server"] == "fail"
    assert "ocpc launch" in data["checks"][0]["fix"]
    data = status()
    assert data["verdict"].startswith("broken: llama-server at") and "not reachable" in data["verdict"]
    assert data["disk"]["files"] == []  # the disk part is still there


def test_checkpoint_min_step_larger_than_the_head(llama_server, pointed_at) -> None:
    server = llama_server("qwen35")  # the server's default: 8192 > the 7,145-token head
    pointed_at(server.url)
    code, data = doctor()
    assert code == 1 and checks(data)["checkpoint-min-step"] == "fail", data
    detail = next(c["detail"] for c in data["checks"] if c["name"] == "checkpoint-min-step")
    assert "8192 (the server's default) is larger than the head (7,145 tokens)" in detail


def test_daemon_down_is_broken_in_status(llama_server, pointed_at) -> None:
    server = llama_server("qwen3")
    pointed_at(server.url, with_daemon=False)
    data = status()
    assert data["daemon"]["up"] is False
    assert "daemon is not running" in data["verdict"]
    code, doc = doctor()
    assert checks(doc)["daemon"] == "warn"


def test_screens_fit_80_columns(llama_server, pointed_at) -> None:
    server = llama_server("qwen35", extra_args=("--checkpoint-min-step", "1024"))
    pointed_at(server.url)
    for command in (["status"], ["doctor"]):
        result = runner.invoke(app, command, env={"COLUMNS": "80"}, terminal_width=80)
        assert max(len(line) for line in result.stdout.splitlines()) <= 80, result.stdout
