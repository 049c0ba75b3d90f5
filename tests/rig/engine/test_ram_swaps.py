"""More conversations than slots, on the real server: the server's own RAM cache first, disk parks
when it cannot keep them (engine/ram_contents.py, issue 17).

Each step is what a front door does on ``-np 2``: the broker takes a slot, the Engine prepares
it, the request runs pinned to it, the report comes back, the slot is given back. One request at
a time (the tiny models crash b11434 when two slots process at once). A conversation that comes
back must process only its new tokens, whether the server swapped it in from RAM or ocpc restored
its park, and every answer ocpc called reused must have reused it (no false hit).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.engine.broker import Ask, returning
from oc_prefix_cache.engine.wiring import build_engine
from oc_prefix_cache.harness import PiAdapter
from oc_prefix_cache.llama.client import SlotClient, Timings
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.helpers import capture_of, chat

pytestmark = pytest.mark.rig
FLAGS = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics")
MARKUP = 16  # the turn markup the template re-renders around appended messages


class Pi:
    """pi's captured first request, grown by a user message per turn: another harness, another head."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.body = {k: v for k, v in capture_of("pi-0.73.1/A1.json").items() if k in ("messages", "tools", "model")}
        self.turns = 0

    def next_body(self) -> dict[str, Any]:
        if self.turns:
            self.body["messages"] = [
                *self.body["messages"],
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": workload.tool_result(self.turns, lines=20)},
            ]
        self.turns += 1
        return json.loads(json.dumps(self.body))

    def headers(self) -> dict[str, str]:
        return {"User-Agent": "pi-test", "x-session-id": self.session, "Content-Type": "application/json"}

    head_of = staticmethod(PiAdapter().head)  # as the proxy cuts pi's head


class Agents:
    """Conversations taking turns on a server with several slots, through one Engine."""

    def __init__(self, url: str) -> None:
        self.url = url
        settings = Settings.from_env(dict(os.environ))
        self.client = SlotClient(url)
        self.engine = build_engine(
            settings=settings,
            client=self.client,
            store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
        )
        self.prompts: dict[str, int] = {}
        self.rows: list[tuple[str, str, str, int, Timings, int]] = []

    def turn(self, conv: Any) -> tuple[str, Timings, int]:
        body = conv.next_body()
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        broker = self.engine.broker
        taken = broker.take(
            Ask(conversation=conv.session, n_slots=broker.n_slots(), returning=returning(body)),
            deadline=Deadline.after(60),
        )
        try:
            assert taken.hold is not None, taken.why_not
            with taken.hold.inside():  # as the proxy does: the prepare re-enters the slot it holds
                result = self.engine.prepare(
                    raw, conv.headers(), slot=taken.slot, head_of=getattr(conv, "head_of", None)
                )
            timings = chat(self.url, {**body, "id_slot": taken.slot})
            self.engine.report(
                fingerprint=result.fingerprint,
                cache_n=timings.cache_n,
                prompt_n=timings.prompt_n,
                prepare_id=result.prepare_id,
                predicted_n=timings.predicted_n,
            )
        finally:
            broker.give_back(taken)
        new = timings.cache_n + timings.prompt_n - self.prompts.get(conv.session, 0)
        self.prompts[conv.session] = timings.cache_n + timings.prompt_n
        self.rows.append((conv.session, result.action, result.source, taken.slot, timings, new))
        print(
            f"{conv.session:6} slot {taken.slot} {result.action:8} {result.source or '-':5} "
            f"cache_n={timings.cache_n:6} prompt_n={timings.prompt_n:6} new={new:6}  {result.reason[:110]}"
        )
        return result.source, timings, new

    def counters(self) -> Counter[str]:
        return Counter({k: int(v) for k, v in self.engine.status()["counters"].items()})


def rounds(agents: Agents, convs: list[Any], n: int) -> list[tuple[str, Timings, int]]:
    """``n`` rounds of one turn each; the turns after the first round."""
    later = []
    for i in range(n):
        for conv in convs:
            outcome = agents.turn(conv)
            if i:
                later.append(outcome)
    return later


