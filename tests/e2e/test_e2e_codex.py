"""End to end: the real Codex CLI 0.171.0 binary (`codex exec`), `ocpc proxy` as a real process, and a
real llama-server (tiny hybrid model, every reply ending at once). Codex speaks only the Responses
API: the proxy prepares `/v1/responses` from the server's own conversion (chat/responses.py) and pins it
with `id_slot`, which b11434 keeps there. Two sessions in project A, one in project B, one after a
server restart: every first request after the first restores the head or the project head, and a new
session in a project it has seen processes at most 2% of the first session's prompt tokens.

Codex is pointed at the proxy by `ocpc install --harness codex` (a real process), over a user's
config.toml that selects another provider: the install replaces that choice, Codex follows
it, and `ocpc uninstall` gives the user's file back byte for byte.
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

VERSION = "0.171.0"


BIN = Bin(f"codex-{VERSION}", f"@openai/codex@{VERSION}", "node_modules/.bin/codex")


@pytest.fixture
def codex_bin() -> Path:
    return BIN.install()


USERS_CONFIG = """# my Codex setup
model_provider = "openai"
approval_policy = "never"

[profiles.fast]
model = "gpt-5-mini"
"""


def codex_home(path: Path, proxy_url: str, server_url: str) -> Path:
    """A CODEX_HOME whose config.toml the user had (another provider selected), then pointed at the
    proxy by `ocpc install --harness codex`: a Responses-API provider, selected."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(USERS_CONFIG)
    said = install_harness(
        "codex", proxy_url=proxy_url, server_url=server_url, env=codex_env(path), args=("--model", "local-model")
    )
    assert "replaced your model_provider = 'openai'" in said, said
    return path


def codex_env(home: Path) -> dict[str, str]:
    return {"HOME": str(home.parent), "CODEX_HOME": str(home)}


def run_codex(binary: Path, home: Path, project: Path, prompt: str) -> str:
    env = {**codex_env(home), "PATH": "/usr/bin:/bin", "TERM": "dumb", "TZ": "UTC", "LANG": "C.UTF-8"}
    proc = subprocess.run(
        [str(binary), "exec", "--skip-git-repo-check", prompt],
        cwd=project,
        env=agent_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"codex failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_codex_sessions_are_served_from_the_head_and_the_project_head(
    llama_server: Any, codex_bin: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"}),
    }
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        home = codex_home(tmp_path / "home" / ".codex", proxy.url, server.url)
        rows = proxy.four_sessions(server, dirs, lambda p: run_codex(codex_bin, home, p, "say ok"))
        counters = proxy.status()["counters"]
    uninstall_harness("codex", env=codex_env(home))
    assert (home / "config.toml").read_text() == USERS_CONFIG  # the user's file, byte for byte
    verdict.judge_sessions(rows, counters, adapter="codex", path_prefix="/v1/responses")
