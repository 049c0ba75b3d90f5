"""End to end: the real Aider 0.86.2 (`aider --message`, litellm's `openai/` provider), `ocpc proxy` as a
real process, and a real llama-server (tiny hybrid model, every reply ending at once). Aider sends no
tools: its head is the system text alone, its project head runs through its fixed messages (the
format's examples, the repo map, the chat-files note). Two sessions in project A, one in project B,
one after a server restart: every first request after the first restores the head or the project
head, and a new session in a project it has seen processes only its last message: the typed text and
the edit format's reminder that Aider appends after it (~190 tokens, about a quarter of its small
prompt, so not the 2% of the agents whose prompts are large and whose typed text comes last).

Aider is pointed at the proxy by `ocpc install --harness aider` (a real process) in the home
folder's `.aider.conf.yml`, over the user's own (another model chosen, with a comment): the
install replaces the model in place, Aider follows the file, and `ocpc uninstall` gives the
user's file back byte for byte.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness_bins import Bin
from .helpers import install_harness, uninstall_harness
from .test_e2e_claude_code import END_AT_ONCE, ProxyProcess, make_project

pytestmark = pytest.mark.rig

VERSION = "0.86.2"
CAPTURE = Path(__file__).parent / "data" / f"aider-{VERSION}" / "A1.json"


BIN = Bin(f"aider-{VERSION}", f"aider-chat=={VERSION}", "bin/aider", pypi=True)


@pytest.fixture
def aider_bin() -> Path:
    return BIN.install()


USERS_CONFIG = """# my aider settings
model: sonnet   # the one I use at work
dark-mode: true
"""


def aider_home(home: Path, proxy_url: str, server_url: str) -> Path:
    """A HOME whose .aider.conf.yml the user had, pointed at the proxy by `ocpc install --harness aider`."""
    home.mkdir(parents=True, exist_ok=True)
    (home / ".aider.conf.yml").write_text(USERS_CONFIG)
    said = install_harness("aider", proxy_url=proxy_url, server_url=server_url, env={"HOME": str(home)},
                           args=("--model", "local-model"))
    assert "replaced your model: 'sonnet' with 'openai/local-model'" in said, said
    return home


def run_aider(binary: Path, home: Path, project: Path, prompt: str) -> str:
    """One session; the model, base URL and key come from the installed ~/.aider.conf.yml only."""
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "TERM": "dumb", "TZ": "UTC", "LANG": "C.UTF-8",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = ["--no-auto-commits", "--yes-always", "--no-check-update", "--no-show-model-warnings",
            "--analytics-disable", "--no-show-release-notes", "--no-gitignore", "--no-pretty", "--no-fancy-input",
            "--message", prompt]
    proc = subprocess.run([str(binary), *args], cwd=project, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"aider failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def last_message_tokens(server_url: str) -> int:
    """Tokens of the captured session's last message (the typed text "say ok" and the reminder)."""
    body = json.loads(CAPTURE.read_text())["body_json"]
    content = body["messages"][-1]["content"]
    assert content.startswith("say ok\n\n")
    response = httpx.post(f"{server_url}/tokenize", json={"content": content}, timeout=30)
    response.raise_for_status()
    return len(response.json()["tokens"])


def test_aider_sessions_are_served_from_the_head_and_the_project_head(llama_server: Any, aider_bin: Path,
                                                                      tmp_path: Path) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = {"A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
            "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"})}
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        home = aider_home(tmp_path / "aider-home", proxy.url, server.url)
        rows = proxy.four_sessions(server, dirs, lambda p: run_aider(aider_bin, home, p, "say ok"))
        counters = proxy.status()["counters"]
    uninstall_harness("aider", env={"HOME": str(home)})
    assert (home / ".aider.conf.yml").read_text() == USERS_CONFIG  # the user's file, byte for byte
    print("\n" + "\n".join(json.dumps(row) for row in rows))
    firsts = [row for row in rows if row["request"] == 1]
    assert all(row["adapter"] == "aider" and row["path"].startswith("/v1/chat/completions") for row in rows), rows
    assert firsts[0]["action"] == "warmed", firsts[0]
    for row in firsts[1:]:
        assert row["action"] in ("hit", "restored"), row
        assert row["cache_n"] >= 0.9 * row["prefix_tokens"], row
    first_prompt = sum(r["cache_n"] + r["prompt_n"] for r in rows if r["session"] == "A1")
    last = last_message_tokens(server.url)
    for session in ("A2", "A3 after restart"):
        processed = sum(r["prompt_n"] for r in rows if r["session"] == session)
        print(f"{session}: processed {processed} of {first_prompt} ({processed / first_prompt:.1%}); "
              f"its last message is {last} tokens")
        assert processed <= last + 16, (session, processed, last, first_prompt, rows)  # its last message only
    assert not any(k.startswith("fail_open") for k in counters), counters
