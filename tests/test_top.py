"""`ocpc top` in a real terminal: tmux runs it, a session goes through the proxy, the pane shows it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.llama_process import free_port
from oc_prefix_cache.process import stop_group

from .test_e2e_claude_code import END_AT_ONCE
from .test_proxy import capture

pytestmark = pytest.mark.rig
DATA = Path(__file__).parent / "data"


def wait_for(check: Any, what: str, timeout: float = 30) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_top_shows_the_slots_the_requests_and_the_disk(llama_server: Any, tmp_path: Path) -> None:
    tmux = shutil.which("tmux")
    assert tmux, "tmux is needed to test ocpc top in a real terminal (README prerequisites)"
    server = llama_server("qwen35", ctx_size=16384, extra_args=END_AT_ONCE)
    proxy_port = free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port),
           "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()), "TERM": "xterm-256color", "COLUMNS": "130", "LINES": "40"}
    with open(tmp_path / "proxy.log", "wb") as out:
        proxy = subprocess.Popen([sys.executable, "-m", "oc_prefix_cache", "proxy", "--server", server.url],
                                 env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sock = tmp_path / "tmux.sock"  # a server of its own: the user's tmux is never touched
    command = f"{sys.executable} -m oc_prefix_cache top --server {server.url} --interval 0.5"
    run = [tmux, "-S", str(sock)]
    top_pid = None
    try:
        wait_for(lambda: _up(f"http://127.0.0.1:{proxy_port}/health"), "the proxy")
        subprocess.run([*run, "new-session", "-d", "-x", "130", "-y", "40", "-s", "top",
                        *[a for k, v in env.items() if k.startswith(("OC_PREFIX", "TERM")) for a in ("-e", f"{k}={v}")],
                        command], check=True, timeout=30)
        top_pid = int(subprocess.run([*run, "list-panes", "-t", "top", "-F", "#{pane_pid}"], capture_output=True,
                                     text=True, check=True, timeout=10).stdout.split()[0])
        pane = lambda: subprocess.run([*run, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,  # noqa: E731
                                      check=True, timeout=10).stdout
        wait_for(lambda: "no request yet" in pane(), "top's first screen")
        for name in ("A1", "A2-continue", "A2"):
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body, headers=headers,
                                timeout=120)
            assert answer.status_code == 200, answer.text[:300]
        screen = wait_for(lambda: (lambda text: text if text.count(" pi ") >= 3 else None)(pane()), "three pi requests")
        print("\n" + screen)
        assert server.url in screen and "idle" in screen
        assert "[proxy]" in screen and ("head " in screen or "conversation " in screen), screen
        rows = [line for line in screen.splitlines() if " pi " in line]
        assert any(" head " in row for row in rows), rows  # the second session was served from the head
        assert "disk: heads 1" in screen, screen
    finally:
        if top_pid is not None:
            os.kill(top_pid, signal.SIGTERM)
        subprocess.run([*run, "kill-server"], check=False, timeout=10)
        stop_group(proxy, grace=5)
    data = json.loads(subprocess.run([sys.executable, "-m", "oc_prefix_cache", "top", "--json", "--server", server.url],
                                     env=env, capture_output=True, text=True, check=True, timeout=60).stdout)
    assert data["server"]["up"] and len(data["requests"]) == 3 and data["disk"]["by_kind"]["head"]["files"] == 1


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False
