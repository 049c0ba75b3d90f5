"""Capture Claude Code 2.1.332's requests as ``ocpc install --harness claude-code`` sets it up.

Run from the repository root with the project's venv: ``.venv/bin/python
tests/data/claude-code-2.1.332-installed/make_captures.py [--binary PATH]``. It makes a fresh HOME
and two git projects under a temporary folder, runs ``ocpc install --harness claude-code`` there
(pointed at a scripted stand-in for the model server, stdlib only, on a free port), runs the real
binary for each case below and writes each ``/v1/messages`` request it receives here, as
``<case>.json`` (one request) or ``<case>-N.json``, with the temporary paths rewritten to
``/home/dev``. The stand-in answers from the request alone: the main agent asked to use a subagent
calls ``Agent`` (foreground), the subagent calls ``Read`` once, anything else gets the text ``ok``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
DEFAULT_BINARY = (
    Path.home() / ".cache/oc-prefix-cache/claude-code-2.1.332/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
)
SUBAGENT_ASK = "Use a subagent to locate the refund logic in this repo, then reply done."
DELEGATED = "find where refunds are computed"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "dev",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "dev",
    "GIT_COMMITTER_EMAIL": "dev@example.com",
}


def reply(body: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
    """(kind, text or tool name, tool input): the script, from the request alone."""
    text = json.dumps(body["messages"])
    done = '"tool_result"' in text
    if DELEGATED in json.dumps(body["messages"][0]):
        if done:
            return "text", "refunds are in src/refund.py", None
        cwd = re.search(r"Primary working directory: (\S+)", text)
        return "tool_use", "Read", {"file_path": f"{cwd.group(1) if cwd else '/tmp'}/README.md"}
    if SUBAGENT_ASK in text and not done:
        return (
            "tool_use",
            "Agent",
            {
                "description": "Find refund computation",
                "prompt": DELEGATED,
                "subagent_type": "general-purpose",
                "run_in_background": False,
            },
        )
    return "text", "done" if SUBAGENT_ASK in text else "ok", None


def sse(kind: str, what: str, tool_input: dict[str, Any] | None) -> bytes:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "local-model",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 0},
    }
    if kind == "text":
        block: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": what}
    else:
        block = {"type": "tool_use", "id": "toolu_01", "name": what, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "usage": {"output_tokens": 5},
                "delta": {"stop_reason": "end_turn" if kind == "text" else "tool_use", "stop_sequence": None},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self.path.startswith("/v1/messages") or "count_tokens" in self.path:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = json.loads(raw)
                recorder.requests.append(
                    {"path": self.path, "headers": [[k, v] for k, v in self.headers.items()], "body_json": body}
                )
                data = sse(*reply(body))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_HEAD(self) -> None:  # noqa: N802
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> list[dict[str, Any]]:
        taken, self.requests = self.requests, []
        return taken


def git(project: Path, *args: str, date: str) -> None:
    env = {**os.environ, **GIT_ENV, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True)


def make_project(path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "init", "-q", "-b", "main", date="2026-11-29T12:00:00Z")
    git(path, "add", ".", date="2026-11-29T12:00:00Z")
    git(path, "commit", "-q", "-m", "init", date="2026-11-29T12:00:00Z")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    binary = parser.parse_args().binary
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch) / "home"
        home.mkdir()
        a = make_project(home / "projA", {"README.md": "# A\n", "src/refund.py": "def refund(x):\n    return x\n"})
        b = make_project(home / "projB", {"README.md": "# B\n", "greet.js": "console.log('hi')\n"})
        base = {
            "HOME": str(home),
            "PATH": os.environ["PATH"],
            "USER": "dev",
            "SHELL": "/bin/bash",
            "TERM": "dumb",
            "LANG": "C.UTF-8",
            "TZ": "UTC",
        }
        ocpc = {**base, "OC_PREFIX_CACHE_HOME": str(home / ".ocpc"), "OC_PREFIX_CACHE_PROXY_PORT": str(recorder.port)}
        subprocess.run(
            [sys.executable, "-m", "oc_prefix_cache", "install", "--harness", "claude-code"],
            env=ocpc,
            cwd=ROOT,
            check=True,
        )
        quiet = {
            "ANTHROPIC_MODEL": "local-model",
            "ANTHROPIC_SMALL_FAST_MODEL": "local-model",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        cases: list[tuple[str, Path, list[str]]] = [
            ("A1", a, ["-p", "say ok"]),
            ("A2", a, ["-p", "say ok"]),
            ("A2-continue", a, ["-c", "-p", "say ok again"]),
            ("B1", b, ["-p", "say ok"]),
            ("A3-commit", a, ["-p", "say ok"]),
            ("A4-subagent", a, ["-p", SUBAGENT_ASK]),
        ]
        for name, project, args in cases:
            if name == "A3-commit":  # the git status changes; the environment does not
                (project / "NOTES.md").write_text("notes\n")
                git(project, "add", ".", date="2026-11-29T13:00:00Z")
                git(project, "commit", "-q", "-m", "add notes", date="2026-11-29T13:00:00Z")
            done = subprocess.run(
                [str(binary), *args],
                cwd=project,
                env={**base, **quiet, "PWD": str(project)},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            taken = recorder.take()
            for i, request in enumerate(taken, start=1):
                text = json.dumps(request, ensure_ascii=False, indent=1)
                text = text.replace(str(home), "/home/dev").replace(str(home).replace("/", "-"), "-home-dev")
                text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:8766", text)
                out = HERE / (f"{name}.json" if len(taken) == 1 else f"{name}-{i}.json")
                out.write_text(text + "\n")
                print(out.name, len(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
