"""The real Claude Code 2.1.332 and pi 0.73.1 (from npm) follow what `ocpc install` wrote.

Each runs with the test's HOME against a stdlib stub that records every request, in the
place of the proxy: the request must go to the configured URL, with the headers the proxy
relies on. Then `ocpc uninstall` gives the config back byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.install import claude_code, pi, uninstall
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.settings import Settings

pytestmark = pytest.mark.rig

CLAUDE = ("@anthropic-ai/claude-code", "2.1.332", "claude-code-2.1.332", "claude")
PI = ("@mariozechner/pi-coding-agent", "0.73.1", "pi-0.73.1", "pi")


def npm_binary(package: str, version: str, folder_name: str, name: str) -> Path:
    """The harness from npm, installed once beside the rig cache (fails loudly without npm)."""
    from tests.conftest import RIG_DIR

    folder = RIG_DIR.parent / folder_name
    binary = folder / "node_modules" / ".bin" / name
    if not binary.exists():
        npm = shutil.which("npm")
        assert npm, f"npm is needed to install {package} for this test"
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", f"{package}@{version}"],
            cwd=folder,
            check=True,
            capture_output=True,
            timeout=900,
        )
    assert binary.exists(), f"{package}@{version} did not provide {binary}"
    return binary


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict[str, Any]


@dataclass
class Stub:
    """Answers like a server that says "ok" (SSE when asked to stream); records each request."""

    port: int
    requests: list[Recorded] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _sse_anthropic(model: str) -> bytes:
    events = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 1},
                },
            },
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


def _sse_openai(model: str) -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model}
    chunks = [
        base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]},
        base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        base | {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}},
    ]
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stub]:
    """The stub on a free port; OC_PREFIX_CACHE_PROXY_PORT points install at it."""
    record = Stub(port=0)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else {}
            record.requests.append(
                Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
            if self.path.startswith("/v1/messages"):
                data, kind = _sse_anthropic(str(body.get("model"))), "text/event-stream"
            elif self.path.startswith("/v1/chat/completions"):
                data, kind = _sse_openai(str(body.get("model"))), "text/event-stream"
            else:
                data, kind = b"{}", "application/json"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_HEAD = _answer  # noqa: N815 (http.server's names)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    record.port = int(server.server_address[1])
    monkeypatch.setenv("OC_PREFIX_CACHE_PROXY_PORT", str(record.port))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield record
    server.shutdown()
    server.server_close()


def run_harness(
    argv: list[str], *, home: Path, cwd: Path, extra_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The harness with a clean environment (as the capture notes ran them), in its own group."""
    env = {
        "HOME": str(home),
        "PATH": os.environ["PATH"],
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "USER": "dev",
        "SHELL": "/bin/bash",
        "PWD": str(cwd),
    } | extra_env
    return subprocess.run(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180, check=False
    )


def project(home: Path) -> Path:
    folder = home / "projA"
    folder.mkdir()
    (folder / "README.md").write_text("# project A\n")
    return folder


def test_claude_code_reads_the_env_ocpc_installed_over_the_shells(isolated_home: Path, stub: Stub) -> None:
    binary = npm_binary(*CLAUDE)
    config = isolated_home / ".claude" / "settings.json"
    config.parent.mkdir()
    original = '{\n  "env": {\n    "MY_VAR": "mine"\n  }\n}\n'
    config.write_text(original)
    claude_code.install(Settings.from_env(), config_path=config)
    # The shell's own ANTHROPIC_BASE_URL (nothing listens there) and billing switch lose to the settings' env.
    shell = {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{free_port()}", "CLAUDE_CODE_ATTRIBUTION_HEADER": "1"}
    done = run_harness([str(binary), "-p", "say ok"], home=isolated_home, cwd=project(isolated_home), extra_env=shell)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    assert [(r.method, r.path) for r in stub.requests] == [("POST", "/v1/messages?beta=true")]  # nothing else
    request = stub.requests[0]
    assert request.headers["authorization"] == "Bearer ocpc-local"
    assert request.headers["x-claude-code-session-id"]
    assert not request.body["system"][0]["text"].startswith("x-anthropic-billing-header")
    # no system entry inside messages (CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system,-per_turn_effort): the
    # environment comes as a reminder before the typed text, not as a system turn after it, and Claude Code's
    # default model gets no per-turn effort statement (an empty system entry) after it either
    messages = request.body["messages"]
    assert [m["role"] for m in messages] == ["user"], messages[1:]
    blocks = [b["text"] for b in messages[0]["content"]]
    assert blocks[0].startswith("<system-reminder>\n# Environment\n") and blocks[-1] == "say ok"
    assert "mid-conversation-tool-changes" not in request.headers.get("anthropic-beta", "")
    uninstall(Settings.from_env(), config_path=config, harness="claude-code")
    assert config.read_text() == original


def test_pi_uses_the_provider_ocpc_installed_with_affinity_headers(isolated_home: Path, stub: Stub) -> None:
    binary = npm_binary(*PI)
    config = isolated_home / ".pi" / "agent" / "models.json"
    pi.install(Settings.from_env(), config_path=config, provider_id="ocpc", model="qwen")
    quiet = {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}
    cwd = project(isolated_home)
    first = run_harness([str(binary), "-p", "say ok"], home=isolated_home, cwd=cwd, extra_env=quiet)
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr[-2000:]
    again = run_harness([str(binary), "-c", "-p", "say ok again"], home=isolated_home, cwd=cwd, extra_env=quiet)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [(r.method, r.path) for r in stub.requests] == [("POST", "/v1/chat/completions")] * 2
    sessions = set()
    for request in stub.requests:
        assert request.body["model"] == "qwen" and request.headers["authorization"] == "Bearer ocpc-local"
        assert request.headers["session_id"] == request.headers["x-session-affinity"]
        sessions.add(request.headers["x-session-affinity"])
    assert len(sessions) == 1  # `-c` continues the session: the same id, so the same slot
    assert len(stub.requests[1].body["messages"]) > len(stub.requests[0].body["messages"])
    uninstall(Settings.from_env(), config_path=config, harness="pi")
    assert not config.exists()
