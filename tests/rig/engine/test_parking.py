"""Conversations sharing a slot, on the real server: parked, brought back, never destroyed.

Each step is what the plugin does (prepare, the real request, report). "Only its new
tokens": a conversation that comes back processes what its request added since its last
one (plus the few tokens of the template's turn markup), not its history.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.slotfile import read_header
from oc_prefix_cache.engine.prepare import PrepareResult
from oc_prefix_cache.engine.wiring import build_engine
from oc_prefix_cache.llama.client import SlotClient, Timings
from oc_prefix_cache.llama.server_info import server_command
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.helpers import SUITE_WAIT_S, chat

pytestmark = pytest.mark.rig
BOTH = pytest.mark.parametrize("model", ["qwen35", "qwen3"])
FLAGS = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics")
# A RAM cache too small for any conversation (1 MiB): displaced conversations go to disk parks. With
# the server's default RAM cache they are swapped back from RAM instead (tests/rig/engine/test_ram_swaps.py,
# tests/rig/llama/test_families.py); a subagent's first turn warms a new head and parks either way.
DISK_ONLY = ("--cache-ram", "1")
MARKUP = 12  # turn markup the template re-renders around appended messages


class Turns:
    """Drives conversations through one Engine the way the plugin does, and remembers
    each conversation's last prompt size so a test can say "only its new tokens"."""

    def __init__(self, url: str, settings: Settings | None = None) -> None:
        self.url = url
        self.settings = settings or Settings.from_env(dict(os.environ))
        self.client = SlotClient(url)
        self.engine = build_engine(
            settings=self.settings,
            client=self.client,
            store=Store(index_path=self.settings.index_path, lock_path=self.settings.lock_path),
        )
        self.prompts: dict[str, int] = {}

    def turn(self, conv: workload.Conversation, *, body: dict[str, Any] | None = None) -> tuple[PrepareResult, Timings]:
        body = body or conv.next_body()
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        result = self.engine.prepare(raw, conv.headers())
        timings = chat(self.url, body)
        if result.prepare_id:  # as the proxy does (a skipped title's report marks its slot)
            self.engine.report(
                fingerprint=result.fingerprint,
                cache_n=timings.cache_n,
                prompt_n=timings.prompt_n,
                prepare_id=result.prepare_id,
                predicted_n=timings.predicted_n,
            )
        self.new_tokens = timings.cache_n + timings.prompt_n - self.prompts.get(conv.session, 0)
        self.prompts[conv.session] = timings.cache_n + timings.prompt_n
        return result, timings

    def assert_only_new_tokens(self, result: PrepareResult, timings: Timings) -> None:
        assert timings.prompt_n <= self.new_tokens + MARKUP, (result, timings, self.new_tokens)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def turns(llama_server) -> Iterator[Any]:
    made: list[Turns] = []

    def make(model: str = "qwen35", **kwargs: Any) -> tuple[Any, Turns]:
        kwargs.setdefault("extra_args", FLAGS)
        kwargs.setdefault("ctx_size", 32768)
        server = llama_server(model, **kwargs)
        t = Turns(server.url)
        made.append(t)
        return server, t

    yield make
    for t in made:
        t.close()


@BOTH
def test_a_subagent_and_back(turns, model: str) -> None:
    """The server's RAM cache too small to keep the parent: it is parked to disk and restored."""
    server, t = turns(model, extra_args=(*FLAGS, *DISK_ONLY))
    parent, sub = workload.parent(), workload.explore_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    sub_first, _ = t.turn(sub)
    assert "parked the slot's conversation" in sub_first.reason, sub_first
    t.turn(sub)
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)
    assert t.engine.stats.counters["parked"] == 2  # the parent, then the subagent


@BOTH
def test_another_projects_session_and_back(turns, model: str) -> None:
    server, t = turns(model, extra_args=(*FLAGS, *DISK_ONLY))
    parent, other = workload.parent(), workload.other_project()
    for _ in range(3):
        t.turn(parent)
    first, _ = t.turn(other)
    assert first.action in ("restored", "hit") and "parked the slot's conversation" in first.reason, first
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)


def test_four_conversations_taking_turns_on_one_slot(turns) -> None:
    server, t = turns("qwen35", extra_args=(*FLAGS, *DISK_ONLY))
    for i, (who, conv) in enumerate(workload.round_robin(n=4, turns=3)):
        result, timings = t.turn(conv)
        if 4 <= i < 8:  # a first turn's tail is too short to park: back from the project head
            assert result.action == "restored" and result.source == "proj", (who, result)
        if i >= 8:  # from then on, every turn comes back from its park with only its new tokens
            assert result.action == "restored" and result.source == "park", (who, result)
            t.assert_only_new_tokens(result, timings)


