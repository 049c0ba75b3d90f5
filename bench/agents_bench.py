"""Many agents at once: K concurrent coding agents on N slots, plain llama-server vs ocpc.

An *agentic ramp*: K agent loops, each its own conversation started from a captured harness
first request (OpenCode in two projects, Claude Code, pi; a project of its own per agent),
growing by a tool result per turn (``--tool-lines``: 4 lines, ~150 tokens of code, keeps the
reference ramp's 1:19 proportion of tool result to code base on these ~2.6k-token first
requests; 12 lines, ~450 tokens, is a heavier tool use) with a short reply, then a tool gap
(3-10 s, seeded per agent, the same in both arms) in which the agent holds no request. Each
point runs ``--window`` seconds; turns in flight at its end are not counted.

Model: the real Gemma 3 270M (`--no-repack`): the tiny models crash b11434 as soon as two slots
process at once (docs/performance.md). Prefill ran ~550 tokens/s here on earlier days and
~90-145 on 2026-12-03, so re-prefilling a conversation costs 5-30 s and a turn's new tokens a
fraction of that (``--warmup`` keeps the first requests out of the window).

Arms, each on its own fresh llama-server per point, alternated point by point:
- ``plain``: llama-server at its defaults (`-np N --metrics --no-repack`);
- ``ocpc``: the server `ocpc launch` starts (`--swa-full`, checkpoints, `-ub 512`) with both
  of its front doors in-process on one Engine, as `ocpc launch` runs them: the daemon, which
  OpenCode's agents use as the plugin does (prepare, the request straight to the server, pinned
  to the slot prepared, then the report), and the proxy, which the other agents go through.
  ``--doors proxy`` sends OpenCode through the proxy too. Its ocpc home is kept across the points
  of one N (heads are saved once per configuration: that is the product).
- ``oracle`` (``--arms plain,ocpc,oracle``): llama-server at its defaults with a RAM cache
  that never runs out (``--cache-ram`` ~1 TB; ``-1`` would still cap it at the context's
  tokens): what the server alone does when memory is unbounded. Not an ideal prefix cache: the
  server swaps from RAM only into a slot keeping under half of what it holds (K = 16 on N = 2:
  38 turns, cache 71%, against plain's 39 and 61%);
- ``flags``: ocpc's server flags without ocpc (what the flags alone do);
- a ``--variant NAME:KEY=VALUE,...``: ocpc with other settings (its ratios are against ocpc's),
  e.g. ``noahead:OC_PREFIX_CACHE_PARK_AHEAD_S=off`` for what parking ahead costs or saves.
The other arms get a ``--cache-ram`` that holds ~80k tokens of *their own* KV (a 27B's default
8 GiB at ~100 KB per token), measured from a slot save of the first head, so the server's
RAM cache runs out where it would for a real user.

Per point and arm: turns served, mean and p95 turn time, TTFT p50/p95, the plugin path's hop
(its prepare's and report's round trips to the daemon, part of the turn; under pressure the
prepare's includes its wait for a slot, which plain's requests spend in the server's queue),
the share of prompt tokens served from cache (1 - the server's own
`llamacpp:prompt_tokens_total` / the prompt tokens of the answered requests: ocpc's warms and
probes count against it), parks written and restored, requests failed (must be 0). The JSON
also has each turn (agent, seconds, TTFT, tokens processed, hop), so a slow tail can be traced
to an agent.

``--rounds R`` runs each point R times per arm in the order A B B A ... and adds them up: below
pressure the arms differ by less than the machine's own drift over one run (a single agent's
turn went 1,022 -> 1,085 ms between two windows of the same arm 15 minutes apart), which one
window per arm would book to whichever came later.

    .venv/bin/python bench/agents_bench.py --slots 2 --agents 1,2,4,8,16 --window 240
    .venv/bin/python bench/agents_bench.py --slots 2 --agents 1,2 --window 90 --rounds 4 --warmup
    .venv/bin/python bench/agents_bench.py --smoke          # CI: K=4 on N=2, 30 s per arm, short heads
    .venv/bin/python bench/agents_bench.py --slots 2 --window 180 --warmup \
        --json bench/results/ramp-np2-NAME.json --png bench/results/ramp-np2-NAME.png   # a kept run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.launch import family_flags
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.doors.proxy import Proxy
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.doors.relay import learn
from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.llama.server_info import model_family, stat_fields
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.settings import Settings
from tests import workload  # noqa: E402

DATA = ROOT / "tests" / "data"
ORACLE_RAM_MIB = 1_000_000  # the oracle arm's --cache-ram: never reached (the cap is in MiB and tokens)
RAM_TOKENS = 80_000  # what a 27B's default --cache-ram 8192 holds at ~100 KB per token
CTX_PER_SLOT = 32_768  # Gemma 3 270M's trained context
LAUNCH = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512")
REPLY_TOKENS = 24
#: Lines of code per tool result (~36 tokens a line): 4 keeps the reference ramp's proportion (a
#: ~1.6k-token tool result on a ~30k-token code base, 1:19) on these ~2.6k-token first requests.
TOOL_LINES = 4
#: ``--smoke`` (and the CI-sized tests) cut the middle out of every longer system text: its first
#: 2,000 characters stay (the stable head, still past Gemma's 512-token sliding window) and its
#: last 1,500 (where the harnesses put what varies: OpenCode's <env>, pi's date and directory), so
#: each harness's head rule still finds its head. On Gemma the four harnesses' first requests
#: go from 2,303 / 4,070 / 2,303 / 648 tokens to 883 / 1,992 / 883 / 648. The smoke proves the
#: ramp runs; its prefill (~100 tokens/s here) is most of what it spends. Both arms measure
#: more KV bytes per token on the shorter request (11,992 against 6,506: part of a slot file does
#: not grow with the prompt), so their RAM caches are larger; at K = 4 neither runs out.
SHORT_SYSTEM_CHARS = (2000, 1500)
#: The arms of their own; any other arm is a ``--variant`` of ocpc.
ARMS = ("plain", "ocpc", "flags", "oracle")


# -- the agents -------------------------------------------------------------------------------------


def _capture(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    data = json.loads(path.read_text())
    pairs = data["headers"].items() if isinstance(data["headers"], dict) else data["headers"]
    skip = {"content-length", "host", "authorization", "connection", "accept-encoding"}
    return {str(k).lower(): str(v) for k, v in pairs if str(k).lower() not in skip}, data["body_json"]


@dataclass
class Agent:
    """One agent: its conversation, grown by one tool round per turn."""

    name: str
    path: str  # /v1/chat/completions or /v1/messages
    headers: dict[str, str]
    body: dict[str, Any]
    seed: int
    lines: int = TOOL_LINES  # of each tool result
    turns: int = 0
    via: str = "proxy"  # "plugin": prepared through the daemon, sent to the server itself (OpenCode)

    def next_body(self) -> dict[str, Any]:
        if self.turns:
            n, result = self.turns, workload.tool_result(self.turns, lines=self.lines)
            call = f"call_{self.name}_{n}"
            if self.path == "/v1/messages":
                tool = self.body["tools"][0]["name"]
                self.body["messages"] += [
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": call, "name": tool, "input": {"file_path": f"src/module_{n}.py"}}
                        ],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": result}]},
                ]
            else:
                self.body["messages"] += [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": call,
                                "type": "function",
                                "function": {
                                    "name": "read",
                                    "arguments": json.dumps({"filePath": f"src/module_{n}.py"}),
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": call, "content": result},
                ]
        self.turns += 1
        return copy.deepcopy(self.body)


def make_agents(k: int, *, plugin: bool = False, lines: int = TOOL_LINES, short: bool = False) -> list[Agent]:
    """K agents, cycling through the harnesses; each its own project and session. ``plugin``:
    OpenCode's agents take the plugin's path (the daemon), the others the proxy. ``short``: the
    middles of their system texts cut out (``SHORT_SYSTEM_CHARS``: a smoke-sized first request)."""
    agents = []
    for i in range(k):
        kind = ("opencode-A", "claude-code", "opencode-B", "pi")[i % 4]
        project = f"/home/dev/agent{i}"
        if kind.startswith("opencode"):
            conv = workload.parent(f"ses_agent{i}") if kind == "opencode-A" else workload.other_project(f"ses_agent{i}")
            system = conv.body["messages"][0]["content"]
            conv.body["messages"][0]["content"] = re.sub(r"/home/dev/proj[AB]", project, system)
            agents.append(
                Agent(
                    f"{kind}-{i}",
                    "/v1/chat/completions",
                    conv.headers(),
                    conv.body,
                    seed=i,
                    via="plugin" if plugin else "proxy",
                )
            )
        elif kind == "claude-code":
            headers, body = _capture(DATA / "claude-code-2.1.332" / "A1.json")
            headers["x-claude-code-session-id"] = f"agent-{i}"
            body = json.loads(json.dumps(body).replace("/home/dev", project))
            body["metadata"] = {"user_id": f"user_bench_account__session_agent-{i}"}
            agents.append(Agent(f"{kind}-{i}", "/v1/messages", headers, body, seed=i))
        else:
            headers, body = _capture(DATA / "pi-0.73.1" / "A1.json")
            body["messages"][-1] = {"role": "user", "content": f"agent {i}: fix the failing test in {project}"}
            agents.append(Agent(f"{kind}-{i}", "/v1/chat/completions", headers, body, seed=i))
    for agent in agents:
        agent.lines = lines
        agent.body["stream"] = True
        agent.body.pop("max_completion_tokens", None)
        agent.body["max_tokens"] = REPLY_TOKENS
        for key in ("thinking", "context_management", "output_config"):
            agent.body.pop(key, None)
        if short:
            workload.shorten_system(agent.body, SHORT_SYSTEM_CHARS)
    return agents


@dataclass
class Turn:
    agent: str
    started: float
    ended: float
    ttft: float
    prompt: int  # the request's prompt tokens (reused + processed)
    processed: int
    status: int
    hop: float | None = None  # the plugin's path: its prepare's and report's round trips to the daemon (s)


@dataclass
class Point:
    arm: str
    k: int
    n: int
    turns: list[Turn] = field(default_factory=list)
    late: list[Turn] = field(default_factory=list)  # turns that ended after the window (not counted)
    failed: list[str] = field(default_factory=list)
    processed_total: float = 0.0  # the server's own counter over the point
    server: dict[str, float] = field(default_factory=dict)  # its /metrics counters over the point
    ocpc: dict[str, int] = field(default_factory=dict)
    restart_errors: int = 0  # the server's own errors while a fault restarted it
    server_cores: float | None = None  # the server's CPU time over the window / its length (not under a fault)
    fault: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def merged(cls, points: list[Point]) -> Point:
        """One arm's rounds of one point (``--rounds``) as one: turns and counters added up, the
        server's cores averaged over the rounds that measured them."""
        first = points[0]
        out = cls(first.arm, first.k, first.n)
        for point in points:
            out.turns += point.turns
            out.late += point.late
            out.failed += point.failed
            out.processed_total += point.processed_total
            out.restart_errors += point.restart_errors
            for key, value in point.server.items():
                out.server[key] = out.server.get(key, 0.0) + value
            for key, count in point.ocpc.items():
                out.ocpc[key] = out.ocpc.get(key, 0) + count
        cores = [p.server_cores for p in points if p.server_cores is not None]
        out.server_cores = statistics.fmean(cores) if cores else None
        out.fault = first.fault if len(points) == 1 else {}
        return out

    def row(self, window: float) -> dict[str, Any]:
        times = sorted(t.ended - t.started for t in self.turns)
        ttfts = sorted(t.ttft for t in self.turns)
        hops = [t.hop for t in self.turns if t.hop is not None]
        prompt = sum(t.prompt for t in self.turns)
        return {
            "arm": self.arm,
            "k": self.k,
            "n": self.n,
            "turns": len(self.turns),
            "turns_per_min": len(self.turns) * 60 / window,
            "turn_mean_s": statistics.fmean(times) if times else None,
            "turn_p95_s": _pct(times, 0.95),
            "ttft_p50_s": _pct(ttfts, 0.5),
            "ttft_p95_s": _pct(ttfts, 0.95),
            "plugin_hop_ms": 1000 * statistics.fmean(hops) if hops else None,
            "cache_share": 1 - self.processed_total / prompt if prompt else None,
            "prompt_tokens": prompt,
            "processed_tokens": self.processed_total,
            "prefill_s": self.server.get("prompt_seconds_total"),
            "decode_s": self.server.get("tokens_predicted_seconds_total"),
            "decoded_tokens": self.server.get("tokens_predicted_total"),
            "server_cores": self.server_cores,
            "parks": self.ocpc.get("parked", 0) + self.ocpc.get("parked_ahead", 0),
            "park_restores": self.ocpc.get("source:park", 0),
            "failed": len(self.failed),
            "failures": self.failed[:5],
            "ocpc_counters": {k: v for k, v in sorted(self.ocpc.items()) if k.startswith(_SHOWN)},
            "restart_errors": self.restart_errors,
            "fault": self.fault,
            "each_turn": [
                {
                    "agent": t.agent,
                    "s": round(t.ended - t.started, 4),
                    "ttft_s": round(t.ttft, 4),
                    "processed": t.processed,
                    "hop_ms": None if t.hop is None else round(1000 * t.hop, 1),
                }
                for t in sorted(self.turns, key=lambda t: t.started)
            ],
        }


