"""End to end: the real Kilo Code CLI 7.7.9 binary (`kilo run`), `ocpc proxy` as a real process, and a
real llama-server (tiny hybrid model, every reply ending at once). Kilo speaks chat completions to
an OpenAI-compatible provider in its `kilo.json`. Two sessions in project A, one in project B (with
an AGENTS.md), one after a server restart: every session's first request after the first restores
the head or the project head, and a new session in a project it has seen processes at most 2% of
the first session's prompt tokens (its typed text and the environment part after it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import END_AT_ONCE, ProxyProcess, make_project
from tests.harness_bins import Bin
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig

VERSION = "7.7.9"  # the newest Linux binary on npm (@kilocode/cli@7.8.1's was not published there)


BIN = Bin(
    f"kilocode-cli-{VERSION}", f"@kilocode/cli-linux-x64@{VERSION}", "node_modules/@kilocode/cli-linux-x64/bin/kilo"
)


@pytest.fixture
def kilo_bin() -> Path:
    return BIN.install()


def kilo_home(home: Path, proxy_url: str, ocpc_home: Path) -> Path:
    """A HOME whose global kilo.json names the proxy as a provider, written by `ocpc install --harness
    kilo-code` (and undone byte for byte by `ocpc uninstall` at the end of the test)."""
    (home / ".config" / "kilo").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "OC_PREFIX_CACHE_HOME": str(ocpc_home),
        "OC_PREFIX_CACHE_PROXY_PORT": proxy_url.rsplit(":", 1)[1],
    }
    done = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", "install", "--harness", "kilo-code", "--model", "local-model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "added Kilo provider 'ocpc'" in done.stdout, done.stdout
    return home


def run_kilo(binary: Path, home: Path, project: Path, prompt: str) -> str:
    env = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "TERM": "dumb",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "KILO_DISABLE_AUTOUPDATE": "1",
        "KILO_DISABLE_MODELS_FETCH": "1",
        "KILO_DISABLE_SHARE": "1",
        "KILO_DISABLE_SESSION_INGEST": "1",
    }
    proc = subprocess.run(
        [str(binary), "run", prompt],
        cwd=project,
        env=agent_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # the tiny model's reply is empty (END_AT_ONCE), which Kilo reports as an error after the turn
    empty = proc.returncode == 1 and "the model returned no output" in proc.stdout + proc.stderr
    assert proc.returncode == 0 or empty, (
        f"kilo failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_kilo_code_sessions_are_served_from_the_head_and_the_project_head(
    llama_server: Any, kilo_bin: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(
            tmp_path / "projB",
            {
                "README.md": "# B\n",
                "greet.js": "console.log('hi')\n",
                "AGENTS.md": "# B rules\nUse tabs for indentation.\n",
            },
        ),
    }
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        home = kilo_home(tmp_path / "home", proxy.url, tmp_path / "ocpc")
        rows = proxy.four_sessions(server, dirs, lambda p: run_kilo(kilo_bin, home, p, "say ok"))
        counters = proxy.status()["counters"]
    # each run's agent requests (with tools: a head); a title request, if one comes, has none
    verdict.judge_sessions(
        rows, counters, adapter="kilo-code", path="/v1/chat/completions", turn=lambda row: bool(row["prefix_tokens"])
    )
