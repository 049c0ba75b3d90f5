"""`ocpc stats`: what the cache saved, from its event log; checked against the server's own /metrics."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.stats import bars, gather, summarise, total
from oc_prefix_cache.disk.events import Event, EventLog, read_events
from oc_prefix_cache.doors.proxy import Proxy
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.engine.wiring import engine_for_url
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.settings import Settings
from tests.e2e.test_e2e_claude_code import END_AT_ONCE
from tests.helpers import DATA, SUITE_WAIT_S
from tests.unit.doors.test_proxy import capture


def event(**kw: Any) -> Event:
    base: dict[str, Any] = {
        "at": time.time(),
        "door": "proxy",
        "server": "http://s",
        "slot": 0,
        "harness": "pi",
        "action": "hit",
        "source": "slot",
        "cache_n": 0,
        "prompt_n": 0,
        "prompt_ms": None,
    }
    return Event(**{**base, **kw})


def test_only_what_ocpc_restored_counts_as_saved_and_its_own_prefill_is_a_cost() -> None:
    stats = summarise(
        [
            event(action="warmed", source="", cache_n=0, prompt_n=8000, prompt_ms=8000.0),  # 1000 tok/s
            event(action="restored", source="head", cache_n=7000, prompt_n=100, prompt_ms=100.0),
            event(action="hit", source="slot", cache_n=7100, prompt_n=50),  # plain llama-server has this too
            event(action="restored", source="ram", cache_n=6000, prompt_n=10),  # the server's own RAM cache
            event(
                door="ocpc", harness="ocpc", action="prefill", source="", cache_n=7000, prompt_n=2000, prompt_ms=2000.0
            ),
        ]
    )
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
    proxy = ProxyServer(Proxy(settings=settings, engine=engine_for_url(settings, server_url=server.url)), port=0)
    proxy.start()
    try:
        for name in ("A1", "A2-continue", "A2"):
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = loopback.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.text[:300]
        deadline = time.monotonic() + SUITE_WAIT_S
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
    out = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", "stats", "--json", "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "OC_PREFIX_CACHE_HOME": str(home)},
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart of the day
    data = json.loads(out.stdout)
    pi = [r for r in data["rows"] if r["harness"].startswith("pi")]
    assert pi and pi[0]["requests"] == 3 and pi[0]["saved"] > 0, data
    assert data["total"]["processed"] + data["total"]["ocpc_prefill"] == processed, (data, processed)
    print(json.dumps(data["total"]), processed)


def _local(day: dt.date, hour: int, minute: int = 0, second: int = 0) -> float:
    return dt.datetime(day.year, day.month, day.day, hour, minute, second).timestamp()


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is Europe/Berlin (daylight saving from 29 March 2026) in this process."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_week_across_a_daylight_saving_change_is_seven_local_dates(berlin: None, tmp_path: Path) -> None:
    """The range starts at local midnight seven dates back, not 7 x 86,400 s back: on the day after
    the clocks moved, that was 23:00 of the eighth day, whose late requests then counted."""
    now = _local(dt.date(2026, 3, 30), 12)
    log = EventLog(tmp_path)
    log.write(event(at=_local(dt.date(2026, 3, 23), 23, 30), source="head", cache_n=500))  # the 8th day back
    log.write(event(at=_local(dt.date(2026, 3, 24), 0, 30), source="head", cache_n=700))  # the 7th
    log.write(event(at=_local(dt.date(2026, 3, 29), 3, 30), source="head", cache_n=900))  # after the change
    stats = gather(tmp_path, days=7, now=now)
    assert [(r.day, r.saved) for r in stats.rows] == [("2026-03-24", 700), ("2026-03-29", 900)]
    assert stats.days == (
        "2026-03-24",
        "2026-03-25",
        "2026-03-26",
        "2026-03-27",
        "2026-03-28",
        "2026-03-29",
        "2026-03-30",
    )


def test_stats_over_several_days_of_a_rolled_over_log(tmp_path: Path) -> None:
    """Several days written through the real event writer (past timestamps), rolled over twice: the
    per-day buckets follow local dates, the older generation's days are counted, the dropped one's
    are gone and the output says from when the log holds events; --json and the PNG agree."""
    home = tmp_path / "ocpc"
    folder = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(home)}).log_dir
    today = dt.date.today()
    plan = [  # (days back, hour, minute, second, harness, source, cache_n, prompt_n)
        (9, 12, 0, 0, "pi", "head", 111, 10),  # rolled out with the first generation
        (5, 9, 0, 0, "pi", "head", 4000, 100),
        (5, 23, 59, 30, "claude-cli", "park", 3000, 50),
        (4, 0, 0, 30, "claude-cli", "slot", 8000, 40),  # 60 s later, but the next local date
        (2, 15, 0, 0, "pi", "proj", 6000, 200),
    ]
    size = len(json.dumps(event().to_json(), separators=(",", ":"))) + 1
    log = EventLog(folder, max_bytes=3 * size + size // 2)  # three lines per generation
    written = []
    for back, hour, minute, second, harness, source, cache_n, prompt_n in plan:
        at = _local(today - dt.timedelta(days=back), hour, minute, second)
        for _ in range(3 if back == 9 else 1):
            written.append(event(at=at, harness=harness, source=source, cache_n=cache_n, prompt_n=prompt_n))
            log.write(written[-1])
    log.write(
        event(
            at=time.time() - 1, door="ocpc", harness="ocpc", action="prefill", source="", prompt_n=300, prompt_ms=300.0
        )
    )
    assert (folder / "events.jsonl.1").exists()
    assert all(e.cache_n != 111 for e in read_events(folder))  # the oldest generation was dropped
    png = tmp_path / "week.png"
    out = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", "stats", "--days", "7", "--json", "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "OC_PREFIX_CACHE_HOME": str(home)},
    )
    data = json.loads(out.stdout)

    def day(back: int) -> str:
        return (today - dt.timedelta(days=back)).isoformat()

    assert [(r["day"], r["harness"], r["requests"], r["saved"]) for r in data["rows"]] == [
        (day(5), "claude-cli", 1, 3000),
        (day(5), "pi", 1, 4000),
        (day(4), "claude-cli", 1, 0),
        (day(2), "pi", 1, 6000),
        (day(0), "ocpc", 0, 0),
    ]
    assert [d["day"] for d in data["days"]] == [day(back) for back in range(6, -1, -1)]  # quiet days too
    by_day = {d["day"]: d for d in data["days"]}
    assert by_day[day(6)]["requests"] == 0 and by_day[day(5)]["reused"] == 7000 and by_day[day(4)]["reused"] == 8000
    assert by_day[day(0)]["ocpc_prefill"] == 300
    assert data["total"]["saved"] == 13000 and data["total"]["processed"] == 390
    kept = min(e.at for e in read_events(folder))
    assert data["log_from"] == pytest.approx(kept) and kept == _local(today - dt.timedelta(days=5), 9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = bars(gather(folder, days=7, now=time.time()))  # what the PNG drew: the same days and numbers
    assert drawn.days == tuple(by_day) and drawn.saved[1] == 7000 and drawn.other[2] == 8000
    assert drawn.processed == tuple(d["processed"] + d["ocpc_prefill"] for d in data["days"])
    text = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", "stats", "--days", "7"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "OC_PREFIX_CACHE_HOME": str(home), "COLUMNS": "120"},
    ).stdout
    print(text)
    assert day(5) in text and day(2) in text and "rolled out" in text, text
