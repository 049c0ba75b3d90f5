"""Warm start after a llama-server router loads a model (router.LoadWatch): the next new session
of that model, with and without it, arms alternated on one router.

The router (``--models-max 1``, ``-np 2``) serves the rig's ``fat-kv`` model (102,400 KV bytes per
token, a 27B's: a restore takes long enough to matter) and the tiny ``qwen3``, which evicts it.
Two sessions of one project first give each fat-kv slot its head and project head on disk. Then,
per round and arm (a fresh proxy per arm: ``RouterProxy(warm_on_load=...)``):

1. **load by a request**: qwen3 evicts fat-kv; a new session of fat-kv loads it again. Its own
   prepare does what it needs (both arms alike: the warm start leaves its slot alone). After a
   pause (the same in both arms), the **next new session** goes to the other slot: with the warm
   start its project head is already there (``hit``); without, its prepare restores it.
2. **load by another client**: qwen3 evicts fat-kv; ``POST /models/load`` loads it (no request);
   after the pause, the **first new session** after that load.

Printed per arm: what the session's prepare did, its prepare (what the proxy adds before the
server starts on the request), the whole request, and the tokens processed and reused.

    .venv/bin/python bench/router_load_bench.py            # fat-kv, 3 rounds
    .venv/bin/python bench/router_load_bench.py --json bench/results/router-load-fatkv.json   # and keep the rows
    .venv/bin/python bench/router_load_bench.py --smoke    # CI: tiny qwen35, 1 round (the mechanics)
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

from oc_prefix_cache import loopback
from oc_prefix_cache.doors.proxy import Bounds, Proxy
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.doors.router import RouterProxy
from oc_prefix_cache.engine.wiring import engine_for_url
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import Supervised, stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.tiny_models import FAT, ensure_model
from oc_prefix_cache.settings import Settings
from tests import workload  # noqa: E402

FLAGS = ("-ub", "512", "--cache-ram", "0", "--metrics", "--ctx-checkpoints", "32", "--checkpoint-min-step", "1024")
PAUSE_S = 6.0  # between the load and the session measured, in both arms
BOUNDS = Bounds(prepare_s=1800.0)  # the setup's first warm of fat-kv's head takes minutes on a busy 2-core machine


class Bench:
    def __init__(self, binary: Path, models: dict[str, Path], work: Path, *, big: str) -> None:
        self.big = big
        folder = work / "models"
        folder.mkdir()
        for name, path in models.items():
            (folder / f"{name}.gguf").symlink_to(path)
        self.settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_HOME": str(work / "home")})
        self.settings.slot_dir.mkdir(parents=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.router = Supervised(
            name="llama-server router",
            argv=[
                str(binary),
                "--models-dir",
                str(folder),
                "--models-max",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-c",
                "65536",
                "-np",
                "2",
                "--slot-save-path",
                str(self.settings.slot_dir),
                *FLAGS,
            ],
            health_url=f"{self.url}/health",
            log_path=work / "router.log",
        )
        self.proxy: ProxyServer | None = None
        self.front: RouterProxy | None = None
        self.n = 0
        self.load_retries = 0  # loads the router refused for a busy model, tried again (``load``)

    def start_proxy(self, *, warm: bool) -> None:
        self.front = RouterProxy(
            settings=self.settings,
            server_url=self.url,
            warm_on_load=warm,
            make=lambda model: Proxy(
                settings=self.settings,
                engine=engine_for_url(self.settings, server_url=self.url, model=model),
                bounds=BOUNDS,
            ),
        )
        self.proxy = ProxyServer(self.front, port=0, watch=True)
        self.proxy.start()

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.proxy = self.front = None

    def session(self, model: str) -> dict[str, Any]:
        """A new session of one project (the same head and project head every time) through the proxy."""
        self.n += 1
        conv = workload.parent(f"ses_{self.n}") if model == self.big else workload.other_project(f"ses_{self.n}")
        conv.body["model"] = model
        conv.body["messages"][-1]["content"] += f" (session {self.n})"
        body = {**conv.next_body(), "max_tokens": 4, "stream": False}
        body.pop("stream_options", None)
        assert self.proxy is not None
        before = len(self._recent(model))
        started = time.perf_counter()
        answer = loopback.post(f"{self.proxy.url}/v1/chat/completions", json=body, headers=conv.headers(), timeout=900)
        request_ms = (time.perf_counter() - started) * 1000
        answer.raise_for_status()
        timings = answer.json()["timings"]
        end = time.monotonic() + 30
        while len(recent := self._recent(model)) <= before and time.monotonic() < end:
            time.sleep(0.1)
        record = recent[-1]
        return {
            "action": f"{record['action']}",
            "slot": record["slot"],
            "prepare_ms": round(record["ready_ms"], 1),
            "request_ms": round(request_ms, 1),
            "prompt_n": timings["prompt_n"],
            "cache_n": timings["cache_n"],
        }

    def _recent(self, model: str) -> list[dict[str, Any]]:
        assert self.proxy is not None
        models = loopback.get(f"{self.proxy.url}/ocpc/status", timeout=10).json()["models"]
        return list(models.get(model, {}).get("recent") or [])

    def evict(self) -> None:
        self.session("qwen3")
        assert self.status()[self.big] == "unloaded"

    def load(self, model: str) -> None:
        """``POST /models/load``, as another client would send it. The router refuses a load with a
        500 "model limit reached, try again later" while the model it would unload has a request in
        flight (b11434's ``pick_victim`` skips a busy model), and ocpc's own look at that model's
        slots, once a second, is such a request. Seen once in a full test run on a loaded machine;
        this client tries again, as the answer says, for up to a minute, and the bench prints how
        often it had to."""
        end = time.monotonic() + 60
        while True:
            answer = loopback.post(f"{self.url}/models/load", json={"model": model}, timeout=300)
            if answer.status_code != 500 or "try again later" not in answer.text or time.monotonic() > end:
                answer.raise_for_status()
                return
            self.load_retries += 1
            time.sleep(0.5)

    def status(self) -> dict[str, str]:
        data = loopback.get(f"{self.url}/models", timeout=10).json()
        return {m["id"]: m["status"]["value"] for m in data["data"]}

    def warm_starts(self) -> int:
        assert self.front is not None
        return int(self.front.proxy_for(self.big).engine.stats.counters.get("warm_start", 0))

    def pause(self, *, warm: bool, before: int, slots: int) -> None:
        """``PAUSE_S`` in both arms; the warm arm also waits (up to 120 s more) for its warm start."""
        started = time.monotonic()
        while warm and self.warm_starts() < before + slots and time.monotonic() - started < PAUSE_S + 120:
            time.sleep(0.1)
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - started)))


def run(bench: Bench, *, rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bench.router.start(timeout=300)
    try:
        bench.start_proxy(warm=False)
        for _ in range(2):  # one session per slot: each slot's head and project head on disk, current
            bench.session(bench.big)
        bench.stop_proxy()
        for i in range(rounds):
            for arm in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                bench.start_proxy(warm=arm == "warm")
                try:
                    bench.evict()
                    before = bench.warm_starts()
                    loader = bench.session(bench.big)
                    bench.pause(warm=arm == "warm", before=before, slots=1)
                    rows.append({"round": i + 1, "arm": arm, "case": "load by a request: that request", **loader})
                    rows.append(
                        {
                            "round": i + 1,
                            "arm": arm,
                            "case": "load by a request: the next session",
                            **bench.session(bench.big),
                        }
                    )
                    bench.evict()
                    before = bench.warm_starts()
                    bench.load(bench.big)
                    while bench.status()[bench.big] != "loaded":
                        time.sleep(0.1)
                    bench.pause(warm=arm == "warm", before=before, slots=2)
                    rows.append(
                        {
                            "round": i + 1,
                            "arm": arm,
                            "case": "load by another client: the first session",
                            **bench.session(bench.big),
                        }
                    )
                finally:
                    bench.stop_proxy()
    finally:
        bench.stop_proxy()
        bench.router.stop()
    return rows


def render(rows: list[dict[str, Any]], model: str) -> None:
    print(f"model {model} behind a router (--models-max 1, -np 2); qwen3 evicts it")
    print(
        f"{'round':>5} {'arm':<5} {'case':<44} {'action':<9} {'prepare ms':>10} {'request ms':>10} "
        f"{'processed':>9} {'reused':>7}"
    )
    for r in rows:
        print(
            f"{r['round']:>5} {r['arm']:<5} {r['case']:<44} {r['action']:<9} {r['prepare_ms']:>10.0f} "
            f"{r['request_ms']:>10.0f} {r['prompt_n']:>9,} {r['cache_n']:>7,}"
        )
    for case in dict.fromkeys(r["case"] for r in rows):
        med = {
            arm: {
                k: statistics.median(r[k] for r in rows if r["arm"] == arm and r["case"] == case)
                for k in ("prepare_ms", "request_ms")
            }
            for arm in ("cold", "warm")
        }
        print(
            f"median, {case}: prepare cold {med['cold']['prepare_ms']:.0f} ms, warm {med['warm']['prepare_ms']:.0f} ms;"
            f" request cold {med['cold']['request_ms']:.0f} ms, warm {med['warm']['request_ms']:.0f} ms "
            f"({med['cold']['request_ms'] / max(med['warm']['request_ms'], 1e-9):.2f}x)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: one round on the tiny qwen35")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rig = ensure_rig(Settings.from_env())
    big = "qwen35" if args.smoke else FAT.name
    models = {big: ensure_model(rig, big), "qwen3": ensure_model(rig, "qwen3")}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="ocpc-router-load-") as work:
        bench = Bench(rig.server, models, Path(work), big=big)
        rows = run(bench, rounds=1 if args.smoke else args.rounds)
    render(rows, big)
    if bench.load_retries:
        print(f'the router refused {bench.load_retries} loads for a busy model ("try again later"): tried again')
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    warm = [r for r in rows if r["arm"] == "warm" and "that request" not in r["case"]]
    return 0 if all(r["action"] == "hit" for r in warm) else 1  # the mechanics: the warm arm's sessions hit


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
