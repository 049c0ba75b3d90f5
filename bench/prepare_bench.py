"""Benchmark the prepare path side by side, in one run, on the real rig.

For each model: a new session's first request with no ocpc (cold), with ocpc on its
first ever run (warmed: cold plus the save), on the same server (hit), and after a
server restart (restored); each with prompt_n, cache_n and wall time. Then the daemon's
own cost on the hit path: prepare latency p50/p99 over N calls, over HTTP and in-process.

    .venv/bin/python bench/prepare_bench.py            # full run, both tiny models
    .venv/bin/python bench/prepare_bench.py --smoke    # CI: short, proves it still runs
    .venv/bin/python bench/prepare_bench.py --model-path M.gguf --server-bin ./llama-server

Prints a table and, with --json FILE, writes the numbers as JSON.
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

import httpx
from rich.console import Console
from rich.table import Table

from oc_prefix_cache.daemon import Daemon
from oc_prefix_cache.demo import timed_chat
from oc_prefix_cache.llama_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.prepare import Preparer
from oc_prefix_cache.rig import ensure_rig
from oc_prefix_cache.settings import Settings
from oc_prefix_cache.slot_client import SlotClient
from oc_prefix_cache.store import Store
from oc_prefix_cache.tinymodels import ensure_model

CAPTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "opencode-1.18.33"
UA = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"
PROJ_A, PROJ_B = "02_projA_turn1_main_request.json", "03_projB_turn1_main_request.json"
TURN2 = "04_projA_turn2_main_request.json"
COLD, FIRST, SAME, RESTART = "cold (no ocpc)", "first run", "same server", "after restart"


SIZE = "8k"  # set per run by main(): which head size the bodies are scaled to


def body(name: str) -> bytes:
    return scaled((CAPTURES / name).read_bytes(), SIZE)


def scaled(raw: bytes, size: str) -> bytes:
    """The captured request with its head scaled: ~2k (two tools), ~8k (as captured,
    7.1k), ~16k (the tools repeated under new names, as with many MCP servers)."""
    if size == "8k":
        return raw
    data = json.loads(raw)
    tools = data["tools"]
    if size == "2k":
        data["tools"] = tools[:2]
    elif size == "16k":
        extra = [json.loads(json.dumps(t)) for t in tools + tools[: len(tools) // 2]]
        for i, tool in enumerate(extra):
            tool["function"]["name"] += f"_mcp{i}"
        data["tools"] = tools + extra
    else:
        raise SystemExit(f"--sizes takes 2k, 8k, 16k; not {size!r}")
    return json.dumps(data, separators=(",", ":")).encode()


def real_request(http: httpx.Client, url: str, name: str) -> dict[str, float]:
    """Send the captured OpenCode request as OpenCode does; return its cost."""
    timing = timed_chat(http, url, body(name))
    return {"prompt_n": timing.prompt_n, "cache_n": timing.cache_n, "prompt_ms": timing.prompt_ms,
            "request_ms": timing.wall_ms}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_model(label: str, binary: Path, model: Path, work: Path, calls: int) -> dict[str, Any]:
    os.environ["OC_PREFIX_CACHE_HOME"] = str(work / label)
    port = free_port()
    settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_BASE_URL": f"http://127.0.0.1:{port}"})
    server = LlamaServer(config=ServerConfig(binary=binary, model=model, port=port, slot_dir=settings.slot_dir,
                                             ctx_size=32768), log_path=work / f"{label}-server.log")
    rows: dict[str, Any] = {}
    server.start()
    http = httpx.Client()  # one client: no per-call connection set-up in the timings
    try:
        rows[COLD] = real_request(http, server.url, PROJ_A) | {"action": "-"}
        server.restart()
        client = SlotClient(server.url)
        preparer = Preparer(settings=settings, client=client,
                            store=Store(index_path=settings.index_path, lock_path=settings.lock_path))
        headers = {"User-Agent": UA, "x-session-id": "ses_a"}
        for case, name, session, restart, expected in (
            (FIRST, PROJ_A, "ses_a", False, {"warmed"}),
            # hybrid: A's turn left the slot past the head, so a new session restores (ms)
            (SAME, PROJ_B, "ses_b", False, {"hit", "restored"}),
            (RESTART, PROJ_B, "ses_c", True, {"restored"}),
        ):
            if restart:
                server.restart()
            result = preparer.prepare(body(name), {**headers, "x-session-id": session})
            assert result.action in expected, result
            row = real_request(http, server.url, name)
            row.update(action=result.action, prepare_ms=result.elapsed_ms,
                       total_ms=result.elapsed_ms + row["request_ms"], head_tokens=result.prefix_tokens)
            rows[case] = row
        restore = client.restore(0, f"oc-prefix-{result.fingerprint}.bin")["timings"]["restore_ms"]
        rows[RESTART]["server_restore_ms"] = restore
        # The target compares server work: our prepare (which includes the restore) plus
        # the tail's prefill, against 2 x (the bare restore + the same tail prefill).
        rows[RESTART]["ocpc_ms"] = rows[RESTART]["prepare_ms"] + rows[RESTART]["prompt_ms"]
        rows[RESTART]["target_ms"] = 2 * (restore + rows[RESTART]["prompt_ms"])
        rows["hit_latency"] = hit_latency(settings, server.url, calls)
        client.close()
    finally:
        http.close()
        server.stop()
    return rows


def hit_latency(settings: Settings, url: str, calls: int) -> dict[str, float]:
    """Prepare latency of a later turn (the hit path), over HTTP and in-process."""
    runner = Daemon(settings=settings, server_url=url, port=0)
    runner.start()
    try:
        headers = {"User-Agent": UA, "x-session-id": "ses_lat", "Content-Type": "application/json"}
        first = httpx.post(f"{runner.url}/v1/prepare", content=body(PROJ_A), headers=headers, timeout=900).json()
        assert first["action"] in ("hit", "restored", "warmed"), first
        turn2 = body(TURN2)
        http_ms, inproc_ms = [], []
        with httpx.Client() as session:
            for _ in range(calls):
                started = time.perf_counter()
                answer = session.post(f"{runner.url}/v1/prepare", content=turn2, headers=headers).json()
                http_ms.append((time.perf_counter() - started) * 1000)
                assert answer["action"] == "hit", answer
        for _ in range(calls):
            started = time.perf_counter()
            result = runner.preparer.prepare(turn2, headers)
            inproc_ms.append((time.perf_counter() - started) * 1000)
            assert result.action == "hit"
    finally:
        runner.stop()
    return {"calls": calls, "http_p50_ms": statistics.median(http_ms), "http_p99_ms": percentile(http_ms, 0.99),
            "inproc_p50_ms": statistics.median(inproc_ms), "inproc_p99_ms": percentile(inproc_ms, 0.99)}


def render(results: dict[str, dict[str, Any]], console: Console) -> None:
    for label, rows in results.items():
        cold = rows[COLD]
        table = Table(title=f"{label}: first request of a new session (OpenCode capture)")
        for column in ("case", "action", "prompt_n", "cache_n", "prepare ms", "request ms", "total ms", "vs cold"):
            table.add_column(column, justify="left" if column in ("case", "action") else "right")
        for case in (COLD, FIRST, SAME, RESTART):
            row = rows[case]
            total = row.get("total_ms", row["request_ms"])
            ratio = cold["request_ms"] / total
            table.add_row(case, row["action"], str(row["prompt_n"]), str(row["cache_n"]),
                          f"{row.get('prepare_ms', 0):.1f}", f"{row['request_ms']:.1f}", f"{total:.1f}",
                          f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower")
        console.print(table)
        restored, lat = rows[RESTART], rows["hit_latency"]
        console.print(
            f"head {restored['head_tokens']} tokens; after restart: prepare + tail prefill "
            f"{restored['ocpc_ms']:.1f} ms vs target 2 x (server restore {restored['server_restore_ms']:.1f} ms"
            f" + tail prefill {restored['prompt_ms']:.1f} ms) = {restored['target_ms']:.1f} ms "
            f"({'met' if restored['ocpc_ms'] <= restored['target_ms'] else 'MISSED'})\n"
            f"hit-path prepare (a later turn) over {lat['calls']} calls: HTTP p50 {lat['http_p50_ms']:.2f} ms, "
            f"p99 {lat['http_p99_ms']:.2f} ms; in-process p50 {lat['inproc_p50_ms']:.2f} ms, "
            f"p99 {lat['inproc_p99_ms']:.2f} ms\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="short run for CI")
    parser.add_argument("--models", default="qwen35,qwen3", help="tiny models to run")
    parser.add_argument("--model-path", type=Path, help="a model of your own (with --server-bin)")
    parser.add_argument("--server-bin", type=Path, help="your llama-server binary")
    parser.add_argument("--calls", type=int, default=200, help="hit-path prepare calls")
    parser.add_argument("--sizes", default="2k,8k,16k", help="head sizes: 2k, 8k (as captured), 16k")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    targets: dict[str, tuple[Path, Path]] = {}
    if args.model_path:
        targets[args.model_path.name] = (args.server_bin or rig.server, args.model_path)
    else:
        for name in args.models.split(","):
            targets[name] = (rig.server, ensure_model(rig, name))
    calls = 20 if args.smoke else args.calls
    sizes = ["8k"] if args.smoke else args.sizes.split(",")
    results: dict[str, dict[str, Any]] = {}
    global SIZE
    with tempfile.TemporaryDirectory(prefix="ocpc-bench-") as work:
        for label, (binary, model) in targets.items():
            for SIZE in sizes:
                results[f"{label} head~{SIZE}"] = bench_model(f"{label}-{SIZE}", binary, model, Path(work), calls)
    render(results, Console())
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
