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

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.llama.supervisor import stop_group
from tests.e2e import verdict
from tests.e2e.test_e2e_claude_code import END_AT_ONCE, ProxyProcess, make_project
from tests.harness_bins import Bin
from tests.helpers import DATA, ROOT, install_harness, uninstall_harness
from tests.proxy_stub import agent_env

pytestmark = pytest.mark.rig
_spec = importlib.util.spec_from_file_location("agents_bench", ROOT / "bench" / "agents_bench.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
sys.modules["agents_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

VERSION = "0.86.2"
CAPTURE = DATA / f"aider-{VERSION}" / "A1.json"


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
    said = install_harness(
        "aider", proxy_url=proxy_url, server_url=server_url, env={"HOME": str(home)}, args=("--model", "local-model")
    )
    assert "replaced your model: 'sonnet' with 'openai/local-model'" in said, said
    return home


# Aider as a person runs it in CI: no commits, no prompts, no update checks, plain output.
AIDER_ARGS = (
    "--no-auto-commits",
    "--yes-always",
    "--no-check-update",
    "--no-show-model-warnings",
    "--analytics-disable",
    "--no-show-release-notes",
    "--no-gitignore",
    "--no-pretty",
    "--no-fancy-input",
)


def aider_env(home: Path) -> dict[str, str]:
    """A clean environment (the proxy stub's variables added by ``agent_env``): nothing of the
    machine's own Aider or LiteLLM settings leaks in."""
    return agent_env(
        {
            "HOME": str(home),
            "PATH": "/usr/bin:/bin",
            "TERM": "dumb",
            "TZ": "UTC",
            "LANG": "C.UTF-8",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
    )


def run_aider(binary: Path, home: Path, project: Path, prompt: str) -> str:
    """One session; the model, base URL and key come from the installed ~/.aider.conf.yml only."""
    proc = subprocess.run(
        [str(binary), *AIDER_ARGS, "--message", prompt],
        cwd=project,
        env=aider_env(home),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"aider failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def last_message_tokens(server_url: str) -> int:
    """Tokens of the captured session's last message (the typed text "say ok" and the reminder)."""
    body = json.loads(CAPTURE.read_text())["body_json"]
    content = body["messages"][-1]["content"]
    assert content.startswith("say ok\n\n")
    response = loopback.post(f"{server_url}/tokenize", json={"content": content}, timeout=30)
    response.raise_for_status()
    return len(response.json()["tokens"])


def test_aider_sessions_are_served_from_the_head_and_the_project_head(
    llama_server: Any, aider_bin: Path, tmp_path: Path
) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"}),
    }
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        home = aider_home(tmp_path / "aider-home", proxy.url, server.url)
        rows = proxy.four_sessions(server, dirs, lambda p: run_aider(aider_bin, home, p, "say ok"))
        counters = proxy.status()["counters"]
    uninstall_harness("aider", env={"HOME": str(home)})
    assert (home / ".aider.conf.yml").read_text() == USERS_CONFIG  # the user's file, byte for byte
    last = last_message_tokens(server.url)
    print(f"\nthe captured session's last message is {last} tokens")
    # a new session in a project seen processes its last message only
    verdict.judge_sessions(rows, counters, adapter="aider", path_prefix="/v1/chat/completions", at_most=last + 16)


def test_two_aider_sessions_of_two_projects_side_by_side_each_keep_their_conversation(
    llama_server: Any, family_args: Any, aider_bin: Path, tmp_path: Path
) -> None:
    """Issue 36, defect 1: Aider sends no session id, and its system prompt and example exchange
    are the same in every project; keyed by those, every Aider session on a machine was one
    conversation (project B sent to project A's slot, A never parked, one park file for both).
    Two sessions of two projects, two turns each, side by side through the proxy on the real
    Gemma model with two slots (the tiny models crash with two requests at once): each turn after
    the first processes only what is new in its own conversation, never the other's, and a
    graceful stop parks them as two files, one each."""
    server = llama_server(
        "gemma3", ctx_size=2 * 16384, parallel=2, extra_args=("-n", "12", *family_args("gemma3"))
    )  # short replies: the prompts are the test
    dirs = {
        "A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
        "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"}),
    }
    typed = {"A": ("say ok", "say it again"), "B": ("what is in this repo", "and the other file")}
    with bench.Launched(server.url, tmp_path / "ocpc") as launched:
        home = aider_home(tmp_path / "aider-home", launched.doors.proxy, server.url)
        sessions = {name: start_aider(aider_bin, home, dirs[name], tmp_path / f"aider-{name}.log") for name in dirs}
        try:
            for turn in (0, 1):  # each turn sent to both at once, then waited for
                before = len(proxy_rows(launched))
                for name, proc in sessions.items():
                    assert proc.stdin is not None
                    proc.stdin.write(typed[name][turn] + "\n")
                    proc.stdin.flush()
                wait_for(
                    lambda before=before: len(proxy_rows(launched)) >= before + 2,
                    what=f"turn {turn + 1} of both sessions",
                )
        finally:
            for proc in sessions.values():
                finish(proc)
        rows = [r for r in proxy_rows(launched) if r["adapter"] == "aider"]
        parked = launched.engine.park_live(deadline=Deadline.after(120))
        counters = launched.snapshot()
        slot_dir = launched.settings.slot_dir
    print("\n" + "\n".join(json.dumps(row) for row in rows) + "\nparked: " + json.dumps(parked))
    by_conversation: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_conversation.setdefault(row["conversation"], []).append(row)
    assert len(by_conversation) == 2, by_conversation  # two conversations, never one
    for _conversation, turns in by_conversation.items():
        assert len(turns) == 2, turns
        first, second = turns
        assert {first["slot"]} == {second["slot"]}, turns  # each kept its slot
        prompt = second["cache_n"] + second["prompt_n"]
        # the second turn reuses its own first turn (everything up to its first typed text; Aider
        # re-sends that text without the reminder it had, and the reply and the new text are new)
        assert second["cache_n"] >= first["cache_n"] + first["prompt_n"] - 300, turns
        assert second["prompt_n"] < prompt / 2, turns
    assert len({rows[0]["slot"], rows[1]["slot"]}) == 2  # side by side: one slot each
    parks = sorted(p.name for p in slot_dir.glob("oc-conv-*.bin"))
    assert len(parks) == 2, (parks, parked)  # two parks, one per conversation
    assert counters.get("report_missed", 0) == 0 and not any(k.startswith("proxy:fail_open") for k in counters), (
        counters
    )


def proxy_rows(launched: Any) -> list[dict[str, Any]]:
    """The chat requests the in-process proxy finished, oldest first (it keeps the last 64)."""
    assert launched.proxy is not None
    return [r for r in launched.proxy.proxy.status()["recent"] if r["path"].startswith("/v1/chat/completions")]


def start_aider(binary: Path, home: Path, project: Path, log: Path) -> subprocess.Popen[str]:
    """An interactive session reading typed lines from standard input (as `printf ... | aider`)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(binary), *AIDER_ARGS],
            cwd=project,
            env=aider_env(home),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def finish(proc: subprocess.Popen[str]) -> None:
    """End the session: its input closed (Aider exits at end of input), else stopped by its PID."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        stop_group(proc, grace=5)


def wait_for(done: Any, *, what: str, within: float = 600.0) -> None:
    """Poll until ``done()``, within the suite's generous bound (the event, not a guess of its time)."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(0.5)