@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_conversations_outnumbering_slots_come_back_from_the_servers_ram_without_disk_parks(
    llama_server: Any, model: str
) -> None:
    """Three conversations on two slots (two OpenCode projects, which share a head, and pi),
    with RAM to keep them all: every returning turn is swapped in by the server from its RAM
    cache (it copied each idle slot there when another request started, or stashed the
    occupant), processes only its new tokens, and nothing is parked to disk."""
    server = llama_server(model, parallel=2, ctx_size=2 * 32768, extra_args=(*FLAGS, "--cache-ram", "2048"))
    agents = Agents(server.url)
    later = rounds(agents, [workload.parent("ses_a"), Pi("ses_p"), workload.other_project("ses_b")], 4)
    counters = agents.counters()
    print(dict(counters))
    for source, timings, new in later:
        assert timings.prompt_n <= new + MARKUP, (source, timings, new)
    assert sum(1 for source, _, _ in later if source == "ram") >= 4, later
    assert counters.get("report_missed", 0) == 0, counters  # nothing answered as reused re-processed it
    assert counters.get("parked", 0) + counters.get("parked_ahead", 0) == 0, counters


@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_where_the_ram_cache_cannot_keep_them_conversations_are_parked_to_disk(llama_server: Any, model: str) -> None:
    """The same with a RAM cache too small for the two long conversations (`--cache-ram 1`): ocpc
    believes neither stays in RAM, parks each before it displaces it, and brings it back from its
    park; the short one (pi's) may stay in RAM, where the model has room for it."""
    server = llama_server(model, parallel=2, ctx_size=2 * 32768, extra_args=(*FLAGS, "--cache-ram", "1"))
    agents = Agents(server.url)
    later = rounds(agents, [workload.parent("ses_a"), Pi("ses_p"), workload.other_project("ses_b")], 3)
    counters = agents.counters()
    print(dict(counters))
    for source, timings, new in later:  # a first turn's tail under OC_PREFIX_CACHE_PARK_MIN_TOKENS is not parked
        assert timings.prompt_n <= new + max(MARKUP, 256), (source, timings, new)
    room = agents.engine.ram.capacity()
    assert room is not None and room > 0
    assert not any(source == "ram" and timings.cache_n > room for source, timings, _ in later), (room, later)
    assert counters.get("source:park", 0) >= 3 and counters.get("report_missed", 0) == 0, counters


@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_a_conversation_too_short_to_park_is_stashed_in_ram_before_a_restore_displaces_it(
    llama_server: Any, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation whose tail is under the park minimum (here: every one) is not worth a file,
    and a restore is a slot action, which wipes the slot without the server stashing it. One
    token first makes the server stash it in its RAM cache, so its next turn comes back from RAM
    with only its new tokens; before, that turn re-processed the conversation on its head."""
    monkeypatch.setenv("OC_PREFIX_CACHE_PARK_MIN_TOKENS", "1000000")
    server = llama_server(model, parallel=1, ctx_size=32768, extra_args=(*FLAGS, "--cache-ram", "2048"))
    agents = Agents(server.url)
    for conv in (workload.parent("ses_x"), Pi("ses_y")):  # both heads on disk: new sessions restore them
        agents.turn(conv)
    mine = workload.parent("ses_a")
    assert agents.turn(mine)[0] in ("head", "proj")  # restored: a slot action
    assert agents.turn(mine)[0] == "slot"  # a turn of ~1.6k tokens past its project head
    assert agents.turn(Pi("ses_p"))[0] == "head"  # a restore over ses_a, whose tail no park is made for
    source, timings, new = agents.turn(mine)
    counters = agents.counters()
    print(dict(counters))
    assert source == "ram" and timings.prompt_n <= new + MARKUP, (source, timings, new)
    assert counters.get("parked", 0) == 0 and counters.get("report_missed", 0) == 0, counters


def test_a_graceful_stop_parks_the_conversations_that_live_only_in_the_ram_cache(llama_server: Any) -> None:
    """The RAM cache dies with the server process. Before a graceful stop, ocpc parks the slots'
    conversations and then the ones only the RAM cache holds (the server loads each back for its
    park's evaluation): after the restart every conversation comes back from its park."""
    server = llama_server("qwen35", parallel=2, ctx_size=2 * 32768, extra_args=(*FLAGS, "--cache-ram", "2048"))
    agents = Agents(server.url)
    convs = [workload.parent("ses_a"), Pi("ses_p"), workload.other_project("ses_b")]
    rounds(agents, convs, 2)
    parked = agents.engine.park_live(deadline=Deadline.after(120))
    print(parked)
    from_ram = [r for r in parked if r.get("from")]
    assert from_ram and all(r["parked"] for r in from_ram), parked
    server.restart()
    for conv in convs:
        source, timings, new = agents.turn(conv)
        assert source == "park" and timings.prompt_n <= new + MARKUP, (conv.session, source, timings, new)
    counters = agents.counters()
    assert counters.get("report_missed", 0) == 0, counters
