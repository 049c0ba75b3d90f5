"""`ocpc status` and `ocpc doctor` against the real rig: healthy, and broken in named ways."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.disk.index import Store, slot_key
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.files import write_atomic
from oc_prefix_cache.llama import server_info
from oc_prefix_cache.llama.server_info import port_of, runtime_path
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.settings import Settings
from tests.helpers import PROJ_A, UA, capture_bytes

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


def doctor(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["doctor", "--json", *args])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def checks(data: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in data["checks"]}


def check(data: dict, name: str) -> dict:
    found: dict = next(c for c in data["checks"] if c["name"] == name)
    return found


def status(*args: str) -> dict:
    result = runner.invoke(app, ["status", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_healthy_setup(llama_server, pointed_at, monkeypatch) -> None:
    # behind the run's proxy stub (conftest.py), as a user's setup is healthy: NO_PROXY keeps the
    # agents on 127.0.0.1 (ocpc's own calls ignore the variables either way: tests/unit/test_loopback.py)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    server = llama_server("qwen35", extra_args=("--checkpoint-min-step", "1024"))
    daemon = pointed_at(server.url)
    assert runner.invoke(app, ["install", "--base-url", server.url]).exit_code == 0
    assert daemon.engine.prepare(capture_bytes(PROJ_A), {"User-Agent": UA}).action == "warmed"

    code, data = doctor()
    states = checks(data)
    assert code == 0 and data["ok"], data
    assert states["server"] == states["slot-save-path"] == states["checkpoint-min-step"] == "ok"
    assert states["opencode"] == states["daemon"] == states["index"] == states["slots"] == states["proxy-env"] == "ok"
    assert states["build"] == "warn"  # an sdist build with a hybrid model: said, not broken
    template = next(c for c in data["checks"] if c["name"] == "template")
    assert "head 7,145 tokens" in template["detail"] and "of which tools" in template["detail"]
    assert not list(Settings.from_env().slot_dir.glob("ocpc-doctor-*"))  # the probe save is cleaned up

    data = status()
    assert data["verdict"] == "warm: next session starts from cache"
    assert data["daemon"]["counters"]["warmed"] == 1
    assert data["server"]["flags"]["checkpoint_min_step"] == "1024"
    assert [f["current"] for f in data["disk"]["files"] if f["kind"] == "head"] == [True]


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


# -- which server status and doctor talk about -----------------------------------------------


@pytest.fixture
def no_daemon(monkeypatch) -> None:
    """No OC_PREFIX_CACHE_BASE_URL (conftest clears it) and no daemon on the configured port."""
    monkeypatch.setenv("OC_PREFIX_CACHE_DAEMON_PORT", str(free_port()))


def test_status_and_doctor_follow_ocpc_launch_on_another_port(llama_server, no_daemon) -> None:
    """`ocpc launch --port N` records server-N.json; without it they looked at :8080."""
    server = llama_server("qwen3", extra_args=("--checkpoint-min-step", "1024", "--rope-freq-base", "20000"))
    settings = Settings.from_env()
    port = port_of(server.url)
    assert port is not None and server.pid is not None
    record = {
        "pid": server.pid,
        "launcher_pid": os.getpid(),
        "binary": str(server.config.binary),
        "argv": server.config.argv(),
        "url": server.url,
        "started": 0,
    }
    write_atomic(runtime_path(settings, port), json.dumps(record).encode())

    data = status()
    assert data["server"]["url"] == server.url and data["server"]["reachable"], data["server"]
    assert "ocpc launch runs it" in data["server"]["why"]
    assert data["server"]["flags"]["checkpoint_min_step"] == "1024"
    assert data["server"]["kv_flags"] == ["--rope-freq-base=20000.0"]

    code, doc = doctor()
    assert doc["server"]["url"] == server.url and check(doc, "server")["status"] == "ok"
    assert server.url in check(doc, "server")["detail"] and "ocpc launch runs it" in check(doc, "server")["detail"]
    assert check(doc, "kv-flags")["status"] == "ok"
    assert "--rope-freq-base=20000.0" in check(doc, "kv-flags")["detail"]


def test_status_and_doctor_follow_the_running_daemon(llama_server, no_daemon, monkeypatch) -> None:
    server = llama_server("qwen3")
    daemon = Daemon(settings=Settings.from_env(), server_url=server.url, port=0)
    daemon.start()
    try:
        monkeypatch.setenv("OC_PREFIX_CACHE_DAEMON_PORT", str(port_of(daemon.url)))
        data = status()
        assert data["server"]["url"] == server.url and data["server"]["reachable"], data["server"]
        assert data["server"]["why"].startswith("the ocpc daemon at")
        assert data["daemon"]["up"] and not data["verdict"].startswith("broken"), data["verdict"]
        code, doc = doctor()
        assert check(doc, "server")["status"] == check(doc, "daemon")["status"] == "ok", doc
        assert f"serving {server.url}" in check(doc, "daemon")["detail"]
    finally:
        daemon.stop()


def test_an_explicit_server_wins_and_shows_only_its_own_current_files(llama_server, no_daemon, monkeypatch) -> None:
    server = llama_server("qwen3")
    settings = Settings.from_env()
    mine, other = "a" * 16, "b" * 16
    settings.slot_dir.mkdir(parents=True, exist_ok=True)
    for fp in (mine, other):
        (settings.slot_dir / f"oc-prefix-{fp}.bin").write_bytes(b"x")

    def currents(index) -> None:
        index.current[slot_key(server.url, 0)] = mine
        index.current[slot_key("http://127.0.0.1:8080", 0)] = other

    Store(index_path=settings.index_path, lock_path=settings.lock_path).update(currents)
    data = status("--server", server.url)
    assert data["server"]["url"] == server.url and data["server"]["why"] == "given by --server"
    assert data["disk"]["current"] == [mine]
    assert {f["fingerprint"]: f["current"] for f in data["disk"]["files"]} == {mine: True, other: False}

    monkeypatch.setenv("OC_PREFIX_CACHE_BASE_URL", server.url)
    assert status()["server"]["why"] == "given by OC_PREFIX_CACHE_BASE_URL"


def test_doctor_says_when_it_cannot_see_the_servers_flags(llama_server, pointed_at, monkeypatch) -> None:
    server = llama_server("qwen3")
    pointed_at(server.url, with_daemon=False)
    # As for a server in a container or run by another user: no runtime file, no visible process.
    monkeypatch.setattr(server_info, "_find_process", lambda port: None)
    code, data = doctor()
    flags = check(data, "kv-flags")
    assert flags["status"] == "warn", flags
    assert "cannot see llama-server's command line" in flags["detail"]
    assert "--rope-freq-base" in flags["detail"] and "--lora" in flags["detail"]
    assert "cannot tell apart" in flags["detail"] and "ocpc launch" in flags["fix"]


def test_one_server_under_two_names() -> None:
    from oc_prefix_cache.llama.server_info import same_server

    assert same_server("http://localhost:9000/", "http://127.0.0.1:9000")
    assert same_server("http://[::1]:9000", "http://127.0.0.1:9000")
    assert not same_server("http://127.0.0.1:9001", "http://127.0.0.1:9000")
