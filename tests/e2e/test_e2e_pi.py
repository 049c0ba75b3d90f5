"""End to end: the real pi 0.73.1 (`-p`), `ocpc proxy` as a real process, a real llama-server.

pi's provider lives in `~/.pi/agent/models.json` of the test's temporary HOME, pointing at the proxy,
with `compat.sendSessionAffinityHeaders` on (its session id then arrives as `x-session-affinity`).
Two sessions in project A, one in project B, one after a server restart: every first request after
the first is served from the head (cache_n >= 90% of it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import END_AT_ONCE, ProxyProcess, projects
from tests.harness_bins import Bin
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig

VERSION = "0.73.1"


BIN = Bin(
    f"pi-{VERSION}",
    f"@mariozechner/pi-coding-agent@{VERSION}",
    "node_modules/@mariozechner/pi-coding-agent/dist/cli.js",
)


@pytest.fixture
def pi_cli() -> Path:
    return BIN.install()


def write_models(home: Path, proxy_url: str) -> None:
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    (agent / "models.json").write_text(
        json.dumps(
            {
                "providers": {
                    "local": {
                        "baseUrl": f"{proxy_url}/v1",
                        "api": "openai-completions",
                        "apiKey": "dummy",
                        "compat": {"sendSessionAffinityHeaders": True},
                        "models": [{"id": "local-model", "maxTokens": 64}],
                    }
                }
            },
            indent=1,
        )
    )


def run_pi(cli: Path, project: Path, prompt: str) -> str:
    env = {
        **os.environ,
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
        "TZ": "UTC",
        "TERM": "dumb",
        "PWD": str(project),
    }
    proc = subprocess.run(
        ["node", str(cli), "-p", "--provider", "local", "--model", "local-model", prompt],
        cwd=project,
        env=agent_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"pi failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_pi_sessions_are_served_from_the_head(
    llama_server: Any, pi_cli: Path, isolated_home: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=16384, extra_args=END_AT_ONCE)
    dirs = projects(tmp_path)
    rows: list[dict[str, Any]] = []
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        write_models(isolated_home, proxy.url)
        for name, project, restart in (
            ("A1", dirs["A"], False),
            ("A2", dirs["A"], False),
            ("B1", dirs["B"], False),
            ("A3 after restart", dirs["A"], True),
        ):
            if restart:
                server.restart()
            run_pi(pi_cli, project, "say ok")
            requests = proxy.new_requests()
            assert len(requests) == 1, json.dumps(requests, indent=1)  # -p: one request per turn
            rows.append(
                {
                    "session": name,
                    **{
                        k: requests[0][k]
                        for k in ("adapter", "action", "prefix_tokens", "cache_n", "prompt_n", "reason")
                    },
                }
            )
        status = proxy.status()
    # one request per session (-p), each one reported served
    verdict.judge_sessions(rows, status["counters"], adapter="pi", bounded=(), served=4)
