"""Several llama-server boxes behind the smg gateway: round-robin, cache-aware, and ocpc.

B boxes (``--boxes``, default 2), each its own llama-server on the real Gemma 3 270M
(`--no-repack`, `-t 1`, ``-np N``, its own slot folder), box i on its own loopback address,
127.0.0.(i+2); the Shepherd Model Gateway (smg) in front of them on 127.0.0.1. The workload is
agents_bench.py's (K agent loops from captured first requests, a tool result per turn, tool
gaps, each agent's first request answered before the window opens), at K = B x N (agents =
slots) and K = 2 x B x N (agents outnumber slots); each agent is one conversation and talks to
the gateway only, with the model id ``gemma`` (every server runs with ``--alias gemma``).

Arms, on fresh boxes per point, alternated point by point and round by round (A B C C B A ...):
- ``a``: smg ``--policy round_robin`` over plain llama-servers (its defaults plus `--metrics
  --no-repack -np N -t 1 --alias gemma`);
- ``b``: smg ``--policy cache_aware`` over the same plain servers (what a team runs without ocpc);
- ``c``: `ocpc gateway --policy consistent_hashing` over B `ocpc launch` boxes (each with its
  door on 127.0.0.(i+2)); the agents send nothing special, the ocpc front computes each
  conversation's routing key itself, and they carry the deployment's token (`ocpc token`);
- ``cs``: ``c`` with every box on one ``--shared-store``.
Arm c needs `ocpc token`, `ocpc gateway` and `ocpc launch --listen/--shared-store`; until they
exist it stops at once, before any server starts, saying what is missing (``--arms a,b`` runs
without it).

Per arm and K: turns in the window, mean and p95 turn time, failed requests, which box each
conversation landed on (smg's ``x-smg-routed-worker-id`` answer header) and how often one moved,
and the prompt tokens the boxes processed (the sum over boxes of their own `/metrics`
``llamacpp:prompt_tokens_total`` from the window's opening to its last turn's end: smg does not
forward `/metrics`, each box's server is read directly) against an *ideal prefix cache per
box*: each request processes only what no earlier request on the same box had (its own
conversation's previous prompt there, or the longest token prefix it shares with any other
conversation that box has seen: the harness heads, measured once by tokenizing each agent's
first request on a box's server), with unbounded memory. ``x ideal`` is processed / ideal.

``--fault``: in the middle of each window the box holding the most conversations is killed
(SIGKILL to its llama-server and to its ocpc's process group) and stays down. For each
conversation that lived there: its next answered turn (tokens processed against its prompt and
against the ideal, its wait from the kill), the requests that failed after the kill, and its
turns in the window's second half against its first (turns lost). For ``FAULT_GRACE_S`` after
the kill a failed request is retried a second later (smg itself retries on a survivor for
~10 s); a failure after that stops the agent, as in agents_bench. Arms b, c and cs by default.

    .venv/bin/python bench/boxes_bench.py --smoke --arms a,b        # CI: B=2, N=1, K=2, 30 s
    .venv/bin/python bench/boxes_bench.py --boxes 2 --slots 2 --window 120 --arms a,b \
        --json bench/results/boxes-ab-DATE.json
    .venv/bin/python bench/boxes_bench.py --boxes 2 --slots 2 --window 120 --fault   # b, c, cs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agents_bench as ab  # noqa: E402  (puts the repo root on sys.path too)

from oc_prefix_cache import loopback  # noqa: E402
from oc_prefix_cache.chat.anthropic import to_chat  # noqa: E402
from oc_prefix_cache.llama.server_info import process_start, stat_fields  # noqa: E402
from oc_prefix_cache.llama.server_process import LlamaServer, free_port  # noqa: E402
from oc_prefix_cache.llama.supervisor import Supervised, stop_on_sigterm  # noqa: E402
from oc_prefix_cache.rig.build import ensure_rig  # noqa: E402
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model  # noqa: E402
from oc_prefix_cache.settings import Settings  # noqa: E402

MODEL_ID = "gemma"  # every server's --alias: smg routes a request to the workers serving its "model"
BIN = Path(sys.executable).parent  # the venv's: smg and ocpc are installed beside this Python
POLICY = {
    "a": "round_robin",
    "b": "cache_aware",
    "c": "consistent_hashing",
    "cs": "consistent_hashing",
    "cm": "manual",
    "cms": "manual",
}
ARMS = tuple(POLICY)
ARM_WORDS = {
    "a": "smg round_robin over plain llama-servers",
    "b": "smg cache_aware over plain llama-servers",
    "c": "ocpc gateway (consistent_hashing) over ocpc boxes",
    "cs": "arm c, the boxes on one --shared-store",
    "cm": "ocpc gateway (manual: a new conversation to the box with the fewest, then pinned) over ocpc boxes",
    "cms": "arm cm, the boxes on one --shared-store",
}
FAULT_GRACE_S = 30.0  # after a kill: failed requests retried (smg retries on the survivor for ~10 s)
SMG_STOP_S = 15.0  # smg takes ~6 s to exit on SIGTERM
OCPC_START_S = 300.0  # ocpc launch: llama-server, then its warm start, before its door answers


def box_host(i: int) -> str:
    return f"127.0.0.{i + 2}"


# -- each turn, with the box that served it ---------------------------------------------------------


@dataclass
class BoxTurn(ab.Turn):
    box: int = -1  # the box that served it (-1: the answer did not say)


@dataclass
class Failure:
    agent: str
    started: float
    at: float
    error: str


class Recorder:
    """Every answered turn (the first requests before the window too) with the box that served
    it, and every failed request: drive()'s ``take_turn``."""

    def __init__(self, boxes: int, headers: dict[str, str] | None = None) -> None:
        self.hosts = {box_host(i): i for i in range(boxes)}
        self.headers = headers or {}
        self.turns: list[BoxTurn] = []
        self.failures: list[Failure] = []
        self.unrouted = 0  # answers without the routed-worker header
        self._lock = threading.Lock()

    def box_of(self, worker: str) -> int:
        host = urlsplit(worker).hostname if worker else None
        return self.hosts.get(host or "", -1)

    def take(self, http: httpx.Client, doors: ab.Doors, agent: ab.Agent) -> BoxTurn:
        raw = json.dumps(agent.next_body()).encode()
        started = time.monotonic()
        try:
            tail, ttft, worker = _stream(
                http, doors.proxy + agent.path, raw, {**agent.headers, **self.headers}, started
            )
            cached_re, processed_re = ab._NUMBERS[agent.path]
            cached, processed = re.findall(cached_re, tail), re.findall(processed_re, tail)
            if not cached or not processed:
                raise RuntimeError(f"no reuse numbers in the answer: {tail[-300:]!r}")
        except Exception as exc:
            with self._lock:
                self.failures.append(
                    Failure(agent.name, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300])
                )
            raise
        c, p = int(cached[-1]), int(processed[-1])
        turn = BoxTurn(agent.name, started, time.monotonic(), ttft, c + p, p, 200, box=self.box_of(worker))
        with self._lock:
            self.turns.append(turn)
            self.unrouted += turn.box < 0
        return turn

    def landed(self, before: float) -> dict[str, int]:
        """Each conversation's box as of ``before``: the box of its last turn answered by then."""
        with self._lock:
            turns = sorted(self.turns, key=lambda t: t.ended)
        return {t.agent: t.box for t in turns if t.ended <= before}


