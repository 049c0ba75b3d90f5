"""`ocpc launch` starts the proxy beside the daemon on one tracker; a proxy that cannot start is
reported, and the server and the daemon go on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import SUITE_WAIT_S
from tests.unit.commands.test_launch import wait_for

pytestmark = pytest.mark.rig


def launch(models: Any, tmp_path: Path, proxy_port: int) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    log = tmp_path / f"launch-{proxy_port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oc_prefix_cache",
                "launch",
                "--port",
                str(port),
                "-m",
                str(models["qwen35"]),
                "--",
                "-c",
                "4096",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(lambda: "ready:" in log.read_text() or proc.poll() is not None)
    return proc, port, daemon_port, log


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=SUITE_WAIT_S) == 0
    finally:
        if proc.poll() is None:
            stop_group(proc, grace=5)


def test_launch_serves_the_proxy_beside_the_daemon(models: Any, tmp_path: Path) -> None:
    proxy_port = free_port()
    proc, port, daemon_port, log = launch(models, tmp_path, proxy_port)
    try:
        ready = next(line for line in log.read_text().splitlines() if "ready:" in line)
        assert f"ocpc proxy on http://127.0.0.1:{proxy_port}" in ready  # one line, grep-able
        proxy = f"http://127.0.0.1:{proxy_port}"
        assert loopback.get(f"{proxy}/health", timeout=5).json()["status"] == "ok"  # passed through
        answer = loopback.post(
            f"{proxy}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert answer.status_code == 200 and "timings" in answer.json()
        status = loopback.get(f"{proxy}/ocpc/status", timeout=5).json()
        assert status["server"] == f"http://127.0.0.1:{port}" and status["counters"]["prepare:skipped"] == 1
        daemon = loopback.get(f"http://127.0.0.1:{daemon_port}/v1/status", timeout=5).json()
        assert daemon["daemon"]["counters"]["skipped"] == 1  # one Engine: the proxy's prepare shows there too
    finally:
        stop(proc)
    with pytest.raises(ServerError):  # gone
        loopback.get(f"http://127.0.0.1:{proxy_port}/health", timeout=1)


def test_a_proxy_that_cannot_start_does_not_take_down_the_server_and_daemon(models: Any, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proxy_port = taken.getsockname()[1]
        proc, port, daemon_port, log = launch(models, tmp_path, proxy_port)
        try:
            text = log.read_text()
            said = next(line for line in text.splitlines() if "the ocpc proxy did not start" in line)
            assert f"127.0.0.1:{proxy_port}" in said, text
            assert "ready: llama-server pid" in text and proc.poll() is None
            assert loopback.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            assert loopback.get(f"http://127.0.0.1:{daemon_port}/health", timeout=5).status_code == 200
        finally:
            stop(proc)
