"""End to end: the real OpenHands CLI 1.16.0 (`openhands --headless -t`, the SDK's local workspace: no
Docker), `ocpc proxy` as a real process, and a real llama-server (tiny hybrid model, every reply the
one token "ok": OpenHands nudges an empty reply again and again). OpenHands speaks chat completions
through litellm (`LLM_MODEL=openai/<name>`, `LLM_BASE_URL`, `--override-with-envs`). Two sessions in
project A, one in project B, one after a server restart. Its tools name the working directory, so
each project has its own head: B's first session builds it; a new session in a project it has seen
processes only what follows the head (the time to the microsecond, the working directory, the typed
text), at most 2% of the first session's prompt tokens, and no project head is saved (nothing after
the head is the same for two sessions).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import SAY_OK, ProxyProcess, make_project
from tests.harness_bins import Bin
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig

VERSION = "1.16.0"


BIN = Bin(f"openhands-{VERSION}", f"openhands=={VERSION}", "bin/openhands", pypi=True, python=(3, 12))


@pytest.fixture
def openhands_bin() -> Path:
    return BIN.install()


def run_openhands(binary: Path, home: Path, project: Path, proxy_url: str, prompt: str) -> str:
    """One headless session. OpenHands clones its public skills from GitHub at start (it fails here,
    offline, and goes on) and litellm fetches its price list (LITELLM_LOCAL_MODEL_COST_MAP: not)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "TERM": "dumb",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "LLM_MODEL": "openai/local-model",
        "LLM_BASE_URL": f"{proxy_url}/v1",
        "LLM_API_KEY": "dummy",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "OPENHANDS_SUPPRESS_BANNER": "1",
    }
    proc = subprocess.run(
        [str(binary), "--headless", "--override-with-envs", "-t", prompt],
        cwd=project,
        env=agent_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"openhands failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_openhands_sessions_are_served_from_the_head(llama_server: Any, openhands_bin: Path, tmp_path: Path) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=SAY_OK)
    calc = "def add(a, b):\n    return a + b\n"
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": calc}),
        "B": make_project(
            tmp_path / "projB",
            {"README.md": "# B\n", "greet.js": "console.log('hi')\n", "AGENTS.md": "# Agents\nUse tabs.\n"},
        ),
    }
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        rows = proxy.four_sessions(
            server, dirs, lambda p: run_openhands(openhands_bin, tmp_path / "openhands-home", p, proxy.url, "say ok")
        )
        counters = proxy.status()["counters"]
    verdict.judge_sessions(
        rows, counters, adapter="openhands", path_prefix="/v1/chat/completions", warmed_in=("A1", "B1")
    )  # a head per project
    assert not any("project head" in str(row["reason"]) for row in rows), rows
