"""End to end: the real Claude Code 2.1.332 binary (`-p`), `ocpc proxy` as a real process, and a real
llama-server (tiny hybrid model, `--logit-bias 151645+30` so every reply ends at once).

Without the proxy Claude Code gets HTTP 500 from b11434 ("System message must be at the beginning").
Through it: two sessions in project A, one in project B, one after a server restart; every first
request after the first is served from the head (cache_n >= 90% of it). With -np 2, a conversation in
A and another-prompt conversation in B alternate, each keeping its slot and processing only its new
tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.llama_process import free_port
from oc_prefix_cache.process import stop_group

from .harness_bins import Bin, npm_install  # noqa: F401 (npm_install: the other end-to-end tests' import)

pytestmark = pytest.mark.rig

VERSION = "2.1.332"
END_AT_ONCE = ("--logit-bias", "151645+30")  # <|im_end|> in the tiny models' vocabulary (notes)


BIN = Bin(f"claude-code-{VERSION}", f"@anthropic-ai/claude-code@{VERSION}",
          "node_modules/@anthropic-ai/claude-code/bin/claude.exe")


@pytest.fixture
def claude_bin() -> Path:
    return BIN.install()


class ProxyProcess:
    """`ocpc proxy` as a real subprocess (the CLI), stopped by its PID."""

    def __init__(self, server_url: str, log: Path, *, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.server_url, self.log, self.env = server_url, log, env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ProxyProcess:
        env = {**os.environ, "OC_PREFIX_CACHE_PROXY_PORT": str(self.port), **self.env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "oc_prefix_cache", "proxy", "--server",
                                          self.server_url, "-v"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        for _ in range(150):
            try:
                httpx.get(f"{self.url}/ocpc/status", timeout=0.5).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"the proxy did not start: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=5)

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/ocpc/status", timeout=5).json()
        return data

    def new_requests(self) -> list[dict[str, Any]]:
        """The chat requests the proxy finished since the last call (it keeps the last 64)."""
        recent = self.status()["recent"]
        total = self.status()["counters"].get("requests", 0)
        fresh = [r for r in recent if r["at"] > self.seen]
        if recent:
            self.seen = max(r["at"] for r in recent)
        assert total >= len(fresh)
        return fresh


def make_project(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    git = {"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.com", "GIT_COMMITTER_NAME": "dev",
           "GIT_COMMITTER_EMAIL": "dev@example.com", "GIT_AUTHOR_DATE": "2026-11-29T12:00:00Z",
           "GIT_COMMITTER_DATE": "2026-11-29T12:00:00Z"}
    for args in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", *args], cwd=path, env={**os.environ, **git}, check=True, capture_output=True)
    return path


def claude_env(proxy_url: str) -> dict[str, str]:
    return {**os.environ, "ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_AUTH_TOKEN": "dummy",
            "ANTHROPIC_MODEL": "local-model", "ANTHROPIC_SMALL_FAST_MODEL": "local-model",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "local-model", "ANTHROPIC_DEFAULT_SONNET_MODEL": "local-model",
            "ANTHROPIC_DEFAULT_OPUS_MODEL": "local-model", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64", "TERM": "dumb", "TZ": "UTC"}


def run_claude(binary: Path, env: dict[str, str], project: Path, *args: str) -> str:
    proc = subprocess.run([str(binary), *args], cwd=project, env={**env, "PWD": str(project)}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"claude failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def projects(tmp_path: Path) -> dict[str, Path]:
    return {"A": make_project(tmp_path / "projA", {"README.md": "# A\n", "calc.py": "def add(a, b):\n    return a + b\n"}),
            "B": make_project(tmp_path / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"})}


@pytest.mark.parametrize("moved", [False, True], ids=["default", "environment-to-system"])
def test_claude_code_sessions_are_served_from_the_head(llama_server: Any, claude_bin: Path, tmp_path: Path,
                                                      moved: bool) -> None:
    server = llama_server("qwen35", ctx_size=32768, extra_args=END_AT_ONCE)
    dirs = projects(tmp_path)
    rows: list[dict[str, Any]] = []
    opt_in = {"OC_PREFIX_CACHE_NORMALISE_ON": "environment-to-system"} if moved else {}
    with ProxyProcess(server.url, tmp_path / "proxy.log", env=opt_in) as proxy:
        env = claude_env(proxy.url)
        for name, project, restart in (("A1", dirs["A"], False), ("A2", dirs["A"], False),
                                       ("B1", dirs["B"], False), ("A3 after restart", dirs["A"], True)):
            if restart:
                server.restart()
            run_claude(claude_bin, env, project, "-p", "say ok")
            requests = proxy.new_requests()
            # The tiny model's reply is empty, so Claude Code asks once more in the same session
            # ("Your previous response had no visible output"): the first is the session's first.
            assert 1 <= len(requests) <= 2, json.dumps(requests, indent=1)
            rows += [{"session": name, "request": i + 1, **{k: r[k] for k in (
                "action", "prefix_tokens", "cache_n", "prompt_n", "reason")}} for i, r in enumerate(requests)]
        counters = proxy.status()["counters"]
    print("\n" + "\n".join(json.dumps(row) for row in rows))
    firsts = [row for row in rows if row["request"] == 1]
    assert firsts[0]["action"] == "warmed", firsts[0]
    for row in firsts[1:]:
        assert row["action"] in ("hit", "restored"), row
        assert row["cache_n"] >= 0.9 * row["prefix_tokens"], row  # served from the head
    assert "gate" in firsts[3]["reason"] or "proven" not in firsts[3]["reason"], firsts[3]  # re-proven after restart
    for row in rows:  # and every other request too
        assert row["cache_n"] >= 0.9 * row["prefix_tokens"], row
    assert counters.get("report:served", 0) == len(rows) and not any(k.startswith("fail_open") for k in counters)
    # with the opt-in environment-to-system, a new session in the same project, and one after a
    # restart, process only what is new: the environment entry moved into the system text and the
    # project head cut after the first message's reminders, just before the typed text (issue 18;
    # by default the environment after the typed text is processed again: 4,812 of 14,274, 34%)
    first_prompt = sum(r["cache_n"] + r["prompt_n"] for r in rows if r["session"] == "A1")
    for session in ("A2", "A3 after restart"):
        processed = sum(r["prompt_n"] for r in rows if r["session"] == session)
        print(f"{session}: processed {processed} of the first session's {first_prompt} prompt tokens")
        if moved:
            assert processed <= 0.02 * first_prompt, (session, processed, first_prompt, rows)


def test_two_claude_code_conversations_alternate_on_their_own_slots(
        llama_server: Any, claude_bin: Path, tmp_path: Path) -> None:
    server = llama_server("qwen35", ctx_size=65536, parallel=2, extra_args=END_AT_ONCE)
    dirs = projects(tmp_path)
    turns = [("P", dirs["A"], ["-p", "say ok"]), ("Q", dirs["B"], ["-p", "reply with the word ok"])]
    turns += [(name, project, ["-c", "-p", f"turn {i} of {name}"]) for i in (2, 3) for name, project, _ in turns[:2]]
    rows: list[dict[str, Any]] = []
    with ProxyProcess(server.url, tmp_path / "proxy.log") as proxy:
        env = claude_env(proxy.url)
        for turn, (name, project, args) in enumerate(turns):
            run_claude(claude_bin, env, project, *args)
            rows += [{"conversation": name, "turn": turn // 2 + 1, "request": i + 1, **{k: r[k] for k in (
                "slot", "rule", "action", "cache_n", "prompt_n")}} for i, r in enumerate(proxy.new_requests())]
    print("\n" + "\n".join(json.dumps(row) for row in rows))
    slots = {name: {r["slot"] for r in rows if r["conversation"] == name} for name in ("P", "Q")}
    assert len(slots["P"]) == 1 and len(slots["Q"]) == 1 and slots["P"] != slots["Q"], rows
    for row in rows:  # each later turn processes only its new tokens (its retry too: it extends the turn)
        if row["turn"] > 1:
            assert row["rule"] == "own" and row["cache_n"] > 10_000 and row["prompt_n"] < 200, row
