"""Many agents at once on a few slots, on the real server and the real Gemma model (the tiny
models crash b11434 with two slots processing): a small ramp through the proxy, and what a user
depends on under it (issue 17)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_proxy import proxy_for  # noqa: F401  (fixture)

pytestmark = pytest.mark.rig
ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("agents_bench", ROOT / "bench" / "agents_bench.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
sys.modules["agents_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)
LAUNCH = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics")


def test_three_agents_on_two_slots_are_served_from_what_ocpc_prepared(llama_server: Any, proxy_for: Any,  # noqa: F811
                                                                      family_args: Any) -> None:
    """Three agents (OpenCode, Claude Code, OpenCode in another project) share two slots through
    the proxy for ~40 s: every request answers 200, every prepare whose report came back was
    served by what it prepared (no false hit, no park restored into another conversation: a
    park of the wrong conversation reuses nothing past the head), conversations displaced are
    parked and come back from their parks, and nothing fails open."""
    server = llama_server("gemma3", ctx_size=2 * 32768, parallel=2, extra_args=(*LAUNCH, *family_args("gemma3")))
    proxy = proxy_for(server.url)
    point = bench.Point("ocpc", 3, 2)
    bench.drive(proxy.url, bench.make_agents(3), window=40, point=point)
    assert not point.failed, point.failed
    assert len(point.turns) >= 6
    counters = proxy.proxy.preparer.status()["counters"]
    assert counters.get("report_missed", 0) == 0, counters  # no false hit, no wrong park
    assert counters.get("source:park", 0) >= 1 and counters.get("parked", 0) + counters.get("parked_ahead", 0) >= 1
    proxy_counts = proxy.counters()
    assert not any(k.startswith("fail_open") for k in proxy_counts), proxy_counts
    busy = proxy.status()["slots"]
    assert all(s["busy"] == 0 for s in busy.values()), busy  # every slot given back
