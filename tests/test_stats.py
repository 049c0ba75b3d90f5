"""`ocpc stats`: what the cache saved, from its event log; checked against the server's own /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.events import Event, EventLog, read_events
from oc_prefix_cache.proxy import Proxy
from oc_prefix_cache.proxy_server import ProxyServer, build_preparer
from oc_prefix_cache.settings import Settings
from oc_prefix_cache.slot_client import SlotClient
from oc_prefix_cache.stats import summarise, total

from .test_e2e_claude_code import END_AT_ONCE
from .test_proxy import capture

DATA = Path(__file__).parent / "data"


def event(**kw: Any) -> Event:
    base: dict[str, Any] = {"at": time.time(), "door": "proxy", "server": "http://s", "slot": 0, "harness": "pi",
                            "action": "hit", "source": "slot", "cache_n": 0, "prompt_n": 0, "prompt_ms": None}
    return Event(**{**base, **kw})


def test_only_what_ocpc_restored_counts_as_saved_and_its_own_prefill_is_a_cost() -> None:
    stats = summarise([
        event(action="warmed", source="", cache_n=0, prompt_n=8000, prompt_ms=8000.0),  # 1000 tok/s
        event(action="restored", source="head", cache_n=7000, prompt_n=100, prompt_ms=100.0),
        event(action="hit", source="slot", cache_n=7100, prompt_n=50),  # plain llama-server has this too
        event(action="restored", source="ram", cache_n=6000, prompt_n=10),  # the server's own RAM cache
        event(door="ocpc", harness="ocpc", action="prefill", source="", cache_n=7000, prompt_n=2000, prompt_ms=2000.0),
    ])
    rows = {r.harness: r for r in stats.rows}
    assert rows["pi"].requests == 4 and rows["pi"].reused == 20100 and rows["pi"].saved == 7000
    assert rows["pi"].processed == 8160 and rows["pi"].saved_s == pytest.approx(7.0)
    assert rows["ocpc"].ocpc_prefill == 2000 and rows["ocpc"].saved_s == pytest.approx(-2.0)
    assert stats.speed_tok_s == {"http://s": pytest.approx(1000.0)}
    assert total(stats.rows).saved_s == pytest.approx(5.0)


def test_the_event_log_is_bounded_and_skips_lines_it_cannot_read(tmp_path: Path) -> None:
    log = EventLog(tmp_path, max_bytes=2000)
    for i in range(100):
        log.write(event(cache_n=i))
    with open(tmp_path / "events.jsonl", "a") as out:
        out.write('{"cut by a cra\n{"at": 1, "door": 7}\n')
    kept = list(read_events(tmp_path))
    assert sum(p.stat().st_size for p in tmp_path.glob("events.jsonl*")) <= 2 * 2000 + 100
    assert 0 < len(kept) < 100 and kept[-1].cache_n == 99  # the newest kept, in order


@pytest.mark.rig
def test_stats_match_the_servers_own_metrics_over_a_replayed_session(llama_server: Any, tmp_path: Path) -> None:
    """pi's captured requests through the proxy: a first session (warms the head), its next turn,
    a second session (restored head). Every prompt token the server counts in /metrics, processed
    or reused, is in the event log: the requests' and ocpc's own."""
    server = llama_server("qwen35", ctx_size=16384, extra_args=("--metrics", *END_AT_ONCE))
    home = tmp_path / "ocpc"
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(home)})
    client = SlotClient(server.url)
    before = client.metrics()
    assert before is not None, "the server runs with --metrics"
    proxy = ProxyServer(Proxy(settings=settings, preparer=build_preparer(settings, server_url=server.url)), port=0)
    proxy.start()
    try:
        for name in ("A1", "A2-continue", "A2"):
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.text[:300]
        deadline = time.monotonic() + 10
        while len([e for e in read_events(settings.log_dir) if e.door == "proxy"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the report is written after the answer, in a worker
    finally:
        proxy.stop()
    after = client.metrics()
    assert after is not None
    events = list(read_events(settings.log_dir))
    processed = after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
    assert sum(e.prompt_n for e in events) == processed, events
    png = tmp_path / "stats.png"
    out = subprocess.run([sys.executable, "-m", "oc_prefix_cache", "stats", "--json", "--png", str(png)],
                         capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OC_PREFIX_CACHE_HOME": str(home)})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart of the day
    data = json.loads(out.stdout)
    pi = [r for r in data["rows"] if r["harness"].startswith("pi")]
    assert pi and pi[0]["requests"] == 3 and pi[0]["saved"] > 0, data
    assert data["total"]["processed"] + data["total"]["ocpc_prefill"] == processed, (data, processed)
    print(json.dumps(data["total"]), processed)