_SHOWN = (
    "source:",
    "report_",
    "parked",
    "park_",
    "ram_",
    "waited",
    "restored",
    "warmed",
    "skipped",
    "failed",
    "proxy:fail_open",
    "proxy:prepare:",
    "proxy:client",
)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


_NUMBERS = {
    "/v1/chat/completions": (rb'"cache_n":(\d+)', rb'"prompt_n":(\d+)'),
    "/v1/messages": (rb'"cache_read_input_tokens":(\d+)', rb'"input_tokens":(\d+)'),
}


@dataclass(frozen=True)
class Doors:
    """Where an arm's agents send their requests."""

    proxy: str  # the proxy (plain arm: the server itself)
    server: str
    daemon: str = ""  # the plugin's daemon ("": none, every agent goes to ``proxy``)


def one_turn(http: httpx.Client, doors: Doors, agent: Agent) -> Turn:
    raw = json.dumps(agent.next_body()).encode()
    started = time.monotonic()
    if agent.via == "plugin" and doors.daemon:
        return _plugin_turn(http, doors, agent, raw, started)
    status, tail, ttft = _stream(http, doors.proxy + agent.path, raw, agent.headers, started)
    cached_re, processed_re = _NUMBERS[agent.path]
    cached, processed = re.findall(cached_re, tail), re.findall(processed_re, tail)
    if not cached or not processed:
        raise RuntimeError(f"no reuse numbers in the answer: {tail[-300:]!r}")
    c, p = int(cached[-1]), int(processed[-1])
    return Turn(agent.name, started, time.monotonic(), ttft, c + p, p, status)


