"""Many agents at once on a few slots, on the real server and the real Gemma model (the tiny
models crash b11434 with two slots processing): a small ramp through the proxy, and what a user
depends on under it (issue 17)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import FULL, ROOT, sized

pytestmark = pytest.mark.rig
_spec = importlib.util.spec_from_file_location("agents_bench", ROOT / "bench" / "agents_bench.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
sys.modules["agents_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)
LAUNCH = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics")
WINDOW = sized(60, 40)  # seconds of turns after the first requests (OCPC_FULL_TESTS=1: a minute)
SHORT = (
    not FULL
)  # the middles of the agents' system texts cut out (workload.shorten_system), not with OCPC_FULL_TESTS=1


def test_three_agents_on_two_slots_through_both_front_doors_are_served_from_what_ocpc_prepared(
    llama_server: Any, family_args: Any, tmp_path: Path
) -> None:
    """Three agents share two slots for 40 s (a minute with OCPC_FULL_TESTS=1) through both
    front doors of `ocpc launch` on one Engine: two OpenCode agents on the plugin's path (the
    daemon's prepare, the request sent straight to the server pinned to the slot prepared, the
    report) and Claude Code through the proxy. Every request answers 200; every prepare whose report
    came back was served by what it
    prepared (no false hit, no park restored into another conversation: a park of the wrong
    conversation reuses nothing past the head, a slot the other front door was running a request
    on holds another prompt); conversations displaced come back from the server's RAM cache or
    their parks; nothing fails open; every slot and every lease is given back. Each agent's first
    request is answered before the window opens (this machine prefills Gemma at ~100 tokens/s);
    its system texts lose their middles unless OCPC_FULL_TESTS=1 (first requests of 883, 1,992 and
    883 tokens instead of 2,303, 4,070 and 2,303: the test's time is mostly that prefill)."""
    server = llama_server("gemma3", ctx_size=2 * 32768, parallel=2, extra_args=(*LAUNCH, *family_args("gemma3")))
    point = bench.Point("ocpc", 3, 2)
    with bench.Launched(server.url, tmp_path / "ocpc") as launched:
        agents = bench.make_agents(3, plugin=True, short=SHORT)
        assert [a.via for a in agents] == ["plugin", "proxy", "plugin"]
        bench.drive(launched.doors, agents, window=WINDOW, point=point, warmup=True)
        counters = launched.snapshot()
        broker = launched.engine.broker
        busy = broker.table.snapshot()
        leases = broker.leases()
    assert not point.failed, point.failed
    # both front doors served turns (not a count in the window: speed lives in bench/). A turn that
    # ended after the window counts: on a loaded machine a 40 s window held one turn in all.
    served = point.turns + point.late
    assert {t.agent.split("-")[0] for t in served} == {"opencode", "claude"}, served
    assert counters.get("report_missed", 0) == 0, counters  # no false hit, no wrong park
    assert counters.get("report_served", 0) >= len(point.turns) - 3, counters  # the plugin's reports too
    # displaced conversations come back from the server's RAM cache or from their parks
    assert counters.get("source:park", 0) + counters.get("source:ram", 0) >= 1, counters
    assert not any(v for k, v in counters.items() if k.startswith(("proxy:fail_open", "failed"))), counters
    assert all(s["busy"] == 0 for s in busy.values()) and leases == 0, (busy, leases)
    assert counters.get("lease_reclaimed", 0) == 0, counters  # every plugin report came back and freed its slot


def test_two_ocpc_processes_on_one_server_never_serve_a_false_hit(
    llama_server: Any, family_args: Any, tmp_path: Path
) -> None:
    """Two ocpc processes (each its own tracker, as two `ocpc proxy` of one user: one home, the
    cross-process slot locks) in front of one server with two slots, an agent each plus one
    more. They cannot see each other's conversations, so what one displaces of the other's is
    not parked (docs/design.md), but neither may trust a slot the other changed: no request
    answered as reused re-processes its prefix, and no request fails."""
    server = llama_server("gemma3", ctx_size=2 * 32768, parallel=2, extra_args=(*LAUNCH, *family_args("gemma3")))
    points = [bench.Point("ocpc", 2, 2), bench.Point("ocpc", 1, 2)]
    with (
        bench.Launched(server.url, tmp_path / "ocpc") as first,
        bench.Launched(server.url, tmp_path / "ocpc") as second,
    ):
        agents = bench.make_agents(3, short=SHORT)
        together = threading.Barrier(2)  # both windows open once all three first requests are answered
        runs = [
            threading.Thread(
                target=bench.drive,
                args=(doors, group),
                kwargs={"window": WINDOW, "point": point, "warmup": True, "together": together},
            )
            for doors, group, point in ((first.doors, agents[:2], points[0]), (second.doors, agents[2:], points[1]))
        ]

        for run in runs:
            run.start()
        for run in runs:
            run.join(300)
        counters = [first.snapshot(), second.snapshot()]
    for point in points:
        assert not point.failed, point.failed
    # Each process served turns after its first requests, so the checks below saw both displace
    # the other. Not a throughput count, so a turn that ended after the window counts too: two
    # trackers blind to each other re-prefill what the other displaced, and a CI machine once
    # ended none of the first process's turns within 40 s; bench/ measures speed.
    assert all(point.turns or point.late for point in points), [(len(p.turns), len(p.late)) for p in points]
    for mine in counters:
        assert mine.get("report_missed", 0) == 0, mine  # a slot the other process changed is never a hit
        assert not any(v for k, v in mine.items() if k.startswith(("proxy:fail_open", "failed"))), mine
