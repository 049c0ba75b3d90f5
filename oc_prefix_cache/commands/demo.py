"""``ocpc demo``: prove the claim on this machine in about a minute.

Starts llama-server (the rig's CPU build and tiny hybrid model by default, or the user's
own), runs ocpc's daemon beside it, and sends a real OpenCode request (captured from
OpenCode 1.18.33: 11 tools, its real system prompt, ~7.5k tokens) the way the plugin
does: prepare, then the request itself, then the report. Four first requests of a new
session:

- **first run**: a freshly restarted server and a fresh ocpc home: ocpc prefills and saves
  the head, then the request;
- **same server**: another project's first request (a new session) on that server;
- **cold**: that request on plain llama-server, freshly restarted (nothing cached
  anywhere, nothing of ocpc's in the slot), no ocpc;
- **after restart**: the server restarted again, the same request: the head comes from disk.

Why rounds: on a shared machine a single timing is noise, and running one arm's samples
after the other's puts a burst of load on one arm only (the headline once moved from 4.3x
to 14.2x between two runs). So each round runs the four cases back to back (cold and
after-restart, the headline's two sides, next to each other), the rounds repeat, and
every ratio is taken within a round before the median and range over rounds are shown. State
lives in a temp folder, so the demo touches nothing of yours.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.launch import family_flags
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.llama.server_info import model_family
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.settings import Settings

UA = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"
Step = Callable[[str], None]

COLD, FIRST, SAME, RESTART = (
    "cold, no ocpc",
    "first run (paid once)",
    "new session, same server",
    "new session after restart",
)
CASES = (COLD, FIRST, SAME, RESTART)  # the order they are shown in
ORDER = (FIRST, SAME, COLD, RESTART)  # the order every round runs them in (see ``run_round``)
ROUNDS = 5  # enough for a median that holds within +-25% run to run on a loaded 2-core box


def opencode_body(project: str) -> bytes:
    """A captured OpenCode request body (``A`` or ``B``: two projects, one head)."""
    return resources.files("oc_prefix_cache").joinpath(f"data/opencode_proj{project}.json").read_bytes()


@dataclass(frozen=True)
class Bodies:
    """The two first requests a round sends: both start with the same head."""

    first: bytes  # warms the head (project A's first request)
    other: bytes  # another project's first request: cold, same server and after restart

    @classmethod
    def captured(cls) -> Bodies:
        return cls(first=opencode_body("A"), other=opencode_body("B"))


@dataclass(frozen=True)
class ChatTiming:
    prompt_n: int  # prompt tokens the server processed
    cache_n: int  # prompt tokens it reused from the slot
    prompt_ms: float  # the server's own prefill time
    wall_ms: float  # what the caller waited, up to the first token
    predicted_n: int = 0  # tokens generated (the report needs it to tie the slot to the request)


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
    loopback.raise_for_status(response)
    timings = response.json()["timings"]
    return ChatTiming(
        prompt_n=int(timings["prompt_n"]),
        cache_n=int(timings["cache_n"]),
        prompt_ms=float(timings["prompt_ms"]),
        wall_ms=(time.perf_counter() - started) * 1000,
        predicted_n=int(timings.get("predicted_n", 0)),
    )


def prepare_over_http(http: httpx.Client, daemon_url: str, raw: bytes, session: str) -> dict[str, Any]:
    response = http.post(
        f"{daemon_url}/v1/prepare",
        content=raw,
        timeout=1800,
        headers={"User-Agent": UA, "x-session-id": session, "Content-Type": "application/json"},
    )
    loopback.raise_for_status(response)
    answer: dict[str, Any] = response.json()
    return answer


def report_over_http(http: httpx.Client, daemon_url: str, answer: dict[str, Any], timing: ChatTiming) -> None:
    """The plugin's report after the real request: it ties the slot to the conversation."""
    if answer.get("fingerprint"):
        response = http.post(
            f"{daemon_url}/v1/report",
            timeout=30,
            json={
                "fingerprint": answer["fingerprint"],
                "cache_n": timing.cache_n,
                "prompt_n": timing.prompt_n,
                "prepare_id": answer.get("prepare_id") or "",
                "predicted_n": timing.predicted_n,
            },
        )
        loopback.raise_for_status(response)