def _plugin_turn(http: httpx.Client, doors: Doors, agent: Agent, raw: bytes, started: float) -> Turn:
    """What ocpc-plugin.js does for one OpenCode request: prepare (the daemon answers when the
    slot is ready), the request to the server pinned to the slot prepared, then the report."""
    headers = {**agent.headers, "content-type": "application/json", "x-ocpc-budget-ms": "240000", "x-ocpc-pin": "1"}
    answer = http.post(doors.daemon + "/v1/prepare", content=raw, headers=headers).json()
    hop = time.monotonic() - started
    body = raw
    if answer.get("pin") and isinstance(answer.get("slot"), int):
        body = b'{"id_slot":%d,' % answer["slot"] + raw[1:]
    status, tail, ttft = _stream(http, doors.server + agent.path, body, agent.headers, started)
    learned = learn(tail)
    if learned is None or learned.prompt_n is None:
        raise RuntimeError(f"no timings in the answer: {tail[-300:]!r}")
    if answer.get("fingerprint"):
        reporting = time.monotonic()
        http.post(
            doors.daemon + "/v1/report",
            json={
                "fingerprint": answer["fingerprint"],
                "prepare_id": answer.get("prepare_id") or "",
                "cache_n": learned.cache_n,
                "prompt_n": learned.prompt_n,
                "predicted_n": learned.predicted_n or 0,
            },
        )
        hop += time.monotonic() - reporting
    prompt = (learned.cache_n or 0) + learned.prompt_n
    return Turn(agent.name, started, time.monotonic(), ttft, prompt, learned.prompt_n, status, hop)


