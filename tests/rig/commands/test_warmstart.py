"""Warm before the first request: `ocpc launch` restores what each slot held last, so the first
request after a restart finds its head in place (its prepare answers `hit`).
Which file each slot gets back, without a server: tests/unit/engine/test_warm_start.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import DATA, SUITE_WAIT_S
from tests.unit.commands.test_launch import wait_for
from tests.unit.doors.test_proxy import capture


@pytest.mark.rig
def test_after_launch_restarts_the_server_the_first_new_session_finds_its_head(models: Any, tmp_path: Path) -> None:
    port, daemon_port, proxy_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    cmd = [
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
        "8192",
        "--logit-bias",
        "151645+30",
    ]
    rows = []
    for run, name in ((1, "A1"), (2, "A2")):
        log = tmp_path / f"launch{run}.log"
        with open(log, "wb") as out:
            launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda log=log: "ready: llama-server" in log.read_text())
            if run == 2:
                wait_for(lambda log=log: "warm start: slot 0:" in log.read_text())
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = loopback.post(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            assert answer.status_code == 200, answer.text[:300]
            wait_for(lambda: _recent(proxy_port) and _recent(proxy_port)[-1]["cache_n"] is not None)
            rows.append(_recent(proxy_port)[-1])
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=SUITE_WAIT_S) == 0
        finally:
            if launcher.poll() is None:
                stop_group(launcher, grace=5)
    said = (tmp_path / "launch2.log").read_text()
    print("\n" + json.dumps(rows) + "\n" + "\n".join(line for line in said.splitlines() if "warm start" in line))
    assert rows[0]["action"] == "warmed", rows
    assert "warm start: slot 0: slot 0 held this head last: restored" in said, said
    assert rows[1]["action"] == "hit" and rows[1]["cache_n"] >= 0.9 * rows[1]["prefix_tokens"], rows


def _recent(port: int) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = loopback.get(f"http://127.0.0.1:{port}/ocpc/status", timeout=5).json()["recent"]
    return data