# -- numbers a reader can trust ---------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """A median and the range of the samples around it."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no samples")
        return cls(median=statistics.median(values), low=min(values), high=max(values), n=len(values))

    def deviation(self) -> float:
        """The widest sample's distance from the median, as a fraction of it."""
        return max(self.median - self.low, self.high - self.median) / self.median if self.median else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {"median": round(self.median, 3), "low": round(self.low, 3), "high": round(self.high, 3), "n": self.n}


def paired_ratios(base: Sequence[float], arm: Sequence[float]) -> list[float]:
    """``base[i] / arm[i]`` for samples taken side by side (the same round)."""
    if len(base) != len(arm):
        raise ValueError("paired samples must have the same length")
    return [b / a for b, a in zip(base, arm, strict=True)]


def server_threads() -> int:
    """llama-server's threads for the demo and the benches: all cores but one.

    llama.cpp's threads wait for each other at every step, so with one thread per core any
    other work on the machine stalls them all, and long prefills suffer far more than short
    ones: the cold arm's time, and so every ratio, then measures the neighbours. On this
    2-core box under load 5, a cold 7.5k-token prefill took 4.3-8.8 s with 2 threads and
    1.3-2.0 s with 1. The core left over runs the daemon and the client.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(1, cores - 1)


def load_average() -> tuple[float, float, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)
    return (round(one, 2), round(five, 2), round(fifteen, 2))


# -- one round: the four cases back to back ---------------------------------------------------
@dataclass(frozen=True)
class Sample:
    case: str
    round: int
    action: str
    prompt_n: int
    cache_n: int
    prepare_ms: float  # what the plugin waits for the prepare (0 for cold)
    request_ms: float  # the request, to its first token
    prompt_ms: float  # the server's prefill time within the request
    server_pid: int | None  # which llama-server process served it
    task_before: int | None  # the slot's last task id before the sample (None: nothing ever ran there)
    head_tokens: int = 0
    fingerprint: str = ""
    reason: str = ""  # why ocpc did what it did (its answer's reason)

    @property
    def total_ms(self) -> float:
        return self.prepare_ms + self.request_ms


@dataclass(frozen=True)
class Stage:
    """What a round runs on: one llama-server (restarted as the round needs) and a temp dir."""

    http: httpx.Client
    server: LlamaServer
    work: Path
    binary: Path | None = None


def run_round(stage: Stage, index: int, bodies: Bodies, step: Step) -> list[Sample]:
    """First run, same server, cold, after restart: nothing shared with other rounds (a fresh
    ocpc home each round, so the first run warms). Cold and after-restart, the headline's
    two sides, run next to each other, each right after a restart of the server."""
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(stage.work / f"round{index}")})
    restart_fresh(stage.server, slot_dir=settings.slot_dir)
    daemon = Daemon(settings=settings, server_url=stage.server.url, port=0, server_binary=stage.binary)
    daemon.start()
    try:
        step(f"round {index + 1}: first run (ocpc warms the head once)")
        samples = [_prepared(stage, daemon, FIRST, bodies.first, f"ses_{index}_a", index)]
        step(f"round {index + 1}: new session, same server")
        samples.append(_prepared(stage, daemon, SAME, bodies.other, f"ses_{index}_b", index))
        step(f"round {index + 1}: cold (a freshly restarted server, no ocpc)")
        stage.server.restart()
        samples.append(_direct(stage, COLD, bodies.other, index))
        step(f"round {index + 1}: new session after a server restart")
        stage.server.restart()
        samples.append(_prepared(stage, daemon, RESTART, bodies.other, f"ses_{index}_c", index))
    finally:
        daemon.stop()
    return samples


def restart_fresh(server: LlamaServer, *, slot_dir: Path) -> None:
    """Restart ``server`` saving slots to ``slot_dir``: a fresh process, nothing cached anywhere."""
    server.stop()
    server.config = replace(server.config, slot_dir=slot_dir)
    server.start(timeout=600)


def _last_task(stage: Stage) -> int | None:
    """The slot's ``id_task``: absent on a server that never ran a task (a fresh start)."""
    slots = stage.http.get(f"{stage.server.url}/slots", timeout=30).json()
    value = slots[0].get("id_task") if slots else None
    return value if isinstance(value, int) else None