def _stream(
    http: httpx.Client, url: str, raw: bytes, headers: dict[str, str], started: float
) -> tuple[int, bytes, float]:
    status, tail, ttft, _ = stream_answer(http, url, raw, headers, started)
    return status, tail, ttft


def stream_answer(
    http: httpx.Client, url: str, raw: bytes, headers: dict[str, str], started: float
) -> tuple[int, bytes, float, httpx.Headers]:
    """POST ``raw`` and read the answer as it streams: its status, last 8 KB, time to its first
    byte, and its headers (boxes_bench.py reads which box answered from them)."""
    ttft = 0.0
    tail = b""
    with http.stream("POST", url, content=raw, headers={**headers, "content-type": "application/json"}) as response:
        for chunk in response.iter_raw():
            if not ttft:
                ttft = time.monotonic() - started
            tail = (tail + chunk)[-8192:]
        status = response.status_code
        answered = response.headers
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {tail[:200]!r}")
    return status, tail, ttft, answered


def drive(
    doors: Doors,
    agents: list[Agent],
    *,
    window: float,
    point: Point,
    fault: Any = None,
    warmup: bool = False,
    on_start: Callable[[], None] | None = None,
    together: threading.Barrier | None = None,
    take_turn: Callable[[httpx.Client, Doors, Agent], Turn] | None = None,
) -> None:
    """Every agent in its own thread until the window ends; turns ending later are not counted.

    ``warmup``: each agent's first request (its session's start) is answered before the window
    opens, all at once, and not counted: the window measures the turns of sessions under way.
    On a slow machine (this one prefills Gemma at ~120 tokens/s on some days, ~550 on others) a
    window would otherwise hold mostly first requests, which no cache can shorten by much.
    ``on_start``: called when the window opens (the counters' baseline). ``together``: drives
    run side by side (two ocpc processes on one server) open their windows at once, after every
    first request of every drive: otherwise one drive's window can pass while the other's first
    requests still fill the server. ``take_turn``: what one turn is (default ``one_turn``;
    boxes_bench.py's also records which box served it)."""
    guard = threading.Lock()
    take = take_turn or one_turn
    if warmup:

        def first(agent: Agent) -> None:
            try:
                with loopback.client(timeout=httpx.Timeout(1800, connect=10)) as http:
                    take(http, doors, agent)
            except Exception as exc:  # noqa: BLE001 (a bench records every failure)
                with guard:
                    point.failed.append(f"{agent.name} (first request): {type(exc).__name__}: {exc}"[:300])

        starts = [threading.Thread(target=first, args=(a,), daemon=True) for a in agents]
        for thread in starts:
            thread.start()
        for thread in starts:
            thread.join(3600)
    if together is not None:
        together.wait(3600)
    if on_start is not None:
        on_start()
    end = time.monotonic() + window

    def loop(agent: Agent) -> None:
        rng = random.Random(agent.seed)
        time.sleep(rng.uniform(3, 10) if warmup else rng.uniform(0, 2))  # agents do not start in lockstep
        with loopback.client(timeout=httpx.Timeout(600, connect=10)) as http:
            while time.monotonic() < end:
                try:
                    turn = take(http, doors, agent)
                except Exception as exc:  # noqa: BLE001 (a bench records every failure)
                    restarting = (
                        fault is not None
                        and fault.thread.is_alive()
                        or (fault is not None and time.monotonic() - fault.down[1] < 2)
                    )
                    if restarting:  # the server's own error while it restarts: the agent retries
                        with guard:
                            point.restart_errors += 1
                        time.sleep(1)
                        continue
                    if time.monotonic() < end:
                        with guard:
                            point.failed.append(f"{agent.name}: {type(exc).__name__}: {exc}"[:300])
                    return
                with guard:
                    (point.turns if turn.ended <= end else point.late).append(turn)
                time.sleep(rng.uniform(3, 10))  # the tool runs; the agent holds no request

    threads = [threading.Thread(target=loop, args=(a,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()) + 120)  # a turn in flight: up to 2 min more


# -- the servers ------------------------------------------------------------------------------------


_COUNTERS = ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total", "tokens_predicted_seconds_total")


def server_counters(url: str) -> Counter[str]:
    """The server's own work so far (`/metrics`): prompt tokens processed, and the seconds its
    slots spent prefilling and decoding (per slot: two slots in one batch both count it)."""
    text = loopback.get(f"{url}/metrics", timeout=10).text
    out: Counter[str] = Counter()
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("llamacpp:") in _COUNTERS:
            out[name.removeprefix("llamacpp:")] = float(value)  # type: ignore[assignment]
    return out


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time so far (user + system, ``/proc``): how busy the server kept the
    machine's cores, which says whether a slot that waits is compute lost (None off Linux)."""
    fields = stat_fields(pid) if pid is not None else None
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields is not None else None
    except (ValueError, IndexError):  # fields 14 and 15: utime, stime
        return None


def start(
    binary: Path, model: Path, home: Path, *, n: int, args: tuple[str, ...], host: str = "127.0.0.1"
) -> LlamaServer:
    config = ServerConfig(
        binary=binary,
        model=model,
        port=free_port(host),
        host=host,
        slot_dir=home / "slots",
        ctx_size=CTX_PER_SLOT * n,
        parallel=n,
        extra_args=args,
    )
    (home / "slots").mkdir(parents=True, exist_ok=True)
    server = LlamaServer(config=config, log_path=home / f"llama-server-{config.port}.log")
    server.start()
    return server


def bytes_per_token(binary: Path, model: Path, home: Path, args: tuple[str, ...], *, short: bool = False) -> float:
    """The KV bytes per token of one arm's server, from a slot save of a real first request
    (``short``: the smoke's, its system text cut as the agents' are)."""
    server = start(binary, model, home, n=1, args=args)
    try:
        body = {**workload.parent().body, "max_tokens": 1, "stream": False}
        if short:
            workload.shorten_system(body, SHORT_SYSTEM_CHARS)
        answer = loopback.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).json()
        tokens = int(answer["timings"]["prompt_n"])
        loopback.post(f"{server.url}/slots/0?action=save", json={"filename": "measure.bin"}, timeout=120)
        size = (home / "slots" / "measure.bin").stat().st_size
        (home / "slots" / "measure.bin").unlink()
        return size / tokens
    finally:
        server.stop()


