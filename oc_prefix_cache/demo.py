"""``ocpc demo``: prove the claim on this machine in a couple of minutes.

Starts llama-server (the rig's CPU build and tiny hybrid model by default, or the user's
own), runs ocpc's daemon beside it, and sends a real OpenCode request (captured from
OpenCode 1.18.33: 11 tools, its real system prompt, ~7.5k tokens) the way the plugin
does: prepare, then the request itself. Four first requests of a new session:
cold (no ocpc), first run (warmed), another project on the same server, and after a
server restart (cold and after-restart: the median of three runs, each on a freshly
restarted server). State lives in a temp folder, so the demo touches nothing of yours.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from .daemon import Daemon
from .llama_process import LlamaServer, ServerConfig, free_port
from .settings import Settings

UA = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"
Step = Callable[[str], None]


def opencode_body(project: str) -> bytes:
    """A captured OpenCode request body (``A`` or ``B``: two projects, one head)."""
    return resources.files("oc_prefix_cache").joinpath(f"data/opencode_proj{project}.json").read_bytes()


@dataclass
class Row:
    case: str
    action: str
    prompt_n: int
    cache_n: int
    prepare_ms: float
    request_ms: float

    @property
    def total_ms(self) -> float:
        return self.prepare_ms + self.request_ms


@dataclass(frozen=True)
class ChatTiming:
    prompt_n: int  # prompt tokens the server processed
    cache_n: int  # prompt tokens it reused from the slot
    prompt_ms: float  # the server's own prefill time
    wall_ms: float  # what the caller waited, up to the first token


def timed_chat(http: httpx.Client, url: str, raw: bytes) -> ChatTiming:
    """Send a chat body as OpenCode would, up to its first token.

    One generated token makes the wall time the time to first token: what a user waits
    before the model "writes a word".
    """
    data = json.loads(raw)
    data.update(max_tokens=1, stream=False)
    data.pop("stream_options", None)
    started = time.perf_counter()
    response = http.post(f"{url}/v1/chat/completions", json=data, timeout=1800)
    response.raise_for_status()
    timings = response.json()["timings"]
    return ChatTiming(prompt_n=int(timings["prompt_n"]), cache_n=int(timings["cache_n"]),
                      prompt_ms=float(timings["prompt_ms"]), wall_ms=(time.perf_counter() - started) * 1000)


def prepare_over_http(http: httpx.Client, daemon_url: str, raw: bytes, session: str) -> dict[str, Any]:
    response = http.post(f"{daemon_url}/v1/prepare", content=raw, timeout=1800, headers={
        "User-Agent": UA, "x-session-id": session, "Content-Type": "application/json"})
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def run_demo(*, binary: Path, model: Path, step: Step, ctx_size: int = 16384) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="ocpc-demo-") as tmp:
        work = Path(tmp)
        settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(work / "home")})
        config = ServerConfig(binary=binary, model=model, port=free_port(), slot_dir=settings.slot_dir,
                              ctx_size=ctx_size)
        server = LlamaServer(config=config, log_path=work / "llama-server.log")
        step(f"starting llama-server with {model.name}")
        server.start(timeout=600)
        daemon = Daemon(settings=settings, server_url=server.url, port=0, server_binary=binary)
        daemon.start()
        try:
            with httpx.Client() as http:  # one client: no per-call connection set-up in the timings
                return _scenario(http, server, daemon, step)
        finally:
            daemon.stop()
            server.stop()


REPEATS = 3  # cold and after-restart runs, median taken: single timings on a busy machine vary


def _scenario(http: httpx.Client, server: LlamaServer, daemon: Daemon, step: Step) -> list[Row]:
    colds = []
    for i in range(REPEATS):
        step(f"1/4 cold: a new session's first request, no ocpc ({i + 1}/{REPEATS})")
        server.restart()  # a fresh server each time: nothing cached anywhere
        cold = timed_chat(http, server.url, opencode_body("A"))
        colds.append(Row("cold, no ocpc", "-", cold.prompt_n, cold.cache_n, 0.0, cold.wall_ms))
    rows = [_median(colds)]
    server.restart()
    step("2/4 first run (paid once)")
    rows.append(_prepared(http, server, daemon, "first run (paid once)", "A", "ses_1"))
    step("3/4 new session, same server")
    rows.append(_prepared(http, server, daemon, "new session, same server", "B", "ses_2"))
    restarted = []
    for i in range(REPEATS):
        step(f"4/4 new session after a server restart ({i + 1}/{REPEATS})")
        server.restart()
        restarted.append(_prepared(http, server, daemon, "new session after restart", "B", f"ses_3{i}"))
    rows.append(_median(restarted))
    return rows


def _prepared(http: httpx.Client, server: LlamaServer, daemon: Daemon, case: str, project: str,
              session: str) -> Row:
    """One first request the way the plugin sends it: prepare, then the request."""
    raw = opencode_body(project)
    started = time.perf_counter()
    answer = prepare_over_http(http, daemon.url, raw, session)
    prepare_ms = (time.perf_counter() - started) * 1000
    timing = timed_chat(http, server.url, raw)
    return Row(case, str(answer["action"]), timing.prompt_n, timing.cache_n, prepare_ms, timing.wall_ms)


def _median(rows: list[Row]) -> Row:
    return sorted(rows, key=lambda r: r.total_ms)[len(rows) // 2]


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    cold = rows[0].total_ms
    return [asdict(r) | {"total_ms": round(r.total_ms, 1), "speedup": round(cold / r.total_ms, 2)} for r in rows]


def render_demo(rows: list[dict[str, Any]], model_name: str, out: Console) -> None:
    table = Table(title=f"first request of a new OpenCode session ({model_name})")
    for name in ("case", "ocpc", "prompt tok", "from cache", "ms", "vs cold"):
        table.add_column(name, justify="left" if name in ("case", "ocpc") else "right")
    for row in rows:
        table.add_row(row["case"], row["action"], f"{row['prompt_n']:,}", f"{row['cache_n']:,}",
                      f"{row['total_ms']:,.0f}", f"{row['speedup']:.1f}x")
    out.print(table)
    cold, restart = rows[0], rows[-1]
    out.print(f"after a server restart: {cold['prompt_n'] / max(1, restart['prompt_n']):.0f}x fewer prompt tokens, "
              f"{restart['speedup']:.1f}x faster than cold")