def _stream(
    http: httpx.Client, url: str, raw: bytes, headers: dict[str, str], started: float
) -> tuple[bytes, float, str]:
    """agents_bench's stream, keeping smg's ``x-smg-routed-worker-id`` (the box's URL)."""
    _, tail, ttft, answered = ab.stream_answer(http, url, raw, headers, started)
    return tail, ttft, answered.get("x-smg-routed-worker-id", "")


# -- the ideal prefix cache per box -----------------------------------------------------------------


def shared_prefixes(server_url: str, agents: list[ab.Agent]) -> dict[tuple[str, str], int]:
    """The tokens each pair of agents' first requests share from the start (the harness heads),
    from the box's own template and tokenizer (`/apply-template`, `/tokenize`; an Anthropic body
    as the server converts it). The special tokens are tokenized as text here, which counts a
    few tokens more than the server does: noise against heads of 600-2,000 tokens."""
    tokens: dict[str, list[int]] = {}
    with loopback.client(server_url, timeout=120) as http:
        for agent in agents:
            body = to_chat(agent.body) if agent.path == "/v1/messages" else agent.body
            prompt = http.post("/apply-template", json={"messages": body["messages"], "tools": body.get("tools")})
            prompt.raise_for_status()
            tokenized = http.post("/tokenize", json={"content": prompt.json()["prompt"], "add_special": False})
            tokenized.raise_for_status()
            tokens[agent.name] = tokenized.json()["tokens"]
    out = {}
    for a, x in tokens.items():
        for b, y in tokens.items():
            n = 0
            for p, q in zip(x, y, strict=False):
                if p != q:
                    break
                n += 1
            out[a, b] = n
    return out


def ideal_tokens(turns: list[BoxTurn], shared: dict[tuple[str, str], int]) -> dict[int, int]:
    """Per turn (by ``id``), what an ideal prefix cache per box would process: the prompt less
    the longest prefix its box already processed for an earlier request (its own conversation's
    previous prompt there, or what it shares with another conversation seen there). Unbounded
    memory, turns in the order they started. A turn whose box is unknown counts on box -1."""
    have: dict[int, dict[str, int]] = {}
    out: dict[int, int] = {}
    for t in sorted(turns, key=lambda t: t.started):
        box = have.setdefault(t.box, {})
        reuse = box.get(t.agent, 0)
        for other in box:
            if other != t.agent:
                reuse = max(reuse, shared.get((t.agent, other), 0))
        out[id(t)] = t.prompt - min(reuse, t.prompt)
        box[t.agent] = max(box.get(t.agent, 0), t.prompt)
    return out