class Fault:
    """In the middle of the window: a server restart, ``graceful`` (as `ocpc launch` stops it:
    the live conversations parked first, then SIGTERM) or ``kill9`` (no warning); or ``doors``:
    ocpc's daemon and proxy gone and back (as after `kill -9` of ocpc) while llama-server runs
    on (the plain arm has none: nothing happens there). The errors while something is down are
    counted apart (``restart_errors``), never as failures."""

    def __init__(self, kind: str, server: LlamaServer, launched: Launched | None, *, at: float) -> None:
        self.kind, self.server, self.launched, self.at = kind, server, launched, at
        self.before: Counter[str] = Counter()  # the server's counters when it went down
        self.down: tuple[float, float] = (0.0, 0.0)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        time.sleep(self.at)
        self.before = server_counters(self.server.url)
        began = time.monotonic()
        if self.kind == "doors":
            if self.launched is not None:
                self.launched.restart()
            self.down = (began, time.monotonic())
            return
        if self.kind == "graceful":
            if self.launched is not None:
                from oc_prefix_cache.deadline import Deadline

                self.launched.engine.park_live(deadline=Deadline.after(10))
            self.server.stop()
        else:
            proc = self.server._proc
            if proc is not None and proc.proc is not None:
                os.killpg(proc.proc.pid, 9)
                proc.proc.wait(10)
            self.server._proc = None
        self.server.start()
        self.down = (began, time.monotonic())


class Launched:
    """Both front doors of `ocpc launch` in-process on one Engine: the daemon (OpenCode's
    plugin path, with the between-requests watch) and the proxy beside it. ``restart``: both
    stop and come back on the same ports with nothing in memory, as after `kill -9` of the ocpc
    process while llama-server runs on."""

    def __init__(self, upstream: str, home: Path, env: dict[str, str] | None = None) -> None:
        self.upstream, self.home = upstream, home
        self.settings = Settings.from_env(
            {**(env or {}), "OC_PREFIX_CACHE_HOME": str(home), "OC_PREFIX_CACHE_BASE_URL": upstream}
        )
        self.daemon_port, self.proxy_port = free_port(), free_port()
        self.daemon: Daemon | None = None
        self.proxy: ProxyServer | None = None
        self.counters: Counter[str] = Counter()  # of the doors stopped by a restart

    def __enter__(self) -> Launched:
        self.daemon = Daemon(settings=self.settings, server_url=self.upstream, port=self.daemon_port)
        self.daemon.start()
        self.proxy = ProxyServer(Proxy(settings=self.settings, engine=self.daemon.engine), port=self.proxy_port)
        self.proxy.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.counters.update(self.snapshot())
        if self.proxy is not None:
            self.proxy.stop()
        if self.daemon is not None:
            self.daemon.stop()

    def restart(self) -> None:
        self.__exit__()
        self.__enter__()

    @property
    def engine(self) -> Any:
        assert self.daemon is not None
        return self.daemon.engine

    @property
    def doors(self) -> Doors:
        return Doors(
            proxy=f"http://127.0.0.1:{self.proxy_port}",
            server=self.upstream,
            daemon=f"http://127.0.0.1:{self.daemon_port}",
        )

    def snapshot(self) -> Counter[str]:
        if self.daemon is None or self.proxy is None:
            return Counter()
        out = Counter({key: int(v) for key, v in self.engine.status()["counters"].items()})
        proxy = self.proxy.proxy
        assert isinstance(proxy, Proxy)  # not a router's
        out.update({f"proxy:{key}": v for key, v in proxy.counters.snapshot().items()})
        return out


