"""End to end: the real Cline CLI 3.0.65 binary (`cline "say ok"`), `ocpc proxy` as a real process, and a
real llama-server (tiny hybrid model, every reply ending at once). Cline speaks chat completions
through the AI SDK's OpenAI-compatible provider, which `ocpc install --harness cline` (a real
process) points at the proxy in its providers.json, as `cline auth -p openai -b <proxy>/v1` would
but reversibly. Two sessions in project A, one in project B, one after a server restart: every first
request after the first restores the head or the project head, and a new session in a project it has
seen processes at most 2% of the first session's prompt tokens. Cline rewrites providers.json on
each run; `ocpc uninstall` still takes exactly ocpc's entries out (here: the whole file it created).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import END_AT_ONCE, ProxyProcess, make_project
from tests.harness_bins import Bin
from tests.helpers import install_harness, uninstall_harness
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig

VERSION = "3.0.65"


BIN = Bin(f"cline-{VERSION}", f"cline@{VERSION}", "node_modules/.bin/cline")


@pytest.fixture
def cline_bin() -> Path:
    return BIN.install()


def cline_env(home: Path) -> dict[str, str]:
    # local backend: by default Cline starts a detached hub daemon that outlives the command
    return {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "TERM": "dumb",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "CLINE_SESSION_BACKEND_MODE": "local",
        "CLINE_NO_AUTO_UPDATE": "1",
    }


PROVIDERS = Path(".cline") / "data" / "settings" / "providers.json"


def cline_home(home: Path, proxy_url: str, server_url: str) -> Path:
    """A HOME whose Cline provider is the proxy (OpenAI compatible), written by `ocpc install --harness cline`."""
    home.mkdir(parents=True, exist_ok=True)
    install_harness(
        "cline", proxy_url=proxy_url, server_url=server_url, env={"HOME": str(home)}, args=("--model", "local-model")
    )
    assert (home / PROVIDERS).exists()
    return home


def run_cline(binary: Path, home: Path, project: Path, prompt: str) -> str:
    """One session. The tiny model's reply is empty (it ends at once), which Cline reports as an error
    and exit status 1 after the request was answered: that one failure is expected here."""
    proc = subprocess.run(
        [str(binary), prompt],
        cwd=project,
        env=agent_env(cline_env(home)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    empty = proc.returncode == 1 and "Model returned empty response" in proc.stdout + proc.stderr
    assert proc.returncode == 0 or empty, (
        f"cline failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_cline_sessions_are_served_from_the_head_and_the_project_head(
    llama_server: Any, cline_bin: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"}),
    }
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        home = cline_home(tmp_path / "cline-home", proxy.url, server.url)
        rows = proxy.four_sessions(server, dirs, lambda p: run_cline(cline_bin, home, p, "say ok"))
        counters = proxy.status()["counters"]
    print((home / PROVIDERS).read_text())  # as Cline left it
    assert "removed" in uninstall_harness("cline", env={"HOME": str(home)})
    assert not (home / PROVIDERS).exists()
    verdict.judge_sessions(rows, counters, adapter="cline", path_prefix="/v1/chat/completions")
