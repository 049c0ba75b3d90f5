"""No port is assumed silently: `ocpc install` (and the proxy) find the llama-server that runs here,
on whatever port, and say which they use and why (issue 19: a server on 9931 got an install for 8080)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import wait_until

# `alone`: both tests read every llama-server on this machine, so tests/run.sh runs them after the
# parallel run (pytest-xdist), with no other test's server beside them.
pytestmark = [pytest.mark.rig, pytest.mark.alone]


def ocpc(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_install_and_the_proxy_find_a_server_on_a_port_of_its_own(
    llama_server: Any, isolated_home: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35")
    port = int(server.url.rsplit(":", 1)[1])
    assert port not in (8080, 9931)
    from oc_prefix_cache.llama.server_info import local_servers

    if set(local_servers().values()) != {server.url}:
        pytest.skip(f"other llama-servers run on this machine ({local_servers()}): install rightly asks to choose")
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port())}  # no daemon there to ask
    installed = ocpc("install", "--model", "tiny", "--opencode-version", "1.18.33", env=env)
    assert installed.returncode == 0, installed.stderr
    assert f"llama-server: {server.url} (a llama-server process (pid " in installed.stdout, installed.stdout
    config = json.loads((isolated_home / "config" / "opencode" / "opencode.json").read_text())
    assert [p["options"]["baseURL"] for p in config["provider"].values()] == [f"{server.url}/v1"], config

    proxy_port = free_port()
    log = tmp_path / "proxy.err"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "oc_prefix_cache", "proxy", "--port", str(proxy_port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:  # answering (it said which server before it listened), or gone: its log says why
            try:
                return (
                    proc.poll() is not None
                    or loopback.get(f"http://127.0.0.1:{proxy_port}/health", timeout=5).status_code == 200
                )
            except ServerError:
                return False

        wait_until(up, what="the proxy did not start")
        said = " ".join(log.read_text().split())  # the console wraps its line
        assert f"for llama-server {server.url} (a llama-server process" in said, said
    finally:
        stop_group(proc, grace=5)


def test_with_no_server_running_install_says_it_uses_the_default_and_how_to_choose(isolated_home: Path) -> None:
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port())}
    from oc_prefix_cache.llama.server_info import local_servers

    if local_servers():
        pytest.skip("a llama-server runs on this machine: the default is not what install uses here")
    installed = ocpc("install", "--model", "tiny", "--opencode-version", "1.18.33", env=env)
    assert installed.returncode == 0, installed.stderr
    assert "llama-server: http://127.0.0.1:8080 (the default" in installed.stdout
    assert "pass --server to choose" in installed.stdout