# -- boxes and gateways -----------------------------------------------------------------------------


def descendants(pid: int) -> list[tuple[int, int | None]]:
    """Every process below ``pid`` (from /proc: each process's parent), with its start time, so
    that a pid reused later is never signalled."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and len(fields) > 1:
                parent[int(entry.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        top = todo.pop()
        below = [child for child, p in parent.items() if p == top]
        out += below
        todo += below
    return [(child, process_start(child)) for child in out]


def signal_kept(pids: list[tuple[int, int | None]], sig: int) -> None:
    """Signal each recorded process that is still the same process (its start time unchanged)."""
    for pid, started in pids:
        if started is not None and process_start(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def reap(pids: list[tuple[int, int | None]]) -> None:
    """After its parent stopped: SIGTERM whatever of it is left, SIGKILL after 10 s."""
    signal_kept(pids, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(s is not None and process_start(p) == s for p, s in pids):
        time.sleep(0.2)
    signal_kept(pids, signal.SIGKILL)


class PlainBox:
    """llama-server at its defaults on 127.0.0.(i+2) (arms a and b): door and /metrics are its own."""

    def __init__(self, i: int, *, binary: Path, model: Path, home: Path, n: int, args: tuple[str, ...]) -> None:
        self.i, self.binary, self.model, self.home, self.n, self.args = i, binary, model, home, n, args
        self.server: LlamaServer | None = None
        self.url = ""

    def start(self) -> None:
        self.server = ab.start(self.binary, self.model, self.home, n=self.n, args=self.args, host=box_host(self.i))
        self.url = self.server.url

    @property
    def door(self) -> str:
        return self.url

    @property
    def metrics(self) -> str:
        return self.url

    def kill(self) -> None:
        """SIGKILL its process group, no warning (the box is gone)."""
        proc = self.server._proc if self.server is not None else None
        if proc is not None and proc.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(10)
        if self.server is not None:
            self.server._proc = None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class OcpcBox:
    """`ocpc launch` with its door on 127.0.0.(i+2) (arm c): its llama-server's /metrics on
    127.0.0.1:<port>, its home, token and ports given through the environment."""

    def __init__(
        self,
        i: int,
        *,
        binary: Path,
        model: Path,
        run: Path,
        n: int,
        token_file: Path,
        store: Path | None,
        cache_ram: int | None,
    ) -> None:
        self.i, self.binary, self.model, self.run, self.n = i, binary, model, run, n
        self.token_file, self.store, self.cache_ram = token_file, store, cache_ram
        self.proc: Supervised | None = None
        self.port = self.door_port = 0
        self.below: list[tuple[int, int | None]] = []  # its llama-server and whatever else it started

    def start(self) -> None:
        home = self.run / f"box{self.i}"
        home.mkdir(parents=True, exist_ok=True)
        self.port, self.door_port = free_port(), free_port(box_host(self.i))
        env = {
            **os.environ,
            "OC_PREFIX_CACHE_HOME": str(home),
            "OC_PREFIX_CACHE_TOKEN_FILE": str(self.token_file),
            "OC_PREFIX_CACHE_PROXY_PORT": str(free_port()),
            "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()),
        }
        argv = [str(BIN / "ocpc"), "launch", "-m", str(self.model), "--server-bin", str(self.binary)]
        argv += ["--port", str(self.port), "-np", str(self.n), "--listen", f"{box_host(self.i)}:{self.door_port}"]
        argv += ["--shared-store", str(self.store)] if self.store is not None else []
        argv += ["--cache-ram", str(self.cache_ram)] if self.cache_ram is not None else []
        argv += ["--", "-t", "1", "--alias", MODEL_ID, "--no-repack", "-c", str(ab.CTX_PER_SLOT * self.n)]
        self.proc = Supervised(
            name=f"ocpc launch (box {self.i})",
            argv=argv,
            health_url=f"{self.door}/health",
            log_path=self.run / f"ocpc-launch-box{self.i}.log",
            env=env,
        )
        self.proc.start(timeout=OCPC_START_S, on_wait=self._track)
        self._track(None)

    def _track(self, elapsed: float | None) -> None:
        """What ocpc started so far (also while it starts: a start that fails leaves none behind)."""
        if self.proc is not None and self.proc.pid and (elapsed is None or elapsed % 1 < 0.11):
            self.below += [p for p in descendants(self.proc.pid) if p not in self.below]

    @property
    def door(self) -> str:
        return f"http://{box_host(self.i)}:{self.door_port}"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL its llama-server (and anything else below ocpc) and ocpc's process group."""
        if self.proc is None or self.proc.proc is None:
            return
        below = descendants(self.proc.proc.pid)
        self.below += [p for p in below if p not in self.below]
        signal_kept(below, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.proc.pid, signal.SIGKILL)
        self.proc.proc.wait(10)
        self.proc.proc = None
        self.proc.stop()  # its state: stopped

    def stop(self) -> None:
        if self.proc is not None:
            self._track(None)
            self.proc.stop(grace=30)
        reap(self.below)