def run_point(
    arm: str,
    k: int,
    n: int,
    *,
    binary: Path,
    model: Path,
    home: Path,
    args: tuple[str, ...],
    window: float,
    fault: str = "",
    doors: str = "both",
    lines: int = TOOL_LINES,
    warmup: bool = False,
    short: bool = False,
    ocpc_env: dict[str, str] | None = None,
) -> Point:
    """One arm at one point on a fresh server. ``ocpc_env``: the arm is ocpc with these settings
    (a ``--variant``); the arm named ``ocpc`` runs with the defaults."""
    point = Point(arm, k, n)
    server = start(binary, model, home, n=n, args=args)
    broke: Fault | None = None
    baseline: dict[str, Counter[str]] = {"server": Counter(), "counters": Counter()}
    cpu: list[tuple[float, float | None]] = []  # (when, the server's CPU seconds) as the window opens

    def opened(launched: Launched | None) -> None:  # the window opens: counters from here, the fault in its middle
        baseline["server"] = server_counters(server.url)
        cpu.append((time.monotonic(), cpu_seconds(server.pid)))
        if launched is not None:
            baseline["counters"] = launched.counters + launched.snapshot()
        if broke:
            broke.thread.start()

    try:
        if arm == "ocpc" or ocpc_env is not None:
            with Launched(server.url, home, ocpc_env) as launched:  # its slot folder is the server's
                broke = Fault(fault, server, launched, at=window / 2) if fault else None
                drive(
                    launched.doors,
                    make_agents(k, plugin=doors == "both", lines=lines, short=short),
                    window=window,
                    point=point,
                    fault=broke,
                    warmup=warmup,
                    on_start=lambda: opened(launched),
                )
                point.ocpc = dict(launched.counters + launched.snapshot() - baseline["counters"])
        else:
            broke = Fault(fault, server, None, at=window / 2) if fault else None
            drive(
                Doors(proxy=server.url, server=server.url),
                make_agents(k, lines=lines, short=short),
                window=window,
                point=point,
                fault=broke,
                warmup=warmup,
                on_start=lambda: opened(None),
            )
        done = server_counters(server.url)
        used = cpu_seconds(server.pid)
        if cpu and cpu[0][1] is not None and used is not None and not broke:
            point.server_cores = (used - cpu[0][1]) / (time.monotonic() - cpu[0][0])
        done.update(broke.before if broke else Counter())
        point.server = {key: done[key] - baseline["server"][key] for key in _COUNTERS}
        point.processed_total = point.server["prompt_tokens_total"]
        if broke:
            after = [t for t in point.turns if t.started >= broke.down[1]]
            point.fault = {
                "kind": fault,
                "down_s": broke.down[1] - broke.down[0],
                "turns_after": len(after),
                "processed_after": sum(t.processed for t in after),
                "cache_after": _share(after),
                "first_after": _first_turns(after),
            }
    finally:
        server.stop()
    return point


def _first_turns(after: list[Turn]) -> dict[str, Any]:
    """Each agent's first turn after the fault: what it re-processed (tokens, share of its prompt)."""
    first: dict[str, Turn] = {}
    for turn in sorted(after, key=lambda t: t.started):
        first.setdefault(turn.agent, turn)
    processed = sum(t.processed for t in first.values())
    prompt = sum(t.prompt for t in first.values())
    return {
        "agents": len(first),
        "processed": processed,
        "prompt": prompt,
        "cache_share": 1 - processed / prompt if prompt else None,
    }


def _share(turns: list[Turn]) -> float | None:
    prompt = sum(t.prompt for t in turns)
    return 1 - sum(t.processed for t in turns) / prompt if prompt else None


# -- output -----------------------------------------------------------------------------------------


def _variant(text: str) -> tuple[str, dict[str, str]]:
    """``--variant NAME:KEY=VALUE,...`` as (NAME, its settings); a bad one stops the bench at once."""
    name, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
    if not name or name in ARMS or not env:
        raise SystemExit(f"--variant {text!r}: give NAME:KEY=VALUE[,KEY=VALUE], NAME not an arm of its own")
    try:
        Settings.from_env(env)  # a setting ocpc would refuse is refused here, before any server starts
    except ConfigError as exc:
        raise SystemExit(f"--variant {text!r}: {exc}") from None
    return name, env


def _print_fault(point: Point) -> None:
    if point.fault:
        print(
            f"  fault {point.fault['kind']}: down {point.fault['down_s']:.1f} s, "
            f"{point.restart_errors} requests refused while down; after it: "
            f"{point.fault['turns_after']} turns, {point.fault['processed_after']:,} tokens "
            f"processed, cache share {point.fault['cache_after'] or 0:.0%}"
        )
    if point.failed:
        print("  failures:", *point.failed[:5], sep="\n    ")


