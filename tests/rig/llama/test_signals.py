"""A test run stopped from outside (CI's timeout, `timeout`, a supervisor's SIGTERM) stops the
llama-servers its tests started: each runs in its own session, so nothing else would, and a
leaked one holds its port and the machine's cores for every run after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oc_prefix_cache.llama.supervisor import pid_alive
from tests.helpers import ROOT, SUITE_WAIT_S

pytestmark = pytest.mark.rig
HOLDS_A_SERVER = """
import os, time
from pathlib import Path

def test_holds_a_server(llama_server):
    server = llama_server("qwen3")
    Path(os.environ["OCPC_TEST_PID_FILE"]).write_text(str(server.pid))
    time.sleep(600)
"""


def test_a_run_stopped_by_sigterm_stops_the_servers_its_tests_started(tmp_path: Path) -> None:
    child = tmp_path / "child" / "test_child.py"
    child.parent.mkdir()
    child.write_text(HOLDS_A_SERVER)
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "OCPC_TEST_PID_FILE": str(pid_file), "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(child)],
        cwd=child.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    server_pid = 0
    try:
        end = time.monotonic() + SUITE_WAIT_S
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None, run.communicate()[0].decode()  # the child run ended early: why
            assert time.monotonic() < end, f"the child run started no server in {SUITE_WAIT_S:g} s"
            time.sleep(0.2)
        server_pid = int(pid_file.read_text())
        assert pid_alive(server_pid)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=SUITE_WAIT_S)
        assert run.returncode == pytest.ExitCode.INTERRUPTED, out.decode()
        end = time.monotonic() + SUITE_WAIT_S
        while pid_alive(server_pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not pid_alive(server_pid), "the server outlived the run that started it"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server_pid and pid_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)  # its own session: the group is the server
