"""Warm before the first request: the first request of a new session after a server restart,
with and without the warm start (``Engine.warm_start``, what ``ocpc launch`` runs when it
starts a server), arms alternated on one server.

The model is the rig's ``fat-kv`` (102,400 KV bytes per token, a 27B's): there a restore takes
long enough to matter. One conversation (OpenCode's head and project) warms the head and the
project head once; then, per round and arm, the server restarts and a fresh Engine (a new
``ocpc launch``) meets a new session of that project:

- ``cold``: the first request restores the project head itself (its prepare waits for it);
- ``warm``: the warm start restores it first, while no request waits; the first request's
  prepare finds it in the slot (``hit``).

Printed per arm: the first request's prepare (what ocpc adds before the server starts on the
request), the whole request (prepare + the server's answer), the tokens the server processed,
and the warm start's own time (spent before the request came).

    .venv/bin/python bench/warmstart_bench.py            # fat-kv, 3 rounds
    .venv/bin/python bench/warmstart_bench.py --json bench/results/warmstart-fatkv.json   # and keep the rows
    .venv/bin/python bench/warmstart_bench.py --smoke    # CI: tiny qwen3, 1 round (the mechanics only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.tiny_models import FAT, ensure_model
from oc_prefix_cache.settings import Settings
from tests import workload  # noqa: E402
from tests.rig.engine.test_parking import Turns  # noqa: E402

FLAGS = ("-ub", "512", "--cache-ram", "0", "--metrics")


def run(binary: Path, model: Path, work: Path, *, rounds: int) -> list[dict[str, Any]]:
    settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_HOME": str(work / "home")})
    server = LlamaServer(
        config=ServerConfig(
            binary=binary, model=model, port=free_port(), slot_dir=settings.slot_dir, ctx_size=32768, extra_args=FLAGS
        ),
        log_path=work / "server.log",
    )
    server.start()
    rows: list[dict[str, Any]] = []
    try:
        first = Turns(server.url, settings)
        first.turn(workload.parent("ses_first"))  # warms the head, saves it and the project head
        first.close()
        for i in range(rounds):
            for arm in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                server.restart()
                turns = Turns(server.url, settings)
                try:
                    warm_ms, said = None, []
                    if arm == "warm":
                        started = time.perf_counter()
                        said = turns.engine.warm_start(deadline=Deadline.after(300))
                        warm_ms = (time.perf_counter() - started) * 1000
                    started = time.perf_counter()
                    result, timings = turns.turn(workload.parent(f"ses_{arm}_{i}"))
                    rows.append(
                        {
                            "round": i + 1,
                            "arm": arm,
                            "action": f"{result.action}/{result.source or '-'}",
                            "prepare_ms": round(result.elapsed_ms, 1),
                            "request_ms": round((time.perf_counter() - started) * 1000, 1),
                            "prompt_n": timings.prompt_n,
                            "cache_n": timings.cache_n,
                            "warm_start_ms": None if warm_ms is None else round(warm_ms, 1),
                            "said": said,
                        }
                    )
                finally:
                    turns.close()
    finally:
        server.stop()
    return rows


def render(rows: list[dict[str, Any]], model: str) -> None:
    print(f"model {model}; the first request of a new session after a server restart")
    print(
        f"{'round':>5} {'arm':<5} {'action':<14} {'prepare ms':>10} {'request ms':>10} {'processed':>9} "
        f"{'reused':>7} {'warm start ms':>13}"
    )
    for r in rows:
        warm = "" if r["warm_start_ms"] is None else f"{r['warm_start_ms']:.0f}"
        print(
            f"{r['round']:>5} {r['arm']:<5} {r['action']:<14} {r['prepare_ms']:>10.0f} {r['request_ms']:>10.0f} "
            f"{r['prompt_n']:>9,} {r['cache_n']:>7,} {warm:>13}"
        )
    median = {arm: statistics.median(r["request_ms"] for r in rows if r["arm"] == arm) for arm in ("cold", "warm")}
    prepare = {arm: statistics.median(r["prepare_ms"] for r in rows if r["arm"] == arm) for arm in ("cold", "warm")}
    print(
        f"median first request: cold {median['cold']:.0f} ms, warm {median['warm']:.0f} ms "
        f"({median['cold'] / max(median['warm'], 1e-9):.2f}x); its prepare: cold {prepare['cold']:.0f} ms, "
        f"warm {prepare['warm']:.0f} ms"
    )
    for line in next((r["said"] for r in rows if r["said"]), []):
        print(f"warm start said: {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: one round on the tiny qwen3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rig = ensure_rig(Settings.from_env())
    name = "qwen3" if args.smoke else FAT.name
    model = ensure_model(rig, name)
    with tempfile.TemporaryDirectory(prefix="ocpc-warmstart-") as work:
        rows = run(rig.server, model, Path(work), rounds=1 if args.smoke else args.rounds)
    render(rows, name)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not args.smoke:
        return 0
    warm = [r for r in rows if r["arm"] == "warm"]
    return 0 if all(r["action"].startswith("hit") for r in warm) else 1  # the smoke checks the mechanics


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