def render(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'N':>2} {'K':>3} {'arm':<6} {'turns':>5} {'mean s':>7} {'p95 s':>7} {'ttft50':>7} {'ttft95':>7} "
        f"{'cache':>6} {'parks':>5} {'p.rest':>6} {'failed':>6} {'prefill s':>9} {'decode s':>8} {'cores':>5} "
        f"{'hop ms':>6}"
    )
    for r in rows:

        def f(key: str, fmt: str = "7.1f", r: dict[str, Any] = r) -> str:
            return format(r[key], fmt) if r[key] is not None else "-".rjust(int(fmt.split(".")[0]))

        print(
            f"{r['n']:>2} {r['k']:>3} {r['arm']:<6} {r['turns']:>5} {f('turn_mean_s', '7.3f')} {f('turn_p95_s')} "
            f"{f('ttft_p50_s')} {f('ttft_p95_s')} {f('cache_share', '6.2f')} {r['parks']:>5} "
            f"{r['park_restores']:>6} {r['failed']:>6} {f('prefill_s', '9.0f')} {f('decode_s', '8.0f')} "
            f"{f('server_cores', '5.2f')} {f('plugin_hop_ms', '6.1f')}"
        )


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for plain in (r for r in rows if r["arm"] == "plain"):
        ocpc = next((r for r in rows if r["arm"] == "ocpc" and r["k"] == plain["k"] and r["n"] == plain["n"]), None)
        if ocpc and plain["turns"] and plain["turn_mean_s"] and ocpc["turn_mean_s"]:
            ratio = {
                "n": plain["n"],
                "k": plain["k"],
                "turns_x": ocpc["turns"] / plain["turns"],
                "turn_time_x": ocpc["turn_mean_s"] / plain["turn_mean_s"],
                "plain_cache": plain["cache_share"],
                "ocpc_cache": ocpc["cache_share"],
            }
            oracle = next(
                (r for r in rows if r["arm"] == "oracle" and r["k"] == plain["k"] and r["n"] == plain["n"]), None
            )
            if oracle and oracle["turns"]:
                ratio |= {"of_oracle_turns": ocpc["turns"] / oracle["turns"], "oracle_cache": oracle["cache_share"]}
            out.append(ratio)
    for variant in (r for r in rows if r["arm"] not in ARMS):
        ocpc = next((r for r in rows if r["arm"] == "ocpc" and r["k"] == variant["k"] and r["n"] == variant["n"]), None)
        if ocpc and ocpc["turns"] and ocpc["turn_mean_s"] and variant["turn_mean_s"]:
            out.append(
                {
                    "n": variant["n"],
                    "k": variant["k"],
                    "arm": variant["arm"],
                    "turns_x_ocpc": variant["turns"] / ocpc["turns"],
                    "turn_time_x_ocpc": variant["turn_mean_s"] / ocpc["turn_mean_s"],
                    "cache": variant["cache_share"],
                    "ocpc_cache": ocpc["cache_share"],
                }
            )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(2, len(slots), figsize=(4.5 * len(slots), 7), squeeze=False)
    styles = {"plain": "o--", "flags": "^:", "oracle": "d-.", "ocpc": "s-"}  # a --variant: "x-"
    variants = sorted({r["arm"] for r in rows} - set(styles))
    for col, n in enumerate(slots):
        for arm, style in (*styles.items(), *((v, "x-") for v in variants)):
            mine = sorted((r for r in rows if r["n"] == n and r["arm"] == arm), key=lambda r: r["k"])
            if not mine:
                continue
            ks = [r["k"] for r in mine]
            axes[0][col].plot(ks, [r["turn_mean_s"] or 0 for r in mine], style, label=arm)
            axes[1][col].plot(ks, [100 * (r["cache_share"] or 0) for r in mine], style, label=arm)
        axes[0][col].set_title(f"-np {n}: mean turn time (s)")
        axes[1][col].set_title(f"-np {n}: prompt tokens from cache (%)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent agents K")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def keep_log(path: Path) -> None:
    """With ``--keep``: every prepare's answer and reason, and every other ocpc line at INFO, into
    ``path`` (which restore came from where, and why, is otherwise lost with the run); warnings
    still print to the console as before."""
    ocpc = logging.getLogger("ocpc")
    ocpc.setLevel(logging.INFO)
    into_file = logging.FileHandler(path)
    into_file.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    ocpc.addHandler(into_file)
    ocpc.addHandler(console)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI: K=4 on N=2, 30 s per arm after the agents' first requests (--warmup), "
        "the middle of long system texts cut out",
    )
    parser.add_argument("--slots", default="1,2,4", help="server slot counts N")
    parser.add_argument("--agents", default="1,2,4,8,16", help="concurrent agents K")
    parser.add_argument("--window", type=float, default=240.0, help="seconds per point and arm")
    parser.add_argument(
        "--fault",
        choices=("graceful", "kill9", "doors"),
        default="",
        help="in the middle of each window: restart the server, or ocpc's front doors",
    )
    parser.add_argument(
        "--doors",
        choices=("both", "proxy"),
        default="both",
        help="ocpc arm: OpenCode through the daemon (the plugin's path) or the proxy",
    )
    parser.add_argument(
        "--tool-lines",
        type=int,
        default=TOOL_LINES,
        help="lines of code per tool result, ~36 tokens each (12: a heavier tool use)",
    )
    parser.add_argument(
        "--arms",
        default="plain,ocpc",
        help="plain (llama-server's defaults), ocpc, flags (ocpc's server flags, no ocpc), "
        "oracle (plain with an unbounded RAM cache)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="an arm NAME (give it in --arms): ocpc with these settings, e.g. "
        "noahead:OC_PREFIX_CACHE_PARK_AHEAD_S=off; its ratios are against ocpc's",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each point this many times per arm, the arms' order reversed every round "
        "(A B B A ...), and add the rounds up: a drift of the machine's speed over the run "
        "(6%% within 20 minutes here) then falls on every arm alike",
    )
    parser.add_argument(
        "--warmup", action="store_true", help="answer each agent's first request before the window opens (not counted)"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="work here and keep it (each server's log, ocpc's state, ocpc.log: every prepare's answer and reason)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    slots = [2] if args.smoke else [int(x) for x in args.slots.split(",")]
    ks = [4] if args.smoke else [int(x) for x in args.agents.split(",")]
    window = 30.0 if args.smoke else args.window
    warmup = args.warmup or args.smoke  # without it 30 s hold only first requests: no turn to show
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    model = ensure_real_model(rig, settings, "gemma3")
    needs = REAL_MODELS["gemma3"].server_args
    own = tuple(arg for flag in family_flags(model_family(str(model))) for arg in flag.args())
    rows: list[dict[str, Any]] = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        keep_log(args.keep / "ocpc.log")
    with (
        contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="ocpc-agents-")
    ) as work:
        base = {"plain": (*needs, "--metrics"), "ocpc": (*needs, "--metrics", *LAUNCH, *own)}
        base["flags"] = base["ocpc"]  # ocpc's server flags without ocpc: what the flags alone do
        base["oracle"] = base["plain"]  # and a RAM cache without limit (ORACLE_RAM_MIB)
        variants = dict(_variant(text) for text in args.variant)
        base |= {name: base["ocpc"] for name in variants}  # ocpc, on its server, with other settings
        chosen = tuple(a for a in args.arms.split(",") if a in base) or ("plain", "ocpc")
        base = {arm: base[arm] for arm in chosen}
        ram = {}
        for arm, flags in base.items():
            if arm == "oracle":
                ram[arm] = ORACLE_RAM_MIB
                continue
            per_token = bytes_per_token(rig.server, model, Path(work) / f"measure-{arm}", flags, short=args.smoke)
            ram[arm] = max(64, round(RAM_TOKENS * per_token / 2**20))
            print(f"{arm}: {per_token:,.0f} KV bytes per token -> --cache-ram {ram[arm]} (~{RAM_TOKENS:,} tokens)")
        turn = 0
        each: list[dict[str, Any]] = []  # every round's row, in the order run (--rounds)
        for n in slots:
            for k in ks:
                rounds: dict[str, list[Point]] = {arm: [] for arm in chosen}
                for _ in range(max(1, args.rounds)):
                    arms = chosen if turn % 2 == 0 else tuple(reversed(chosen))
                    turn += 1
                    for arm in arms:
                        ocpc_like = arm == "ocpc" or arm in variants  # its home is kept across the points of one N
                        home = Path(work) / f"{arm}-np{n}" / ("" if ocpc_like else f"k{k}-{len(rounds[arm])}")
                        flags = (*base[arm], "--cache-ram", str(ram[arm]))
                        point = run_point(
                            arm,
                            k,
                            n,
                            binary=rig.server,
                            model=model,
                            home=home,
                            args=flags,
                            window=window,
                            fault=args.fault,
                            doors=args.doors,
                            lines=args.tool_lines,
                            warmup=warmup,
                            short=args.smoke,
                            ocpc_env=variants.get(arm),
                        )
                        rounds[arm].append(point)
                        each.append(point.row(window))
                        render([each[-1]])
                        _print_fault(point)
                rows += [Point.merged(rounds[arm]).row(window * len(rounds[arm])) for arm in chosen]
    print()
    render(rows)
    for r in ratios(rows):
        if "arm" in r:  # a --variant, against ocpc
            print(
                f"N={r['n']} K={r['k']}: {r['arm']} served {r['turns_x_ocpc']:.2f}x ocpc's turns, mean turn time "
                f"{r['turn_time_x_ocpc']:.2f}x; cache {r['ocpc_cache']:.0%} -> {r['cache']:.0%}"
            )
            continue
        print(
            f"N={r['n']} K={r['k']}: ocpc served {r['turns_x']:.2f}x plain's turns, mean turn time "
            f"{r['turn_time_x']:.2f}x; cache {r['plain_cache']:.0%} -> {r['ocpc_cache']:.0%}"
            + (
                f"; {r['of_oracle_turns']:.2f}x the oracle's turns (its cache {r['oracle_cache']:.0%})"
                if "of_oracle_turns" in r
                else ""
            )
        )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "window_s": window,
                    "rounds": max(1, args.rounds),
                    "tool_lines": args.tool_lines,
                    "ram_mib": ram,
                    "warmup": warmup,
                    "rows": rows,
                    "ratios": ratios(rows),
                    "rounds_rows": each if args.rounds > 1 else [],
                },
                indent=2,
            )
        )
    if args.png:
        plot(rows, args.png)
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
