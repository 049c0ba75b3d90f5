"""End to end: the real Qwen Code 0.24.4 binary (`qwen -p`), `ocpc proxy` as a real process, and a
real llama-server (tiny hybrid model, every reply the one token "ok"). Qwen Code speaks chat completions;
it is pointed at the proxy by `ocpc install --harness qwen-code` (a real process): a `modelProviders`
entry in ~/.qwen/settings.json, selected, which wins over the shell's own `OPENAI_BASE_URL` (set here
to a port where nothing listens); `ocpc uninstall` removes the file it created. Two sessions in
project A, one in project B, one after a server restart: every session's first turn after the first
restores the head or the project head, and a new session in a project it has seen processes at most
2% of the first session's prompt tokens.

Each run also sends a memory-extraction request after its turn (its own system prompt): it has a
head of its own and is left out of the bound, which is about the sessions' turns.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.llama.server_process import free_port
from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import SAY_OK, ProxyProcess, make_project
from tests.harness_bins import Bin
from tests.helpers import install_harness, uninstall_harness
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig

VERSION = "0.24.4"


BIN = Bin(f"qwen-code-{VERSION}", f"@qwen-code/qwen-code@{VERSION}", "node_modules/.bin/qwen")


@pytest.fixture
def qwen_bin() -> Path:
    return BIN.install()


def run_qwen(binary: Path, home: Path, project: Path, prompt: str) -> subprocess.CompletedProcess[str]:
    """One session: where it sends its requests comes from the installed settings.json alone."""
    env = {
        "HOME": str(home),
        "PATH": f"{Path(binary).resolve().parent}:/usr/local/bin:/usr/bin:/bin",
        "TERM": "dumb",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{free_port()}/v1",
    }
    return subprocess.run(
        [str(binary), "-p", prompt],
        cwd=project,
        env=agent_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_qwen_code_sessions_are_served_from_the_head_and_the_project_head(
    llama_server: Any, qwen_bin: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=SAY_OK)
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"}),
    }
    home = tmp_path / "qwen-home"
    home.mkdir()
    settings = home / ".qwen" / "settings.json"
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        install_harness(
            "qwen-code",
            proxy_url=proxy.url,
            server_url=server.url,
            env={"HOME": str(home)},
            args=("--model", "local-model"),
        )
        installed = settings.read_bytes()

        def run(project: Path) -> Any:
            done = run_qwen(qwen_bin, home, project, "say ok")
            # SAY_OK: an empty reply would be retried 4 times with 2+4+6+8 s of backoff, then exit 1
            said = (done.stdout + done.stderr).strip().splitlines()
            assert done.returncode == 0, f"qwen failed ({done.returncode}): {said[-20:]}"
            print(f"exit {done.returncode}: {said[-1][:200] if said else ''}")
            return done

        rows = proxy.four_sessions(server, dirs, run, fields=lambda done: {"exit": done.returncode})
        counters = proxy.status()["counters"]
    assert settings.read_bytes() == installed  # $version 4: Qwen Code had nothing to migrate
    assert "removed" in uninstall_harness("qwen-code", env={"HOME": str(home)})
    assert not settings.exists()
    # each run's turn is its first request; the memory extraction follows it
    verdict.judge_sessions(rows, counters, adapter="qwen-code", turn=lambda row: row["request"] == 1)