def _direct(stage: Stage, case: str, raw: bytes, index: int) -> Sample:
    before = _last_task(stage)
    timing = timed_chat(stage.http, stage.server.url, raw)
    return Sample(
        case,
        index,
        "-",
        timing.prompt_n,
        timing.cache_n,
        0.0,
        timing.wall_ms,
        timing.prompt_ms,
        stage.server.pid,
        before,
    )


def _prepared(stage: Stage, daemon: Daemon, case: str, raw: bytes, session: str, index: int) -> Sample:
    """One first request the way the plugin sends it: prepare, the request, then the report."""
    before = _last_task(stage)
    started = time.perf_counter()
    answer = prepare_over_http(stage.http, daemon.url, raw, session)
    prepare_ms = (time.perf_counter() - started) * 1000
    timing = timed_chat(stage.http, stage.server.url, raw)
    report_over_http(stage.http, daemon.url, answer, timing)
    return Sample(
        case,
        index,
        str(answer["action"]),
        timing.prompt_n,
        timing.cache_n,
        prepare_ms,
        timing.wall_ms,
        timing.prompt_ms,
        stage.server.pid,
        before,
        head_tokens=int(answer.get("prefix_tokens") or 0),
        fingerprint=str(answer.get("fingerprint") or ""),
        reason=str(answer.get("reason") or ""),
    )


# -- the summary --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One case over every round."""

    case: str
    actions: tuple[str, ...]  # every action seen, in order (one, when the case is deterministic)
    prompt_n: int  # median
    cache_n: int  # median
    total: Spread  # prepare + request, ms
    prepare: Spread
    request: Spread
    vs_cold: Spread  # cold / this case, per round

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "action": "/".join(self.actions),
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "total_ms": self.total.to_json(),
            "prepare_ms": self.prepare.to_json(),
            "request_ms": self.request.to_json(),
            "vs_cold": self.vs_cold.to_json(),
        }


def summarize(samples: Sequence[Sample], cases: Sequence[str] = CASES) -> list[Row]:
    """Per case: medians and ranges over rounds; ratios against cold within each round."""
    by_case = {case: sorted((s for s in samples if s.case == case), key=lambda s: s.round) for case in cases}
    cold = {s.round: s.total_ms for s in by_case[cases[0]]}
    rows = []
    for case in cases:
        runs = [s for s in by_case[case] if s.round in cold]
        if not runs:
            raise ValueError(f"no round has both {cases[0]!r} and {case!r}")
        rows.append(
            Row(
                case=case,
                actions=tuple(dict.fromkeys(s.action for s in runs)),
                prompt_n=round(statistics.median(s.prompt_n for s in runs)),
                cache_n=round(statistics.median(s.cache_n for s in runs)),
                total=Spread.of([s.total_ms for s in runs]),
                prepare=Spread.of([s.prepare_ms for s in runs]),
                request=Spread.of([s.request_ms for s in runs]),
                vs_cold=Spread.of(paired_ratios([cold[s.round] for s in runs], [s.total_ms for s in runs])),
            )
        )
    return rows