class SmgGateway:
    """``smg launch`` over the boxes' doors (arms a and b), on 127.0.0.1 with a Prometheus port
    of its own; ready once /v1/models lists the model."""

    def __init__(self, policy: str, doors: list[str], run: Path) -> None:
        self.policy, self.doors, self.run = policy, doors, run
        self.port = 0
        self.proc: Supervised | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        argv = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--worker-urls", *self.doors, "--policy", self.policy]
        argv += ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1", "--log-level", "warn"]
        self.proc = Supervised(
            name=f"smg ({self.policy})", argv=argv, health_url=f"{self.url}/health", log_path=self.run / "smg.log"
        )
        self.proc.start(timeout=60)
        wait_models(self.url, {}, 60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace=SMG_STOP_S)


class OcpcGateway:
    """`ocpc gateway` over the ocpc boxes (arm c): it runs smg itself."""

    def __init__(self, doors: list[str], run: Path, token_file: Path, policy: str) -> None:
        self.doors, self.run, self.token_file, self.policy = doors, run, token_file, policy
        self.port = 0
        self.proc: Supervised | None = None
        self.below: list[tuple[int, int | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        argv = [str(BIN / "ocpc"), "gateway"]
        for door in self.doors:
            argv += ["--box", door]
        argv += ["--port", str(self.port), "--smg-port", str(free_port()), "--policy", self.policy]
        self.proc = Supervised(
            name="ocpc gateway",
            argv=argv,
            health_url=f"{self.url}/health",
            log_path=self.run / "ocpc-gateway.log",
            env={  # its home (smg's log, its state) in the run's folder, never the user's
                **os.environ,
                "OC_PREFIX_CACHE_HOME": str(self.run / "gateway"),
                "OC_PREFIX_CACHE_TOKEN_FILE": str(self.token_file),
            },
        )
        self.proc.start(timeout=90)
        self.below = descendants(self.proc.pid or 0)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.proc is not None:
                self.below += [p for p in descendants(self.proc.proc.pid) if p not in self.below]
            self.proc.stop(grace=SMG_STOP_S + 5)
        reap(self.below)


def wait_models(url: str, headers: dict[str, str], timeout: float) -> None:
    """Until the gateway's /v1/models lists the model (its workers registered)."""
    deadline = time.monotonic() + timeout
    with loopback.client(timeout=5) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                answer = http.get(f"{url}/v1/models", headers=headers)
                if answer.status_code == 200 and any(m.get("id") == MODEL_ID for m in answer.json().get("data", [])):
                    return
            time.sleep(0.5)
    raise RuntimeError(f"the gateway at {url} never listed model {MODEL_ID!r} in /v1/models")


def ocpc_token(token_file: Path) -> str:
    """The deployment's token: `ocpc token` creates the file (0600) if missing."""
    env = {**os.environ, "OC_PREFIX_CACHE_HOME": str(token_file.parent), "OC_PREFIX_CACHE_TOKEN_FILE": str(token_file)}
    done = subprocess.run([str(BIN / "ocpc"), "token"], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not token_file.is_file():
        raise RuntimeError(f"`ocpc token` failed ({done.returncode}): {(done.stderr or done.stdout)[-400:]}")
    return token_file.read_text().strip()


def check_arm_c(arms: list[str]) -> None:
    """Stop before any server starts when the ocpc commands arm c needs are not there yet."""
    if not {"c", "cs", "cm", "cms"} & set(arms):
        return
    needs = {
        ("token",): (),
        ("launch",): (
            "--listen",
            "--port",
            "-np",
            "--server-bin",
            *(("--shared-store",) if {"cs", "cms"} & set(arms) else ()),
        ),
        ("gateway",): ("--box", "--port", "--smg-port", "--policy"),
    }
    missing = []
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}  # no option names cut short
    for command, flags in needs.items():
        try:
            done = subprocess.run(
                [str(BIN / "ocpc"), *command, "--help"], env=env, capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            missing.append(f"`ocpc {' '.join(command)}`: {exc}")
            continue
        if done.returncode != 0:
            missing.append(f"`ocpc {' '.join(command)}` (no such command)")
            continue
        lacking = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", done.stdout)]
        if lacking:
            missing.append(f"`ocpc {' '.join(command)}` without {', '.join(lacking)}")
    if missing:
        raise SystemExit(
            "arm c needs the ocpc commands it is written against, and this ocpc lacks: "
            + "; ".join(missing)
            + ". Run the other arms with --arms a,b until they land."
        )


# -- one point ---------------------------------------------------------------------------------------


class BoxFault:
    """In the middle of the window: the box holding the most conversations is killed and stays
    down. drive() retries a failed request a second later while this thread lives (the kill and
    ``FAULT_GRACE_S`` after it) and counts it apart; the Recorder keeps each failure's time."""

    def __init__(self, boxes: list[PlainBox | OcpcBox], recorder: Recorder, *, at: float, grace: float) -> None:
        self.boxes, self.recorder, self.at, self.grace = boxes, recorder, at, grace
        self.victim = -1
        self.lived: list[str] = []  # the conversations on the victim when it went
        self.before: dict[int, Counter[str]] = {}  # every box's counters just before the kill
        self.down: tuple[float, float] = (0.0, 0.0)
        self.killed_at = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        time.sleep(self.at)
        landed = self.recorder.landed(time.monotonic())
        count = Counter(box for box in landed.values() if box >= 0)
        self.victim = max(range(len(self.boxes)), key=lambda i: (count[i], -i))
        self.lived = sorted(agent for agent, box in landed.items() if box == self.victim)
        for box in self.boxes:
            with contextlib.suppress(Exception):
                self.before[box.i] = ab.server_counters(box.metrics)
        self.killed_at = time.monotonic()
        self.boxes[self.victim].kill()
        self.down = (self.killed_at, time.monotonic())
        time.sleep(self.grace)


@dataclass
class Result:
    """One arm at one K, one round."""

    arm: str
    k: int
    n: int
    boxes: int
    window: float
    opened: float = 0.0
    end: float = 0.0
    turns: list[BoxTurn] = field(default_factory=list)  # answered in the window
    after: list[BoxTurn] = field(default_factory=list)  # started in it (ended in it or later)
    every: list[BoxTurn] = field(default_factory=list)  # all, the first requests too
    failures: list[Failure] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)  # agents whose loop a failure ended (agents_bench's "failed")
    processed_by_box: dict[int, float] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)
    ideal: dict[int, int] = field(default_factory=dict)  # per turn, by id
    unrouted: int = 0
    fault: dict[str, Any] = field(default_factory=dict)


def run_point(
    arm: str,
    k: int,
    n: int,
    *,
    boxes: int,
    binary: Path,
    model: Path,
    run: Path,
    window: float,
    short: bool,
    lines: int,
    fault: bool,
    cache_ram: int | None,
    shared: dict[tuple[str, str], int] | None,
    max_agents: int,
) -> tuple[Result, dict[tuple[str, str], int]]:
    """One arm at one K on fresh boxes behind a fresh gateway; everything started is stopped here."""
    run.mkdir(parents=True, exist_ok=True)
    result = Result(arm, k, n, boxes, window)
    headers: dict[str, str] = {}
    made: list[PlainBox | OcpcBox] = []
    gateway: SmgGateway | OcpcGateway | None = None
    try:
        if arm in ("a", "b"):
            flags = (*REAL_MODELS["gemma3"].server_args, "--metrics", "-t", "1", "--alias", MODEL_ID)
            flags += ("--cache-ram", str(cache_ram)) if cache_ram is not None else ()
            for i in range(boxes):
                made.append(PlainBox(i, binary=binary, model=model, home=run / f"box{i}", n=n, args=flags))
                made[-1].start()
            gateway = SmgGateway(POLICY[arm], [b.door for b in made], run)
        else:
            token_file = run / "token"
            headers = {"authorization": f"Bearer {ocpc_token(token_file)}"}
            store = run / "store" if arm in ("cs", "cms") else None
            for i in range(boxes):
                made.append(
                    OcpcBox(
                        i,
                        binary=binary,
                        model=model,
                        run=run,
                        n=n,
                        token_file=token_file,
                        store=store,
                        cache_ram=cache_ram,
                    )
                )
                made[-1].start()
            gateway = OcpcGateway([b.door for b in made], run, token_file, POLICY[arm])
        gateway.start()
        if shared is None:  # once per run: the agents' shared prefixes, on the first box's server
            shared = shared_prefixes(made[0].metrics, ab.make_agents(max_agents, lines=lines, short=short))
        agents = ab.make_agents(k, lines=lines, short=short)
        for agent in agents:
            agent.body["model"] = MODEL_ID
        recorder = Recorder(boxes, headers)
        point = ab.Point(arm, k, n)
        broke = BoxFault(made, recorder, at=window / 2, grace=min(FAULT_GRACE_S, window / 2)) if fault else None
        baseline: dict[int, Counter[str]] = {}

        def opened() -> None:
            result.opened = time.monotonic()
            result.end = result.opened + window
            for box in made:
                baseline[box.i] = ab.server_counters(box.metrics)
            if broke is not None:
                broke.thread.start()

        ab.drive(
            ab.Doors(proxy=gateway.url, server=gateway.url),
            agents,
            window=window,
            point=point,
            fault=broke,
            warmup=True,
            on_start=opened,
            take_turn=recorder.take,
        )
        if broke is not None:
            broke.thread.join(FAULT_GRACE_S + 60)
        server: Counter[str] = Counter()
        for box in made:
            if broke is not None and box.i == broke.victim:
                done = broke.before.get(box.i, baseline[box.i])
            else:
                done = ab.server_counters(box.metrics)
            delta = {key: done[key] - baseline[box.i][key] for key in ab._COUNTERS}
            result.processed_by_box[box.i] = delta["prompt_tokens_total"]
            server.update(delta)
        result.server = dict(server)
    finally:
        if gateway is not None:
            gateway.stop()
        for box in reversed(made):
            box.stop()
    result.every = sorted(recorder.turns, key=lambda t: t.started)
    result.turns = [t for t in result.every if t.started >= result.opened and t.ended <= result.end]
    result.after = [t for t in result.every if t.started >= result.opened]
    result.failures = sorted(recorder.failures, key=lambda f: f.started)
    result.stopped = list(point.failed)
    result.unrouted = recorder.unrouted
    result.ideal = ideal_tokens(result.every, shared)
    if broke is not None and broke.victim >= 0:
        result.fault = fault_report(result, broke)
    return result, shared


def fault_report(result: Result, broke: BoxFault) -> dict[str, Any]:
    """What the kill did to the conversations that lived on the victim (and, beside them, the
    others): their next answered turn, the requests failed after it, their turns in the
    window's second half against its first."""
    half_start, killed, end = result.opened, broke.killed_at, result.end

    def side(agents: list[str]) -> dict[str, Any]:
        nexts: list[dict[str, Any]] = []
        before = after = 0
        for agent in agents:
            mine = [t for t in result.every if t.agent == agent]
            before += sum(1 for t in mine if half_start <= t.started and t.ended <= killed)
            after += sum(1 for t in mine if t.started >= killed and t.ended <= end)
            later = [t for t in mine if t.ended > killed]
            if later:
                t = later[0]
                nexts.append(
                    {
                        "agent": agent,
                        "box": t.box,
                        "waited_s": round(t.ended - killed, 2),
                        "turn_s": round(t.ended - t.started, 2),
                        "prompt": t.prompt,
                        "processed": t.processed,
                        "ideal": result.ideal.get(id(t), 0),
                    }
                )
        failed = [f for f in result.failures if f.agent in agents and f.at >= killed]
        return {
            "conversations": len(agents),
            "next_turns": nexts,
            "next_processed": sum(x["processed"] for x in nexts),
            "next_prompt": sum(x["prompt"] for x in nexts),
            "next_ideal": sum(x["ideal"] for x in nexts),
            "next_waited_mean_s": statistics.fmean(x["waited_s"] for x in nexts) if nexts else None,
            "no_next_turn": len(agents) - len(nexts),
            "failed_requests": len(failed),
            "failures": [f"{f.agent} +{f.at - killed:.1f} s: {f.error}"[:200] for f in failed[:5]],
            "turns_first_half": before,
            "turns_second_half": after,
            "turns_lost": before - after,
        }

    others = sorted({t.agent for t in result.every} - set(broke.lived))
    return {
        "victim": broke.victim,
        "killed_at_s": round(killed - result.opened, 2),
        "kill_took_s": round(broke.down[1] - broke.down[0], 2),
        "failed_before_kill": sum(1 for f in result.failures if result.opened <= f.at < killed),
        "lived_there": side(broke.lived),
        "elsewhere": side(others),
    }


# -- rows, tables -----------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def row(results: list[Result]) -> dict[str, Any]:
    """One arm at one K, its rounds added up."""
    first = results[0]
    turns = [t for r in results for t in r.turns]
    after = [(r, t) for r in results for t in r.after]
    times = sorted(t.ended - t.started for t in turns)
    ttfts = sorted(t.ttft for t in turns)
    processed = sum(sum(r.processed_by_box.values()) for r in results)
    ideal = sum(r.ideal.get(id(t), 0) for r, t in after)
    landed: dict[str, list[int]] = {}
    moves = 0
    per_box: Counter[int] = Counter()
    for r in results:
        for agent in sorted({t.agent for t in r.every}):
            seq = [t.box for t in r.every if t.agent == agent]
            moves += sum(1 for x, y in zip(seq, seq[1:], strict=False) if x != y)
            in_window = [t.box for t in r.after if t.agent == agent] or seq
            per_box[Counter(in_window).most_common(1)[0][0]] += 1
            landed.setdefault(agent, []).extend(seq)
    return {
        "arm": first.arm,
        "policy": POLICY[first.arm],
        "boxes": first.boxes,
        "n": first.n,
        "k": first.k,
        "rounds": len(results),
        "window_s": first.window * len(results),
        "turns": len(turns),
        "turns_per_min": len(turns) * 60 / (first.window * len(results)),
        "turn_mean_s": statistics.fmean(times) if times else None,
        "turn_p95_s": _pct(times, 0.95),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p95_s": _pct(ttfts, 0.95),
        "prompt_tokens": sum(t.prompt for _, t in after),
        "processed_tokens": processed,
        "processed_by_box": [sum(r.processed_by_box.get(i, 0) for r in results) for i in range(first.boxes)],
        "processed_per_turn_answers": sum(t.processed for _, t in after),
        "ideal_tokens": ideal,
        "x_ideal": processed / ideal if ideal else None,
        "prefill_s": sum(r.server.get("prompt_seconds_total", 0.0) for r in results),
        "decode_s": sum(r.server.get("tokens_predicted_seconds_total", 0.0) for r in results),
        "failed": sum(len(r.failures) for r in results),
        "agents_stopped": sum(len(r.stopped) for r in results),
        "failures": [f.error for r in results for f in r.failures][:5] + [s for r in results for s in r.stopped][:5],
        "unrouted_answers": sum(r.unrouted for r in results),
        "box_moves": moves,
        "conversations_per_box": [per_box[i] for i in range(first.boxes)],
        "landed": {agent: _runs(seq) for agent, seq in landed.items()},
        "fault": [r.fault for r in results if r.fault],
        "each_turn": [
            {
                "round": j,
                "agent": t.agent,
                "box": t.box,
                "at_s": round(t.started - r.opened, 3),
                "s": round(t.ended - t.started, 4),
                "ttft_s": round(t.ttft, 4),
                "prompt": t.prompt,
                "processed": t.processed,
                "ideal": r.ideal.get(id(t)),
                "window": r.opened <= t.started and t.ended <= r.end,
            }
            for j, r in enumerate(results)
            for t in r.every
        ],
    }


def _runs(seq: list[int]) -> str:
    """Boxes in turn order, runs folded: ``0x5 1x3``."""
    out: list[list[int]] = []
    for box in seq:
        if out and out[-1][0] == box:
            out[-1][1] += 1
        else:
            out.append([box, 1])
    return " ".join(f"{b if b >= 0 else '?'}x{c}" for b, c in out)


def render(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'B':>2} {'N':>2} {'K':>3} {'arm':<4} {'turns':>5} {'mean s':>7} {'p95 s':>7} {'processed':>10} "
        f"{'ideal':>8} {'x ideal':>7} {'failed':>6} {'moves':>5}  conversations per box"
    )
    for r in rows:

        def f(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            return format(r[key], fmt) if r[key] is not None else "-".rjust(int(fmt.split(".")[0]))

        print(
            f"{r['boxes']:>2} {r['n']:>2} {r['k']:>3} {r['arm']:<4} {r['turns']:>5} {f('turn_mean_s', '7.2f')} "
            f"{f('turn_p95_s', '7.2f')} {r['processed_tokens']:>10,.0f} {r['ideal_tokens']:>8,} "
            f"{f('x_ideal', '7.2f')} {r['failed']:>6} {r['box_moves']:>5}  "
            + "/".join(str(c) for c in r["conversations_per_box"])
            + (f"  ({r['unrouted_answers']} answers without a box)" if r["unrouted_answers"] else "")
        )


def render_faults(rows: list[dict[str, Any]]) -> None:
    faulted = [r for r in rows if r["fault"]]
    if not faulted:
        return
    print(
        f"\nfault: the busiest box killed at mid-window\n"
        f"{'K':>3} {'arm':<4} {'box':>3} {'moved':>5} {'next processed':>14} {'of prompt':>9} {'ideal':>7} "
        f"{'waited s':>8} {'failed':>6} {'turns 1st/2nd half':>18} {'lost':>5}"
    )
    for r in faulted:
        for fault in r["fault"]:
            lived = fault["lived_there"]
            waited = lived["next_waited_mean_s"]
            print(
                f"{r['k']:>3} {r['arm']:<4} {fault['victim']:>3} {lived['conversations']:>5} "
                f"{lived['next_processed']:>14,} {lived['next_prompt']:>9,} {lived['next_ideal']:>7,} "
                f"{waited if waited is not None else float('nan'):>8.1f} {lived['failed_requests']:>6} "
                f"{lived['turns_first_half']:>8}/{lived['turns_second_half']:<9} {lived['turns_lost']:>5}"
            )


#: The pairs measured side by side: (arm, against).
PAIRS = (("c", "b"), ("cm", "b"), ("cs", "b"), ("cms", "b"), ("cs", "c"), ("cms", "cm"), ("cm", "c"), ("b", "a"))


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for arm, other in PAIRS:
        for r in (x for x in rows if x["arm"] == arm):
            o = next((x for x in rows if x["arm"] == other and x["k"] == r["k"] and x["n"] == r["n"]), None)
            if o is None or not o["turns"] or not o["processed_tokens"]:
                continue
            ratio = {
                "pair": f"{arm}/{other}",
                "k": r["k"],
                "n": r["n"],
                "tokens_x": r["processed_tokens"] / o["processed_tokens"],
                "turns_x": r["turns"] / o["turns"],
                "turn_time_x": r["turn_mean_s"] / o["turn_mean_s"] if r["turn_mean_s"] and o["turn_mean_s"] else None,
            }
            if r["fault"] and o["fault"]:
                mine, theirs = r["fault"][0]["lived_there"], o["fault"][0]["lived_there"]
                if theirs["next_processed"]:
                    ratio["fault_next_tokens_x"] = mine["next_processed"] / theirs["next_processed"]
            out.append(ratio)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: B=2, N=1, K=2, 30 s per arm, short heads")
    parser.add_argument("--boxes", type=int, default=2, help="llama-server boxes B (box i on 127.0.0.(i+2))")
    parser.add_argument("--slots", type=int, default=2, help="slots per box N (-np)")
    parser.add_argument("--agents", default="", help="concurrent agents K (default: B x N and 2 x B x N)")
    parser.add_argument("--window", type=float, default=120.0, help="seconds per point and arm")
    parser.add_argument(
        "--arms",
        default="",
        help="a (smg round_robin, plain), b (smg cache_aware, plain), c (ocpc gateway over ocpc boxes), "
        "cs (c on one --shared-store); default a,b,c, with --fault b,c,cs",
    )
    parser.add_argument("--rounds", type=int, default=1, help="each point this many times per arm, A B C C B A ...")
    parser.add_argument("--fault", action="store_true", help="kill the busiest box in the middle of each window")
    parser.add_argument("--tool-lines", type=int, default=ab.TOOL_LINES, help="lines of code per tool result")
    parser.add_argument("--cache-ram", type=int, help="--cache-ram MiB for every box's server (default: its own)")
    parser.add_argument("--keep", type=Path, help="work here and keep it (servers', smg's and ocpc's logs)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    boxes = 2 if args.smoke else args.boxes
    n = 1 if args.smoke else args.slots
    window = 30.0 if args.smoke else args.window
    if args.smoke:
        ks = [2]
    elif args.agents:
        ks = [int(x) for x in args.agents.split(",")]
    else:
        ks = [boxes * n, 2 * boxes * n]
    arms = [a for a in (args.arms or ("b,c,cs" if args.fault else "a,b,c")).split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or not 1 <= boxes <= 253:
        raise SystemExit(f"--arms: choose from {', '.join(ARMS)} (got {unknown or arms}); --boxes 1..253")
    check_arm_c(arms)  # before any server starts
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    model = ensure_real_model(rig, settings, "gemma3")
    smg_version = subprocess.run([str(BIN / "smg"), "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{boxes} boxes x -np {n}, K {ks}, window {window:.0f} s, arms {arms}, {smg_version}")
    for arm in arms:
        print(f"  {arm}: {ARM_WORDS[arm]}")
    load_start = os.getloadavg()[0]
    began = time.monotonic()
    shared: dict[tuple[str, str], int] | None = None
    rows: list[dict[str, Any]] = []
    each: list[dict[str, Any]] = []
    turn = 0
    with (
        contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="ocpc-boxes-")
    ) as work:
        for k in ks:
            rounds: dict[str, list[Result]] = {arm: [] for arm in arms}
            for j in range(max(1, args.rounds)):
                order = arms if turn % 2 == 0 else list(reversed(arms))
                turn += 1
                for arm in order:
                    result, shared = run_point(
                        arm,
                        k,
                        n,
                        boxes=boxes,
                        binary=rig.server,
                        model=model,
                        run=Path(work) / f"{arm}-k{k}-r{j}",
                        window=window,
                        short=args.smoke,
                        lines=args.tool_lines,
                        fault=args.fault,
                        cache_ram=args.cache_ram,
                        shared=shared,
                        max_agents=max(ks),
                    )
                    rounds[arm].append(result)
                    each.append(row([result]))
                    render([each[-1]])
                    for failure in each[-1]["failures"]:
                        print(f"    failed: {failure}")
            rows += [row(rounds[arm]) for arm in arms]
    print()
    render(rows)
    render_faults(rows)
    found = ratios(rows)
    print()
    for r in found:
        print(
            f"B={boxes} N={r['n']} K={r['k']}: {r['pair']} prompt tokens processed {r['tokens_x']:.2f}x, "
            f"turns {r['turns_x']:.2f}x"
            + (f", mean turn time {r['turn_time_x']:.2f}x" if r["turn_time_x"] is not None else "")
            + (
                f"; after the kill, next turns' tokens {r['fault_next_tokens_x']:.2f}x"
                if "fault_next_tokens_x" in r
                else ""
            )
        )
    heads = sorted({v for (a, b), v in (shared or {}).items() if a != b and v > 50})
    print(f"shared prefixes between the agents' first requests (tokens): {heads}")
    wall = time.monotonic() - began
    print(f"load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {wall:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": datetime.date.today().isoformat(),
                    "command": " ".join(sys.argv),
                    "boxes": boxes,
                    "slots": n,
                    "agents": ks,
                    "window_s": window,
                    "rounds": max(1, args.rounds),
                    "tool_lines": args.tool_lines,
                    "cache_ram_mib": args.cache_ram,
                    "arms": {arm: ARM_WORDS[arm] for arm in arms},
                    "smg": smg_version,
                    "server": str(rig.server),
                    "shared_prefix_tokens": {f"{a}|{b}": v for (a, b), v in sorted((shared or {}).items()) if a < b},
                    "load_average": [load_start, os.getloadavg()[0]],
                    "wall_s": time.monotonic() - began,
                    "rows": rows,
                    "ratios": found,
                    "rounds_rows": [{k: v for k, v in r.items() if k != "each_turn"} for r in each]
                    if args.rounds > 1
                    else [],
                },
                indent=2,
            )
        )
    failed = sum(r["failed"] for r in rows)
    if failed and not args.fault:
        print(f"{failed} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