@BOTH
def test_a_graceful_restart_parks_the_live_conversation(turns, model: str) -> None:
    server, t = turns(model)
    parent = workload.parent()
    for _ in range(3):
        t.turn(parent)
    parked = t.engine.park_live(deadline=Deadline.after(10))
    assert [p["parked"] for p in parked] == [True], parked
    server.restart()
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)


@BOTH
def test_an_idle_conversation_is_parked_ahead_so_its_displacement_writes_nothing(
    turns, monkeypatch, model: str
) -> None:
    """Park ahead (engine/park_ahead.py): a conversation idle after its turn, whose park costs more than
    OC_PREFIX_CACHE_PARK_AHEAD_S to write, is parked by the between-requests watch; the
    subagent that then displaces it writes no park, and the conversation comes back from the
    park with only its new tokens. A conversation going on before the watch is left alone."""
    from oc_prefix_cache.engine import park_ahead as ahead

    monkeypatch.setattr(ahead, "IDLE_S", 0.0)  # the tool gap, shortened
    server, t = turns(model, extra_args=(*FLAGS, *DISK_ONLY))
    t.engine.watcher.settings = replace(t.settings, park_ahead_s=1e-6)  # every park "costs" more than this here
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    t.engine.watch()
    assert t.engine.stats.counters["parked_ahead"] == 1
    going_on, timings = t.turn(parent)  # the same conversation comes back first: it just goes on
    assert going_on.action == "hit", going_on
    t.assert_only_new_tokens(going_on, timings)
    t.engine.watch()
    assert t.engine.stats.counters["parked_ahead"] == 2
    displacing, _ = t.turn(sub)
    assert "parked the slot's conversation first" not in displacing.reason, displacing
    assert t.engine.stats.counters["parked"] == 0  # none at displacement
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)

    t.turn(parent)  # goes on, no watch in between: parked at displacement, as before
    displacing, _ = t.turn(sub)
    assert "parked the slot's conversation first" in displacing.reason, displacing
    assert t.engine.stats.counters["parked_ahead"] == 2 and t.engine.stats.counters["parked"] == 1


def test_a_busy_slot_does_not_spend_the_whole_stop_budget_of_the_others(turns) -> None:
    """Issue 17's defect: park_live gave every slot one shared deadline, so a slot 0 busy
    with a prepare used all of it waiting for its lock and slot 1 went unparked."""
    import threading

    server, t = turns("qwen35", parallel=2)
    parent = workload.parent()
    for _ in range(2):
        body = {**parent.next_body(), "id_slot": 1}
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        result = t.engine.prepare(raw, parent.headers(), slot=1)
        timings = chat(server.url, body)
        t.engine.report(
            fingerprint=result.fingerprint or "",
            cache_n=timings.cache_n,
            prompt_n=timings.prompt_n,
            prepare_id=result.prepare_id,
            predicted_n=timings.predicted_n,
        )
    t.engine.view.observe(0)  # slot 0 known to the tracker, then held by a prepare that does not end
    held, release = threading.Event(), threading.Event()

    def hold_slot_0() -> None:
        with t.engine.tracker.slot_lock(server.url, 0, deadline=Deadline.after(30)):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_slot_0)
    holder.start()
    try:
        assert held.wait(SUITE_WAIT_S), "slot 0's lock was not taken"
        # 20 s: slot 0's share (half) is spent waiting for its lock; slot 1's half parks it with room
        # to spare on a loaded machine (6 s left slot 1 three for a save and the server's identity)
        parked = {p["slot"]: p for p in t.engine.park_live(deadline=Deadline.after(20))}
    finally:
        release.set()
        holder.join()
    assert not parked[0]["parked"] and parked[1]["parked"], parked


def test_a_crash_loses_only_what_was_not_parked(turns) -> None:
    """SIGKILL: no park on the way down. The park made when the subagent displaced the
    parent is still on disk and still serves; only the turns since are processed again."""
    server, t = turns("qwen35")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    t.turn(sub)  # parks the parent (2 turns)
    t.turn(parent)  # back from its park, then one more turn live
    before = t.prompts[parent.session]
    os.kill(server.pid, signal.SIGKILL)
    server.stop()
    server.start()
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    lost = before - back.prefix_tokens  # the live turn that was never parked
    assert timings.prompt_n <= t.new_tokens + lost + MARKUP, (back, timings)
    assert timings.cache_n >= back.prefix_tokens * 0.9