@dataclass(frozen=True)
class DemoResult:
    samples: list[Sample]  # in the order they ran
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    threads: int = 0  # llama-server's -t

    def rows(self) -> list[Row]:
        return summarize(self.samples)

    def to_json(self) -> dict[str, Any]:
        rows = self.rows()
        cold, restart = rows[0], rows[-1]
        return {
            "rounds": len({s.round for s in self.samples}),
            "server_threads": self.threads,
            "order": [s.case for s in self.samples],
            "rows": [row.to_json() for row in rows],
            "samples": [asdict(s) | {"total_ms": round(s.total_ms, 3)} for s in self.samples],
            "headline": {
                "case": restart.case,
                "fewer_tokens": round(cold.prompt_n / max(1, restart.prompt_n), 1),
                "speedup": restart.vs_cold.to_json(),
            },
            "load_average": {"start": self.load_start, "end": self.load_end},
        }


def run_demo(
    *,
    binary: Path,
    model: Path,
    step: Step,
    rounds: int = ROUNDS,
    ctx_size: int = 16384,
    extra_args: tuple[str, ...] = (),
) -> DemoResult:
    """``extra_args``: the user's llama-server arguments, after ours (theirs win)."""
    load_start = load_average()
    threads, bodies = server_threads(), Bodies.captured()
    family_args = tuple(arg for flag in family_flags(model_family(str(model))) for arg in flag.args())
    with tempfile.TemporaryDirectory(prefix="ocpc-demo-") as tmp:
        work = Path(tmp)
        config = ServerConfig(
            binary=binary,
            model=model,
            port=free_port(),
            slot_dir=work / "slots",
            ctx_size=ctx_size,
            extra_args=("-t", str(threads), *family_args, *extra_args),
        )
        # not started here: each round starts it fresh (restart_fresh), so a big model loads once per round
        server = LlamaServer(config=config, log_path=work / "llama-server.log")
        step(f"llama-server with {model.name}, started fresh for each round")
        samples: list[Sample] = []
        try:
            with loopback.client() as http:  # one client: no per-call connection set-up in the timings
                stage = Stage(http=http, server=server, work=work, binary=binary)
                for index in range(rounds):
                    samples += run_round(stage, index, bodies, step)
        finally:
            server.stop()
    return DemoResult(samples=samples, load_start=load_start, load_end=load_average(), threads=threads)


def render_demo(data: dict[str, Any], model_name: str, out: Console) -> None:
    """The table and the headline, from ``DemoResult.to_json()``."""
    rounds = data["rounds"]
    table = Table(
        title=f"first request of a new OpenCode session ({model_name})",
        caption=(
            f"median and range of {rounds} rounds; each round runs the four cases back to back, "
            "and vs cold compares within a round"
        ),
    )
    for name in ("case", "ocpc", "prompt tok", "from cache", "ms", "vs cold"):
        table.add_column(name, justify="left" if name in ("case", "ocpc") else "right")
    for row in data["rows"]:
        total, ratio = row["total_ms"], row["vs_cold"]
        table.add_row(
            row["case"],
            row["action"],
            f"{row['prompt_n']:,}",
            f"{row['cache_n']:,}",
            f"{total['median']:,.0f}\n[dim]{total['low']:,.0f}-{total['high']:,.0f}[/dim]",
            f"{ratio['median']:.1f}x\n[dim]{ratio['low']:.1f}-{ratio['high']:.1f}x[/dim]",
        )
    out.print(table)
    head, load = data["headline"], data["load_average"]
    speed = head["speedup"]
    cold, restart = data["rows"][0], data["rows"][-1]
    out.print(
        f"after a server restart: {restart['prompt_n']:,} of {cold['prompt_n']:,} prompt tokens processed, "
        f"{speed['median']:.1f}x faster than cold ({speed['low']:.1f}-{speed['high']:.1f}x over "
        f"{speed['n']} rounds; load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end; "
        f"llama-server -t {data.get('server_threads') or '?'})",
        soft_wrap=True,
    )
