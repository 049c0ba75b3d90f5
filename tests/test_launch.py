"""`ocpc launch` against the rig: both processes up, SIGTERM stops both, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from oc_prefix_cache.launch import Flag, build_advice, build_argv, supported_options
from oc_prefix_cache.llama_process import free_port
from oc_prefix_cache.process import stop_group


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.mark.rig
def test_launch_starts_both_and_sigterm_stops_both(models, tmp_path: Path) -> None:
    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port)}
    home = Path(env["OC_PREFIX_CACHE_HOME"])
    cmd = [sys.executable, "-m", "oc_prefix_cache", "launch", "--port", str(port), "-m", str(models["qwen35"]),
           "--", "-c", "8192"]
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        runtime = home / f"server-{port}.json"
        wait_for(runtime.exists)
        info = json.loads(runtime.read_text())
        server_pid = info["pid"]
        assert "--slot-save-path" in info["argv"] and "--checkpoint-min-step" in info["argv"]
        assert info["argv"][-2:] == ["-c", "8192"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{daemon_port}/health").status_code == 200)
        assert alive(server_pid) and alive(launcher.pid)

        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"already running on port {port} (pid {launcher.pid})" in second.stderr.replace("\n", " ")

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        wait_for(lambda: not alive(server_pid), timeout=15)
        assert not runtime.exists()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{daemon_port}/health", timeout=1)
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
    assert "ready: llama-server pid" in log.read_text()
    daemon_log = home / "logs" / "daemon.log"  # defect: launch used to write none
    assert f"for llama-server http://127.0.0.1:{port}" in daemon_log.read_text()


def test_argv_keeps_user_flags_and_skips_unknown_ones() -> None:
    flags = [Flag(("--metrics",), None, "why"), Flag(("-np", "--parallel"), "1", "why"),
             Flag(("--new-flag",), "3", "why")]
    argv, notes = build_argv(Path("/bin/ls"), Path("m.gguf"), flags, {"--metrics", "-np", "--parallel"},
                             ["--parallel", "4"])
    assert argv == ["/bin/ls", "-m", "m.gguf", "--metrics", "--parallel", "4"]
    assert any("yours" in n for n in notes) and any("does not know" in n for n in notes)


def test_supported_options_read_from_help() -> None:
    text = "-cms,  --checkpoint-min-step N   spacing\n--metrics   enable\n  -ub, --ubatch-size N"
    assert {"-cms", "--checkpoint-min-step", "--metrics", "-ub", "--ubatch-size"} <= supported_options(text)


def test_build_advice() -> None:
    assert "unknown" in build_advice("0.6.0-dev (build 0, commit unknown)")
    assert "older than" in build_advice("b11434-abcdef")
    assert build_advice("b11600-abc") is None


@pytest.mark.rig
def test_a_killed_launcher_leaves_no_server_behind(models, tmp_path: Path) -> None:
    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port)}
    home = Path(env["OC_PREFIX_CACHE_HOME"])
    server_pid = None
    with open(tmp_path / "launch.log", "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "oc_prefix_cache", "launch", "--port", str(port), "-m", str(models["qwen3"])],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        runtime = home / f"server-{port}.json"
        wait_for(runtime.exists)
        server_pid = json.loads(runtime.read_text())["pid"]
        launcher.send_signal(signal.SIGKILL)  # no handler runs: only the kernel can help
        launcher.wait(timeout=10)
        wait_for(lambda: not alive(server_pid), timeout=15)
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
        if server_pid is not None and alive(server_pid):  # the orphan, if the feature failed
            os.kill(server_pid, signal.SIGKILL)
