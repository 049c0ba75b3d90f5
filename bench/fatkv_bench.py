"""Real sizes: what parking costs on a model with a 27B's KV bytes per token, park at
displacement against park ahead, arms alternated.

The model is the rig's ``fat-kv`` (rig/tiny_models.py: 102,400 bytes per token, as a 27B's
~880 MB 8.6k-token head). Each arm is its own llama-server (`-c 32768 -ub 512
--cache-ram 0`, so only ocpc's files bring a conversation back) driven the way the plugin
drives one:

1. the parent conversation grows for ``--turns`` turns (OpenCode's head, then ~1.6k-token
   tool results);
2. a tool gap (``ahead.IDLE_S``; the watch runs, as the daemon's does every second);
3. a subagent's first request displaces the parent: **the latency ocpc adds to it** (its
   prepare) is where a synchronous park lands;
4. the parent comes back: its park is restored (from the page cache);
5. another gap and displacement, then the parent's park is evicted from the page cache
   (posix_fadvise DONTNEED) and the parent comes back: a restore from a cold file.

Arms: ``sync`` (OC_PREFIX_CACHE_PARK_AHEAD_S=off: parked when displaced, the behaviour
before park-ahead) and ``ahead`` (the default, 1 s). Also printed: the park's size, the
bytes per token, and the default disk caps counted in parks and heads at 27B sizes.

    .venv/bin/python bench/fatkv_bench.py               # 3 parent turns (~10.6k tokens, ~1.1 GB park)
    .venv/bin/python bench/fatkv_bench.py --smoke       # CI: 1 turn, on the tiny qwen3 (the mechanics only)
    .venv/bin/python bench/fatkv_bench.py --json bench/results/fatkv-NAME.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache.engine import park_ahead as ahead
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.tiny_models import FAT, ensure_model
from oc_prefix_cache.settings import Settings
from tests import workload  # noqa: E402
from tests.rig.engine.test_parking import Turns  # noqa: E402

FLAGS = ("-ub", "512", "--cache-ram", "0", "--metrics")
HEAD_TOKENS_27B = 8_600  # the 27B head
CONVERSATION_TOKENS_27B = 30_000


@dataclass
class Arm:
    name: str
    server: LlamaServer
    turns: Turns
    parent: workload.Conversation
    sub: workload.Conversation
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def turn(self, label: str, conv: workload.Conversation) -> None:
        started = time.perf_counter()
        result, timings = self.turns.turn(conv)
        park = re.search(r"parked the slot's conversation first \((\d+) tokens in (\d+) ms\)", result.reason)
        restore = re.search(r"restored the parked conversation (?:and gated )?in (\d+) ms", result.reason)
        self.rows[label] = {
            "action": f"{result.action}/{result.source or '-'}",
            "prepare_ms": result.elapsed_ms,
            "wall_ms": (time.perf_counter() - started) * 1000,
            "prompt_n": timings.prompt_n,
            "cache_n": timings.cache_n,
            "park_ms": float(park.group(2)) if park else 0.0,
            "restore_ms": float(restore.group(1)) if restore else None,
        }

    def gap(self) -> None:
        time.sleep(ahead.IDLE_S)
        started = time.perf_counter()
        self.turns.engine.watch()
        self.rows.setdefault("watch_ms", {"ms": 0.0})["ms"] += (time.perf_counter() - started) * 1000

    def evict_parent_park(self) -> None:
        for path in self.turns.settings.slot_dir.glob("oc-conv-*.bin"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def park_bytes(self) -> tuple[int, int]:
        index = self.turns.engine.store.load()
        parks = [e for e in index.entries.values() if e.kind == "conv" and e.session == self.parent.session]
        return (parks[0].bytes, parks[0].prefix_tokens) if parks else (0, 0)


def make_arm(name: str, binary: Path, model: Path, work: Path) -> Arm:
    env = {**os.environ, "OC_PREFIX_CACHE_HOME": str(work / name)}
    if name == "sync":
        env["OC_PREFIX_CACHE_PARK_AHEAD_S"] = "off"
    settings = Settings.from_env(env)
    config = ServerConfig(
        binary=binary, model=model, port=free_port(), slot_dir=settings.slot_dir, ctx_size=32768, extra_args=FLAGS
    )
    server = LlamaServer(config=config, log_path=work / f"{name}.log")
    server.start()
    return Arm(name, server, Turns(server.url, settings), workload.parent(), workload.general_subagent("ses_sub"))


def run(binary: Path, model: Path, work: Path, *, turns: int) -> dict[str, Any]:
    arms = [make_arm(name, binary, model, work) for name in ("sync", "ahead")]
    try:
        steps: list[tuple[str, Any]] = [(f"parent {i + 1}", "parent") for i in range(turns)]
        steps += [
            ("gap", None),
            ("subagent displaces", "sub"),
            ("gap", None),
            ("parent back (hot)", "parent"),
            ("gap", None),
            ("subagent again", "sub"),
            ("gap", None),
            ("evict", None),
            ("parent back (cold)", "parent"),
        ]
        for i, (label, who) in enumerate(steps):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                if label == "gap":
                    arm.gap()
                elif label == "evict":
                    arm.evict_parent_park()
                else:
                    arm.turn(label, arm.parent if who == "parent" else arm.sub)
        return {
            arm.name: {"rows": arm.rows, "park": arm.park_bytes(), "counters": dict(arm.turns.engine.stats.counters)}
            for arm in arms
        }
    finally:
        for arm in arms:
            arm.turns.close()
            arm.server.stop()


def render(results: dict[str, Any]) -> None:
    sync, ahead_ = results["sync"], results["ahead"]
    size, tokens = sync["park"]
    per_token = size / tokens if tokens else 0
    print(
        f"fat-kv: {FAT.kv_bytes_per_token:,} KV bytes per token by shape; the parent's park: {tokens:,} tokens, "
        f"{size / 1e9:.2f} GB ({per_token:,.0f} bytes per token on disk)"
    )
    print(
        "per step: ocpc's action, its prepare (ms; what the request waits for), of which parking the slot's "
        "conversation first and restoring a park"
    )
    print(
        f"{'step':<20} {'sync: action':<15} {'prepare':>8} {'park':>6} {'restore':>7}   "
        f"{'ahead: action':<15} {'prepare':>8} {'park':>6} {'restore':>7}"
    )

    def cells(row: dict[str, Any]) -> str:
        restore = "" if row["restore_ms"] is None else f"{row['restore_ms']:.0f}"
        return f"{row['action']:<15} {row['prepare_ms']:>8.0f} {row['park_ms']:>6.0f} {restore:>7}"

    for label in sync["rows"]:
        if label != "watch_ms":
            print(f"{label:<20} {cells(sync['rows'][label])}   {cells(ahead_['rows'][label])}")
    print(
        f"watch (parks written ahead, off the request path): "
        f"sync {sync['rows'].get('watch_ms', {}).get('ms', 0):.0f} ms, "
        f"ahead {ahead_['rows'].get('watch_ms', {}).get('ms', 0):.0f} ms; parked ahead: "
        f"{ahead_['counters'].get('parked_ahead', 0)}"
    )
    displacing = [label for label in sync["rows"] if label.startswith("subagent")]
    for who, arm in (("sync", sync), ("ahead", ahead_)):
        waits = ", ".join(f"{arm['rows'][label]['park_ms']:.0f} ms" for label in displacing)
        print(f"parking the parent at displacement ({who}): {waits} added to the displacing requests")
    if per_token:
        head, conv = HEAD_TOKENS_27B * per_token, CONVERSATION_TOKENS_27B * per_token
        caps = Settings.from_env({})
        print(
            f"at 27B sizes: a {HEAD_TOKENS_27B:,}-token head is {head / 1e9:.2f} GB, "
            f"a {CONVERSATION_TOKENS_27B:,}-token "
            f"park {conv / 1e9:.2f} GB; the default caps hold {(caps.max_gb or 0) * 1e9 / head:.0f} heads "
            f"({caps.max_gb:g} GB) and {(caps.park_max_gb or 0) * 1e9 / conv:.1f} parks ({caps.park_max_gb:g} GB)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: one parent turn on the tiny qwen3")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rig = ensure_rig(Settings.from_env())
    model = ensure_model(rig, "qwen3" if args.smoke else FAT.name)
    with tempfile.TemporaryDirectory(prefix="ocpc-fatkv-") as work:
        results = run(rig.server, model, Path(work), turns=1 if args.smoke else args.turns)
    render(results)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
