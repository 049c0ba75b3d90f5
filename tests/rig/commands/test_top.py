"""`ocpc top` in a real terminal: tmux runs it, a session goes through the proxy, the pane shows it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.e2e.test_e2e_claude_code import END_AT_ONCE
from tests.helpers import DATA, SUITE_WAIT_S, TEST_SERVER_ARGS
from tests.unit.doors.test_proxy import capture

pytestmark = pytest.mark.rig


def wait_for(check: Any, what: str, timeout: float = SUITE_WAIT_S) -> Any:
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
    env = {
        **os.environ,
        "OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"),
        "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port),
        "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()),
        "TERM": "xterm-256color",
        "COLUMNS": "130",
        "LINES": "40",
    }
    with open(tmp_path / "proxy.log", "wb") as out:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "oc_prefix_cache", "proxy", "--server", server.url],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sock = tmp_path / "tmux.sock"  # a server of its own: the user's tmux is never touched
    command = f"{sys.executable} -m oc_prefix_cache top --server {server.url} --interval 0.5"
    run = [tmux, "-S", str(sock)]
    top_pid = None
    try:
        wait_for(lambda: _up(f"http://127.0.0.1:{proxy_port}/health"), "the proxy")
        subprocess.run(
            [
                *run,
                "new-session",
                "-d",
                "-x",
                "130",
                "-y",
                "40",
                "-s",
                "top",
                *[a for k, v in env.items() if k.startswith(("OC_PREFIX", "TERM")) for a in ("-e", f"{k}={v}")],
                command,
            ],
            check=True,
            timeout=30,
        )
        top_pid = int(
            subprocess.run(
                [*run, "list-panes", "-t", "top", "-F", "#{pane_pid}"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.split()[0]
        )

        def pane():
            return subprocess.run(
                [*run, "capture-pane", "-p", "-t", "top"],
                capture_output=True,
                text=True,  # noqa: E731
                check=True,
                timeout=10,
            ).stdout

        wait_for(lambda: "no request yet" in pane(), "top's first screen")
        for name in ("A1", "A2-continue", "A2"):
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = loopback.post(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            assert answer.status_code == 200, answer.text[:300]
        screen = wait_for(
            lambda: (lambda text: text if text.count(" pi ") >= 3 and " idle " in text else None)(pane()),
            "three pi requests, the slot idle again",
        )  # busy a moment after the last answer
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
    data = json.loads(
        subprocess.run(
            [sys.executable, "-m", "oc_prefix_cache", "top", "--json", "--server", server.url],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert data["server"]["up"] and len(data["requests"]) == 3 and data["disk"]["by_kind"]["head"]["files"] == 1


def _up(url: str) -> bool:
    try:
        return loopback.get(url, timeout=0.5).status_code == 200
    except ServerError:
        return False


def test_top_and_status_show_each_model_of_a_router(models: dict[str, Path], tmp_path: Path) -> None:
    """`ocpc launch --models-dir` (a router over qwen35 and qwen3, one loaded at a time): a pi session
    on qwen35, then one on qwen3, which unloads qwen35. `ocpc top` in tmux shows qwen3's slots with
    what ocpc holds there, qwen35 as unloaded, and the requests by model; `ocpc top --json` and
    `ocpc status --json` say the same per model. Looking loads nothing."""
    tmux = shutil.which("tmux")
    assert tmux, "tmux is needed to test ocpc top in a real terminal (README prerequisites)"
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("qwen35", "qwen3"):
        (folder / f"{name}.gguf").symlink_to(models[name])
    port, proxy_port = free_port(), free_port()
    router = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"),
        "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port),
        "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()),
        "TERM": "xterm-256color",
        "COLUMNS": "130",
        "LINES": "50",
    }
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oc_prefix_cache",
                "launch",
                "--models-dir",
                str(folder),
                "--port",
                str(port),
                "--",
                "-c",
                "16384",
                *END_AT_ONCE,
                *TEST_SERVER_ARGS,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sock = tmp_path / "tmux.sock"
    run = [tmux, "-S", str(sock)]
    top_pid = None

    def statuses() -> dict[str, str]:
        data = loopback.get(f"{router}/models", timeout=10).json()
        return {m["id"]: m["status"]["value"] for m in data["data"]}

    def ocpc_json(*args: str) -> Any:
        return json.loads(
            subprocess.run(
                [sys.executable, "-m", "oc_prefix_cache", *args, "--json", "--server", router],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        )

    try:
        wait_for(lambda: "ready: llama-server" in log.read_text(), "ocpc launch")
        subprocess.run(
            [
                *run,
                "new-session",
                "-d",
                "-x",
                "130",
                "-y",
                "50",
                "-s",
                "top",
                *[a for k, v in env.items() if k.startswith(("OC_PREFIX", "TERM")) for a in ("-e", f"{k}={v}")],
                f"{sys.executable} -m oc_prefix_cache top --server {router} --interval 0.5",
            ],
            check=True,
            timeout=30,
        )
        top_pid = int(
            subprocess.run(
                [*run, "list-panes", "-t", "top", "-F", "#{pane_pid}"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.split()[0]
        )

        def pane():
            return subprocess.run(
                [*run, "capture-pane", "-p", "-t", "top"],
                capture_output=True,
                text=True,  # noqa: E731
                check=True,
                timeout=10,
            ).stdout

        first = wait_for(
            lambda: (lambda text: text if "no request yet" in text else None)(pane()), "top's first screen"
        )
        assert "2 models, 0 loaded" in first and "qwen35 (unloaded)" in first, first
        for model in ("qwen35", "qwen3"):
            headers, body = capture(DATA / "pi-0.73.1" / "A1.json")
            answer = loopback.post(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
                headers=headers,
                timeout=120,
                json={**body, "model": model, "max_tokens": 2},
            )
            assert answer.status_code == 200, answer.text[:300]
        assert statuses() == {"qwen35": "unloaded", "qwen3": "loaded"}
        screen = wait_for(
            lambda: (lambda text: text if text.count(" pi ") >= 2 and "[daemon]" in text else None)(pane()),
            "both requests and qwen3's slot",
        )
        print("\n" + screen)
        assert "router: qwen3" in screen and "(loaded)" in screen, screen
        assert "not loaded: qwen35 (unloaded)" in screen, screen
        # qwen3's slot 0 (busy for a moment while the watch parks its conversation ahead)
        assert re.search(r"│ 0\s+│ (idle|busy)\s+│ (conversation|head|project head) ", screen), screen
        rows = [line for line in screen.splitlines() if " pi " in line]
        assert any("qwen35" in r for r in rows) and any("qwen3 " in r for r in rows), rows  # requests by model

        top = ocpc_json("top")
        assert top["server"]["router"] is True
        assert {m["id"]: m["status"] for m in top["server"]["models"]} == {"qwen35": "unloaded", "qwen3": "loaded"}
        qwen3 = next(m for m in top["server"]["models"] if m["id"] == "qwen3")
        assert qwen3["model"] == "qwen3.gguf" and len(qwen3["slots"]) == 1, qwen3
        assert top["doors"]["daemon"]["models"]["qwen3"]["holding"]["0"]["kind"] in ("head", "proj", "conv"), top
        status = ocpc_json("status")
        print(json.dumps(status["server"]), json.dumps(status["daemon"].get("models")))
        assert status["server"]["router"] is True and status["server"]["slots"] == 1
        models_ = {m["id"]: m for m in status["server"]["models"]}
        assert models_["qwen35"]["status"] == "unloaded" and "slots" not in models_["qwen35"]
        assert models_["qwen3"]["slots"] == 1 and models_["qwen3"]["busy"] == [], models_
        daemon_models = status["daemon"]["models"]
        assert daemon_models["qwen35"]["counters"]["warmed"] == 1 and daemon_models["qwen3"]["counters"]["warmed"] == 1
        assert daemon_models["qwen35"]["holding"] == {} and daemon_models["qwen3"]["holding"]["0"]["kind"] == "conv"
        assert status["verdict"].startswith("warm"), status["verdict"]
        text = subprocess.run(
            [sys.executable, "-m", "oc_prefix_cache", "status", "--server", router],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        print(text)
        assert "router: 2 models, 1 loaded" in text and "model qwen35  unloaded" in text, text
        time.sleep(2)  # top and status looked at qwen35 all along, and the watch did: it stays unloaded
        assert statuses() == {"qwen35": "unloaded", "qwen3": "loaded"}
    finally:
        if top_pid is not None:
            os.kill(top_pid, signal.SIGTERM)
        subprocess.run([*run, "kill-server"], check=False, timeout=10)
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=SUITE_WAIT_S)
        finally:
            if launcher.poll() is None:
                stop_group(launcher, grace=5)