def test_a_damaged_park_fails_its_gate_and_the_request_is_served_from_the_head(turns) -> None:
    server, t = turns("qwen35")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    t.turn(sub)
    [park] = t.settings.slot_dir.glob("oc-conv-*.bin")
    data = park.read_bytes()
    park.write_bytes(data[: len(data) // 2])  # truncated
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "head", back
    assert timings.cache_n >= 0.9 * back.prefix_tokens
    assert t.engine.stats.counters["gate_failed:conv"] == 1


def test_a_park_made_under_another_models_identity_is_never_looked_up(turns, models, tmp_path: Path) -> None:
    """A same-shape model (other weights) would restore it silently; the index files parks
    under the identity they were made with, so the other model never even sees it."""
    server, t = turns("qwen35-alt")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    t.turn(sub)
    assert list(t.settings.slot_dir.glob("oc-conv-*.bin"))
    server.stop()
    server2, t2 = turns("qwen35")  # same slot folder, same index
    t2.prompts = dict(t.prompts)
    back, timings = t2.turn(parent)
    assert back.source != "park", back
    assert timings.cache_n + timings.prompt_n == t2.prompts[parent.session]


def test_a_park_that_cannot_be_written_displaces_nothing(turns) -> None:
    """Disk full (the server's save fails): the slot is not handed over, the request goes
    through untouched, and the parent is still in the slot afterwards."""
    import respx

    server, t = turns("qwen35")
    parent, sub = workload.parent(), workload.explore_subagent("ses_sub")
    t.turn(parent)
    t.turn(parent)
    with respx.mock(assert_all_called=False) as mock:
        mock.post(url__regex=rf"{server.url}/slots/0\?action=save").respond(
            500, json={"error": {"code": 500, "message": "failed to save slot: No space left on device"}}
        )
        mock.route().pass_through()
        blocked, timings = t.turn(sub)
    assert blocked.action == "failed" and "could not park" in blocked.reason, blocked
    assert timings.prompt_n > 0  # the subagent's request itself went through
    assert t.engine.stats.counters["park_failed"] == 1


@BOTH
def test_a_project_head_serves_the_next_session_of_that_project_the_same_day_only(turns, model: str) -> None:
    """Also on the transformer, where the slot left by another project's session holds the head
    plus that session's turn: the project head is restored rather than the head reused from it
    (which left OpenCode's ~350-token project part to process: issue 18)."""
    server, t = turns(model)
    first, _ = t.turn(workload.parent("ses_1"))
    assert "project head" in first.reason and "saved" in first.reason, first
    t.turn(workload.other_project("ses_b"))  # another project takes the slot meanwhile
    second, timings = t.turn(workload.parent("ses_2"))
    assert second.action == "restored" and second.source == "proj", second
    assert timings.prompt_n <= 30  # the user's message and the turn markup, not the ~350-token <env> part

    def midnight(index: Any) -> None:  # the day is over for every project head
        for entry in index.entries.values():
            if entry.kind == "proj":
                entry.expires = int(time.time()) - 1

    t.engine.store.update(midnight)
    t.turn(workload.other_project("ses_c"))
    third, _ = t.turn(workload.parent("ses_3"))
    assert third.source in ("head", "slot") and "project head" in third.reason, third  # a new day: cut, saved again


def test_every_answer_says_where_the_reused_prefix_came_from(turns) -> None:
    """The tiers: the slot itself (live), or a file in the slot folder (head, project head,
    park). What lives only in the server's RAM prompt cache is the server's, and lost on a
    restart."""
    server, t = turns("qwen3")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    sources = [t.turn(parent)[0].source, t.turn(parent)[0].source, t.turn(sub)[0].source, t.turn(parent)[0].source]
    assert sources == ["head", "slot", "head", "park"], sources
    counters = t.engine.stats.counters
    assert counters["source:park"] == 1 and counters["source:slot"] == 1


@dataclass(frozen=True)
class Continuation:
    """What a request makes at temperature 0: its greedy tokens and each step's top-8
    log-probabilities."""

    tokens: tuple[str, ...]
    top: tuple[dict[str, float], ...]


def _continue(url: str, body: dict[str, Any]) -> Continuation:
    sent = {**body, "max_tokens": 3, "stream": False, "temperature": 0, "logprobs": True, "top_logprobs": 8}
    sent.pop("stream_options", None)
    data = loopback.post(f"{url}/v1/chat/completions", json=sent, timeout=300).json()
    steps = data["choices"][0]["logprobs"]["content"]
    return Continuation(
        tokens=tuple(step["token"] for step in steps),
        top=tuple({c["token"]: c["logprob"] for c in step["top_logprobs"]} for step in steps),
    )


def _gap(a: Continuation, b: Continuation) -> float:
    """The largest difference between two runs' top log-probabilities (inf when their greedy
    tokens or their top tokens differ)."""
    if a.tokens != b.tokens or any(set(x) != set(y) for x, y in zip(a.top, b.top, strict=True)):
        return float("inf")
    return max(abs(x[k] - y[k]) for x, y in zip(a.top, b.top, strict=True) for k in x)


# The tiny models' logits are nearly uniform (top-8 within ~0.15 nats), and another
# conversation's state 4k tokens back moves them by ~2e-4; the same request's state, by 0
# on this CPU build (cold vs cold, and cold vs restored, measured 0.0).
SAME = 5e-5


def _relabelled(path: Path, tokens: tuple[int, ...]) -> bytes:
    """``path``'s slot file with its token list replaced by ``tokens[:n]`` (its own n): the
    server then believes it holds those tokens while its state is another conversation's."""
    data = bytearray(path.read_bytes())
    magic, version, count = struct.unpack_from("<III", data, 0)
    packed = list(struct.unpack_from(f"<{count}i", data, 12))
    assert packed[0] == -1 and packed[1] == 1  # llama-server's packing: -1, 1, n, tokens..., media
    n = packed[2]
    packed[3 : 3 + n] = tokens[:n]
    struct.pack_into(f"<{count}i", data, 12, *packed)
    return bytes(data)


def test_a_restored_conversation_continues_as_the_same_request_cold(turns) -> None:
    """Equivalence: the next request after a restore from a park makes the same greedy tokens
    and top-8 log-probabilities as the same request on a cold server (no --logit-bias, no RAM
    cache). Negative control: a park of another conversation (the subagent's), relabelled
    with this conversation's tokens so the server reuses it, does not.

    On the tiny hybrid only: on the real Gemma 3 the server's own cache paths are not
    reproducible on this CPU build, without ocpc (docs/design.md, "Equivalence on the real
    model"), so no file-based bound can be asserted there."""
    server, t = turns("qwen35", extra_args=(*FLAGS, "--cache-ram", "0"))
    parent, sub = workload.parent(), workload.explore_subagent("ses_sub")
    for conv in (parent, parent, sub, sub, parent, sub):  # ends with both parked, the parent last
        t.turn(conv)
    nxt = parent.next_body()
    server.restart()
    cold = _continue(server.url, nxt)
    server.restart()
    raw = json.dumps(nxt, ensure_ascii=False, separators=(",", ":")).encode()
    result = t.engine.prepare(raw, parent.headers())
    assert result.action == "restored" and result.source == "park", result
    restored = _continue(server.url, nxt)
    assert _gap(restored, cold) <= SAME, (restored, cold)

    server.restart()
    _impostor(t, parent, sub, server.url)
    fooled = _continue(server.url, nxt)
    assert _gap(fooled, cold) > SAME, (fooled, cold)


def _impostor(t: Turns, mine: workload.Conversation, theirs: workload.Conversation, url: str) -> None:
    """Restore into slot 0, by hand, ``theirs``'s park relabelled with ``mine``'s tokens."""
    index = t.engine.store.load()
    ours, other = (
        next(e for e in index.entries.values() if e.kind == "conv" and e.session == conv.session)
        for conv in (mine, theirs)
    )
    impostor = t.settings.slot_dir / "impostor.bin"  # not ocpc's name: restored by hand
    impostor.write_bytes(
        _relabelled(t.settings.slot_dir / other.file, read_header(t.settings.slot_dir / ours.file).tokens)
    )
    loopback.post(f"{url}/slots/0?action=restore", json={"filename": impostor.name}, timeout=60).raise_for_status()


def test_a_resumed_conversation_tokenizes_only_what_follows_its_park(turns) -> None:
    """Planning a long conversation resumed from its park reuses the park's tokens (its text
    is recorded with it) and tokenizes only the rest; the result equals tokenizing it whole."""
    from oc_prefix_cache.chat.head import extract_head, parse_body
    from oc_prefix_cache.disk.park_files import find_park
    from oc_prefix_cache.llama.fingerprint import server_key

    server, t = turns("qwen35")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    for conv in (parent, parent, parent, sub):
        t.turn(conv)
    nxt = parent.next_body()
    body = parse_body(json.dumps(nxt).encode())
    identity = t.engine.view.identity(Deadline.after(30))  # as the prepare reads it (its binary too)
    park = find_park(
        t.engine.store.load(),
        identity=server_key(identity),
        session=parent.session,
        digests=body.digests,
    )
    assert park is not None and park.text_chars > 0, park
    known = t.engine.disk.known_park(park)
    assert known is not None and len(known.tokens) == park.n_tokens
    head = extract_head(body, t.engine.settings.markers)
    assert not hasattr(head, "reason"), head
    plan = t.engine.planner.plan(
        t.client,
        body.data,
        head,
        server=identity,  # type: ignore[arg-type]
        harness="opencode/1.18.33",
        longer=known,
    )
    whole = t.client.tokenize(plan.prompt, add_special=True)
    assert list(plan.request_tokens) == whole
    assert plan.request_tokens[: len(known.tokens)] == known.tokens


@pytest.mark.parametrize("witness", [True, False])
def test_a_restore_on_a_fresh_server_is_never_mistaken_for_the_slot_after_a_restart(
    turns, monkeypatch, witness: bool
) -> None:
    """A restore runs no task: on a fresh server, a slot that holds only a restore looks like
    the empty slot of a restarted server in /slots. So either ocpc watches the server's process
    (a restart is a new process), or the restore is followed by the probe's task; else a turn
    after an unreported request and a restart was a false hit. Without the witness: a server
    in another PID namespace (its process not visible here)."""
    if not witness:
        real = server_command
        monkeypatch.setattr(
            "oc_prefix_cache.engine.observer.server_command",
            lambda *a, **k: (found[0], None) if (found := real(*a, **k)) else None,
        )
    server, t = turns("qwen3")
    parent, sub = workload.parent(), workload.general_subagent("ses_sub")
    for conv in (parent, parent, sub):
        t.turn(conv)  # the parent is parked
    nxt = parent.next_body()
    raw = json.dumps(nxt, ensure_ascii=False, separators=(",", ":")).encode()
    for _ in range(3):
        server.restart()
        result = t.engine.prepare(raw, parent.headers())
        assert result.action == "restored" and result.source == "park", result
        chat(server.url, nxt)  # its report never comes (a plugin that failed, a client that left)
    assert ("gated" in result.reason) is not witness, result  # the probe only where it is the witness


def test_a_title_between_turns_parks_the_conversation_it_displaces(turns) -> None:
    """A request with no head (OpenCode's title, Claude Code's quota check) used to be skipped
    before any park and then ran over the slot's conversation: its next turn found the slot
    changed, no park, and re-processed everything. Now what it displaces is parked first."""
    server, t = turns("qwen3")
    parent = workload.parent()
    t.turn(parent)
    t.turn(parent)
    title = json.loads((workload.CAPTURES / "opencode-1.18.33" / "01_projA_turn1_title_request.json").read_text())
    title = title.get("body_json", title)
    result, _ = t.turn(workload.Conversation(parent.session, {}), body=title)
    assert result.action == "skipped" and "parked the slot's conversation first" in result.reason, result
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)


def test_a_next_turn_while_its_slot_is_being_taken_waits_for_its_park(tmp_path: Path) -> None:
    """The race: conversation A's slot is taken by B, whose prepare parks A; A's next turn, sent
    to another slot meanwhile, read the index before the park was recorded, found none and
    re-prefilled from its head. It now waits while another slot holds A's unsaved tail."""
    import threading

    from oc_prefix_cache.engine.tracker import Holding, Observation

    t = Turns("http://127.0.0.1:9", Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path)}))
    tracker, url = t.engine.tracker, t.engine.server
    left = Observation(id_task=5, n_tokens=4000, n_processed=100, n_cached=3900)
    live = Holding(
        kind="conv", key="ses_a", head="H", n_tokens=4000, exact=False, left=left, conversation="ses_a", stored=1800
    )
    tracker.leave(url, 0, live)

    def park_done() -> None:  # B's prepare: A parked (exact, all stored), then B's head restored
        time.sleep(0.4)
        tracker.leave(url, 0, replace(live, exact=True, stored=4000))

    threading.Thread(target=park_done).start()
    started = time.monotonic()
    t.engine.occupant.await_park("ses_a", 1, deadline=Deadline.after(5))
    assert 0.35 < time.monotonic() - started < 4.0  # ended by the park (0.4 s), not by its 5 s deadline
    waits = t.engine.stats.counters.get("waited_for_park", 0)
    started = time.monotonic()  # nothing in flight: no wait at all
    t.engine.occupant.await_park("ses_a", 1, deadline=Deadline.after(5))
    t.engine.occupant.await_park("ses_b", 1, deadline=Deadline.after(5))
    assert t.engine.stats.counters.get("waited_for_park", 0) == waits  # the proof; the clock only says
    assert time.monotonic() - started < 1.0  # it was not the 5 s deadline (a loaded machine pauses us a moment)
    t.close()
