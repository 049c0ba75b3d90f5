"""The prepare path against the real llama-server and tiny models (both architectures).

A "turn" here is what the plugin does: prepare, send the real request, report what the
server reused (which ties the slot's new state to the conversation).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.chat.conversation import parse
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Entry, Store
from oc_prefix_cache.engine.prepare import PrepareResult
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.engine.wiring import Engine, build_engine
from oc_prefix_cache.files import file_lock
from oc_prefix_cache.llama.client import SlotClient, Timings
from oc_prefix_cache.settings import Settings
from tests.helpers import (
    DATA,
    PROJ_A,
    PROJ_A_TURN2,
    PROJ_B,
    SUITE_WAIT_S,
    TITLE,
    UA,
    capture,
    capture_bytes,
    chat,
    wait_until,
)

pytestmark = pytest.mark.rig
BOTH = pytest.mark.parametrize("model", ["qwen35", "qwen3"])


class CountingTransport(httpx.HTTPTransport):
    """Counts the calls that reach the server; ``after`` hooks run a callback after a path."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.after: dict[str, Callable[[], None]] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(
            f"{request.method} {request.url.path}" + (f"?{request.url.query.decode()}" if request.url.query else "")
        )
        response = super().handle_request(request)
        hook = self.after.pop(f"{request.method} {request.url.path}?{request.url.query.decode()}", None)
        if hook is not None:
            response.read()
            hook()
        return response

    def changes(self) -> list[str]:
        return [c for c in self.calls if "action=" in c or c.startswith("POST /completion")]


class Rig:
    """A Engine on a running server, with what the tests look at."""

    def __init__(self, url: str, *, tracker: SlotTracker | None = None) -> None:
        self.url = url
        self.settings = Settings.from_env(dict(os.environ))  # OC_PREFIX_CACHE_BASE_URL stays the default
        self.transport = CountingTransport()
        self.client = SlotClient(url, transport=self.transport)
        self.store = Store(index_path=self.settings.index_path, lock_path=self.settings.lock_path)
        self.engine = build_engine(settings=self.settings, client=self.client, store=self.store, tracker=tracker)

    def prepare(self, name_or_body: str | dict[str, Any], session: str = "ses_1", **headers: str) -> PrepareResult:
        raw = capture_bytes(name_or_body) if isinstance(name_or_body, str) else json.dumps(name_or_body).encode()
        return self.engine.prepare(raw, {"User-Agent": UA, "x-session-id": session, **headers})

    def turn(self, name_or_body: str | dict[str, Any], session: str = "ses_1") -> tuple[PrepareResult, Timings]:
        """Prepare, send the real request, report: the plugin's whole cycle."""
        result = self.prepare(name_or_body, session)
        body = capture(name_or_body) if isinstance(name_or_body, str) else name_or_body
        timings = chat(self.url, body)
        if result.fingerprint:
            self.engine.report(
                fingerprint=result.fingerprint,
                cache_n=timings.cache_n,
                prompt_n=timings.prompt_n,
                prepare_id=result.prepare_id,
                predicted_n=timings.predicted_n,
            )
        return result, timings

    def slot_files(self) -> list[Path]:
        return sorted(self.settings.slot_dir.glob("oc-prefix-*.bin"))


@pytest.fixture
def prep(llama_server) -> Iterator[Callable[..., tuple[Any, Rig]]]:
    rigs: list[Rig] = []

    def make(model: str = "qwen35", *, tracker: SlotTracker | None = None, **kwargs: Any) -> tuple[Any, Rig]:
        server = llama_server(model, **kwargs)
        rig = Rig(server.url, tracker=tracker)
        rigs.append(rig)
        return server, rig

    yield make
    for rig in rigs:
        rig.client.close()


def assert_served(timings: Timings, result: PrepareResult) -> None:
    assert result.prefix_tokens > 7000
    assert timings.cache_n >= 0.9 * result.prefix_tokens, (timings, result)


@pytest.mark.parametrize(("model", "expected"), [("qwen35", "restored"), ("qwen3", "hit")])
def test_warm_then_a_session_in_another_project_reuses_the_head(prep, model: str, expected: str) -> None:
    """The first session warms the head and saves project A's head on top of it, so the slot
    holds A's project head: a transformer reuses its head part (hit), a hybrid model cannot
    roll back into it and restores the head (milliseconds)."""
    server, rig = prep(model)
    first = rig.prepare(PROJ_A, session="ses_a")
    assert first.action == "warmed" and first.source == "head", first
    assert len(rig.slot_files()) == 1
    second = rig.prepare(PROJ_B, session="ses_b")
    assert second.action == expected, second
    assert second.fingerprint == first.fingerprint
    assert_served(chat(server.url, capture(PROJ_B)), second)


@BOTH
def test_later_turns_of_a_session_are_hits_with_one_slots_look(prep, model: str) -> None:
    server, rig = prep(model)
    first, _ = rig.turn(PROJ_A, session="ses_a")
    assert first.action == "warmed"
    rig.transport.calls.clear()
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "hit", turn2
    assert rig.transport.calls == ["GET /slots"]  # the restart witness, nothing else
    timings = chat(server.url, capture(PROJ_A_TURN2))
    assert_served(timings, turn2)


@BOTH
def test_after_a_server_restart_the_head_is_restored_and_gated(prep, model: str) -> None:
    server, rig = prep(model)
    warmed, _ = rig.turn(PROJ_A, session="ses_a")
    server.restart()
    restored = rig.prepare(PROJ_B, session="ses_b")
    assert restored.action == "restored", restored
    assert "gated" in restored.reason
    assert restored.fingerprint == warmed.fingerprint
    assert_served(chat(server.url, capture(PROJ_B)), restored)


@pytest.mark.parametrize(("model", "expected"), [("qwen35", "restored"), ("qwen3", "hit")])
def test_new_session_after_another_sessions_turn(prep, model: str, expected: str) -> None:
    """A hybrid slot that ran session A's turn cannot roll back to the head: it restores.
    A transformer reuses the common prefix: a hit."""
    server, rig = prep(model)
    rig.turn(PROJ_A, session="ses_a")
    second = rig.prepare(PROJ_B, session="ses_b")
    assert second.action == expected, second
    assert_served(chat(server.url, capture(PROJ_B)), second)


@BOTH
def test_title_request_in_between_brings_the_head_back(prep, model: str) -> None:
    server, rig = prep(model)
    rig.prepare(PROJ_A, session="ses_a")
    title = rig.prepare(TITLE, session="ses_b")
    assert title.action == "skipped" and "no tools" in title.reason
    chat(server.url, capture(TITLE))
    back = rig.prepare(PROJ_B, session="ses_b")
    assert back.action == "restored", back
    assert_served(chat(server.url, capture(PROJ_B)), back)


def test_another_tools_array_in_between_gets_its_own_file_and_the_head_comes_back(prep) -> None:
    server, rig = prep("qwen35")
    original = rig.prepare(PROJ_A, session="ses_a")
    other = capture(PROJ_A)
    other["tools"] = other["tools"][:3]
    foreign = rig.prepare(other, session="ses_x")
    assert foreign.action == "warmed" and foreign.fingerprint != original.fingerprint
    chat(server.url, other)
    back = rig.prepare(PROJ_B, session="ses_b")
    assert back.action == "restored" and back.fingerprint == original.fingerprint
    assert_served(chat(server.url, capture(PROJ_B)), back)
    assert len(rig.slot_files()) == 2


def test_changed_tools_give_a_new_fingerprint_and_a_warm(prep) -> None:
    _, rig = prep("qwen3")
    original = rig.prepare(PROJ_A)
    changed = capture(PROJ_A)
    changed["tools"][0]["function"]["description"] += " (edited)"
    result = rig.prepare(changed, session="ses_2")
    assert result.action == "warmed"
    assert result.fingerprint != original.fingerprint


def test_a_touched_model_file_keeps_its_fingerprint_and_a_changed_byte_gives_a_new_one(
    prep, models, tmp_path: Path
) -> None:
    """Identity is the model's content (issue 39): a touched file (another mtime, as a copy or a
    restore from backup gives) means what it meant; one changed byte of its weights does not."""
    private = tmp_path / "model.gguf"
    private.write_bytes(models["qwen3"].read_bytes())
    server, rig = prep("qwen3")
    server.config = type(server.config)(**{**server.config.__dict__, "model": private})
    server.restart()
    original = rig.prepare(PROJ_A)
    os.utime(private, ns=(private.stat().st_atime_ns, private.stat().st_mtime_ns + 10**9))
    server.restart()
    touched = rig.prepare(PROJ_B, session="ses_2")
    assert touched.action == "restored" and touched.fingerprint == original.fingerprint, touched
    with open(private, "r+b") as handle:  # a weight's byte near the end of the tensor data
        handle.seek(-64, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-64, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x01]))
    server.restart()
    result = rig.prepare(PROJ_B, session="ses_3")
    assert result.action == "warmed", result
    assert result.fingerprint != original.fingerprint


def test_same_shape_other_weights_model_is_never_restored_from_the_old_file(prep) -> None:
    server, rig = prep("qwen35")
    original = rig.prepare(PROJ_A)
    server.stop()
    _, rig2 = prep("qwen35-alt")
    result = rig2.prepare(PROJ_B, session="ses_2")
    assert result.action == "warmed", result
    assert result.fingerprint != original.fingerprint


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_flip_tokens(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside the token list
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_flip_tokens])
def test_corrupted_file_fails_the_gate_and_is_rebuilt(prep, corrupt) -> None:
    server, rig = prep("qwen35")
    warmed, _ = rig.turn(PROJ_A)
    server.restart()
    corrupt(rig.slot_files()[0])
    result = rig.prepare(PROJ_B, session="ses_b")
    assert result.action == "warmed", result
    assert "gate failed" in result.reason
    assert result.fingerprint == warmed.fingerprint
    assert rig.engine.stats.counters["gate_failed"] == 1
    assert_served(chat(server.url, capture(PROJ_B)), result)


def test_another_models_file_renamed_to_this_fingerprint_is_rejected(prep) -> None:
    server, rig = prep("qwen35")
    warmed = rig.prepare(PROJ_A)
    server.stop()
    other, rig3 = prep("qwen3")
    other_result = rig3.prepare(PROJ_A)
    assert other_result.fingerprint != warmed.fingerprint
    other.stop()
    qwen3_file = rig.settings.slot_dir / f"oc-prefix-{other_result.fingerprint}.bin"
    target = rig.settings.slot_dir / f"oc-prefix-{warmed.fingerprint}.bin"
    target.write_bytes(qwen3_file.read_bytes())
    server.start()
    result = rig.prepare(PROJ_B, session="ses_b")
    assert result.action == "warmed" and "gate failed" in result.reason, result
    assert_served(chat(server.url, capture(PROJ_B)), result)


def test_the_report_of_a_skipped_prepare_binds_only_its_own_conversation(prep) -> None:
    """Issue 17's defect: a skipped prepare answered a fingerprint with no prepare_id; the
    plugin reported it, and the report was matched to the latest prepare of that head,
    another conversation's, binding the slot to it (its next turn a false hit). A skip over a
    slot ocpc cannot vouch for now adopts the slot for the request's own conversation, and only
    when the report's token counts match the slot exactly (an old plugin's report, without the
    generated count, binds nothing)."""
    server, rig = prep("qwen35")
    first, _ = rig.turn(PROJ_A, session="ses_a")
    rig.engine.tracker.forget(rig.url, 0, "the test: ocpc cannot vouch for the slot")
    skipped = rig.prepare(PROJ_A_TURN2, session="ses_x")  # a conversation going on in a slot ocpc cannot vouch for
    assert skipped.action == "skipped" and skipped.fingerprint == first.fingerprint and skipped.prepare_id, skipped
    timings = chat(server.url, capture(PROJ_A_TURN2))
    verdict = rig.engine.report(
        fingerprint=skipped.fingerprint or "",
        cache_n=timings.cache_n,
        prompt_n=timings.prompt_n,
        prepare_id=skipped.prepare_id,
    )
    assert verdict["verdict"] == "unknown", verdict
    assert rig.engine.tracker.holding(rig.url, 0) is None  # the slot is not believed to hold ses_a
    rig.engine.tracker.forget(rig.url, 0, "the test: ocpc cannot vouch for the slot")
    skipped = rig.prepare(PROJ_A_TURN2, session="ses_x")
    timings = chat(server.url, capture(PROJ_A_TURN2))
    verdict = rig.engine.report(
        fingerprint=skipped.fingerprint or "",
        cache_n=timings.cache_n,
        prompt_n=timings.prompt_n,
        prepare_id=skipped.prepare_id,
        predicted_n=timings.predicted_n,
    )
    assert verdict["verdict"] == "adopted", verdict
    holding = rig.engine.tracker.holding(rig.url, 0)
    assert holding is not None and holding.conversation == "ses_x", holding


@BOTH
def test_a_slot_forgotten_under_load_is_learned_again_from_its_next_request(prep, model: str) -> None:
    """A prepare that fails open under load forgets its slot (ocpc cannot vouch for what a
    half-done action left). The conversation's next turn is skipped there, and was skipped on
    every later turn too: in a K = 16 agents ramp after a slow warm-up ocpc skipped all 44 of its
    window's prepares and served 1.04x plain's turns, against ~2x. Its report now adopts the
    slot, so the turn after is a hit again, served with only its new tokens."""
    server, rig = prep(model)
    rig.turn(PROJ_A, session="ses_a")
    rig.engine.tracker.forget(rig.url, 0, "the test: a prepare failed part-way")  # the fault
    skipped, timings = rig.turn(PROJ_A_TURN2, session="ses_a")
    assert skipped.action == "skipped" and "cannot vouch" in skipped.reason, skipped
    assert rig.engine.stats.counters["adopted"] == 1
    sent = capture_bytes(PROJ_A_TURN2)  # the next turn as a harness sends it: the same bytes, two messages on
    end = parse(sent.decode()).msg_end
    raw = (
        sent[:end] + b', {"role": "assistant", "content": "The tests pass now."}, '
        b'{"role": "user", "content": "Then commit it."}' + sent[end:]
    )
    third = rig.engine.prepare(raw, {"User-Agent": UA, "x-session-id": "ses_a"})
    assert third.action == "hit" and third.source == "slot", third
    after = chat(server.url, json.loads(raw))
    assert after.cache_n >= 0.9 * (timings.cache_n + timings.prompt_n), (after, timings)


def test_reported_misses_only_make_the_file_prove_itself_again(prep) -> None:
    """Defect 3: misses (contention, another client) never condemn a file; two in a row
    used to erase the slot and re-prefill a head that was fine. (Project A's sessions reuse
    project A's head, saved on top of the head by the first session.)"""
    server, rig = prep("qwen35")
    last = rig.prepare(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_A))
    [project] = rig.settings.slot_dir.glob("oc-proj-*.bin")
    mtime = project.stat().st_mtime_ns
    for session in ("ses_b", "ses_c", "ses_d"):
        verdict = rig.engine.report(
            fingerprint=last.fingerprint or "", cache_n=0, prompt_n=7499, prepare_id=last.prepare_id
        )
        assert verdict["verdict"] == "missed"
        last = rig.prepare(PROJ_A, session=session)
        assert last.action == "restored" and last.source == "proj" and "gated" in last.reason, last
        chat(server.url, capture(PROJ_A))
    assert project.stat().st_mtime_ns == mtime  # proved again each time, never rebuilt
    assert rig.engine.stats.counters["report_missed"] == 3
    assert rig.engine.stats.counters["warmed"] == 1


def test_a_probe_that_fails_because_another_request_took_the_slot_does_not_condemn_the_file(prep) -> None:
    """Defect 3: a foreign request lands between the restore and the probe (really: the
    test sends it at that moment); the probe fails, but the file is not blamed. (No RAM
    prompt cache, which would otherwise stash the restored head and hand it back.)"""
    server, rig = prep("qwen35", extra_args=("--metrics", "--cache-ram", "0"))
    warmed, _ = rig.turn(PROJ_A)
    server.restart()
    path = rig.slot_files()[0]
    mtime = path.stat().st_mtime_ns
    rig.transport.after["POST /slots/0?action=restore"] = lambda: chat(server.url, capture(TITLE))
    contended = rig.prepare(PROJ_B, session="ses_b")
    assert contended.action == "failed" and "contention" in contended.reason, contended
    assert rig.engine.stats.counters["contended"] == 1
    assert rig.engine.stats.counters["gate_failed"] == 0
    assert path.stat().st_mtime_ns == mtime  # not rebuilt
    after = rig.prepare(PROJ_B, session="ses_c")
    assert after.action == "restored" and "gated" in after.reason, after
    assert_served(chat(server.url, capture(PROJ_B)), after)


@BOTH
def test_a_conversation_going_on_after_a_restart_gets_its_head_back(prep, model: str) -> None:
    server, rig = prep(model)
    rig.turn(PROJ_A, session="ses_a")
    server.restart()
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")  # no watcher: the prepare itself sees it
    assert turn2.action == "restored", turn2
    assert_served(chat(server.url, capture(PROJ_A_TURN2)), turn2)


def test_the_watcher_leaves_a_live_conversation_alone(prep) -> None:
    server, rig = prep("qwen35")
    rig.turn(PROJ_A, session="ses_a")
    rig.engine.watch()
    rig.transport.calls.clear()
    assert rig.prepare(PROJ_A_TURN2, session="ses_a").action == "hit"
    assert rig.transport.changes() == []


def test_the_index_records_the_file_under_the_server_it_serves(prep) -> None:
    """Defect 7: the index's `current` key names the server the Engine serves, not
    OC_PREFIX_CACHE_BASE_URL (whose default, 8080, is not this server's port)."""
    server, rig = prep("qwen35")
    assert rig.settings.base_url != server.url
    warmed = rig.prepare(PROJ_A)
    index = rig.store.load()
    entry = index.entries[warmed.fingerprint]
    assert entry.file == f"oc-prefix-{warmed.fingerprint}.bin" and entry.kind == "head"
    assert entry.prefix_tokens == 7145
    [project] = [e for e in index.entries.values() if e.kind == "proj"]  # the project head on top
    assert project.prefix_tokens == warmed.prefix_tokens > entry.prefix_tokens and project.head == warmed.fingerprint
    assert entry.bytes == (rig.settings.slot_dir / entry.file).stat().st_size
    assert entry.harness == "opencode/1.18.33"
    assert index.current == {f"{server.url}#slot0": warmed.fingerprint}
    assert warmed.tools_in_head is True


def test_server_without_slot_save_path_fails_open_with_the_fix(prep) -> None:
    _, rig = prep("qwen3", slot_dir=None)
    result = rig.prepare(PROJ_A)
    assert result.action == "failed"
    assert "--slot-save-path" in result.reason


def test_the_daemon_collects_garbage_after_a_save(prep, monkeypatch) -> None:
    monkeypatch.setenv("OC_PREFIX_CACHE_KEEP_RECENT", "0")
    _, rig = prep("qwen3")  # its settings read the environment: KEEP_RECENT=0
    old_fp = "00000000000000aa"
    rig.settings.slot_dir.mkdir(parents=True, exist_ok=True)
    old_file = rig.settings.slot_dir / f"oc-prefix-{old_fp}.bin"
    old_file.write_bytes(b"x" * 100)
    stranger = rig.settings.slot_dir / "someone-elses.bin"
    stranger.write_bytes(b"keep me")
    long_ago = int(time.time()) - 60 * 86400
    rig.store.update(
        lambda index: index.entries.__setitem__(
            old_fp,
            Entry(
                file=old_file.name,
                bytes=100,
                prefix_tokens=1,
                created=long_ago,
                last_used=long_ago,
                model="m",
                server_build="b",
                harness="h",
            ),
        )
    )
    warmed = rig.prepare(PROJ_A)
    assert warmed.action == "warmed"
    wait_until(
        lambda: not old_file.exists() and old_fp not in rig.store.load().entries,  # gc runs off the
        what="the gc after the save did not remove the old head",
    )  # request path, just after the save
    assert not old_file.exists() and stranger.exists()
    assert (rig.settings.slot_dir / f"oc-prefix-{warmed.fingerprint}.bin").exists()
    assert [k for k, e in rig.store.load().entries.items() if e.kind == "head"] == [warmed.fingerprint]


def rebuilt(rig: Rig, *, schedule: Callable[[Callable[[], None]], None]) -> Engine:
    """The rig's engine built again with ``schedule`` as its background worker (engine/wiring.py)."""
    return build_engine(
        settings=rig.settings, client=rig.client, store=rig.store, tracker=rig.engine.tracker, schedule=schedule
    )


def test_the_gc_a_save_schedules_keeps_a_head_restored_just_before(prep, monkeypatch) -> None:
    """A restore notes its use in memory (the index is written every few minutes, off the
    request path); the gc a save schedules must see that use, or a head restored a moment ago
    but last written to the index a month ago is deleted as expired while it serves the slot."""
    monkeypatch.setenv("OC_PREFIX_CACHE_KEEP_RECENT", "0")
    _, rig = prep("qwen3")  # its settings read the environment: KEEP_RECENT=0
    jobs: list[Callable[[], None]] = []
    rig.engine = rebuilt(rig, schedule=jobs.append)  # the background jobs run when the test says
    head = rig.prepare(PROJ_A, session="ses_a")
    other = capture(PROJ_A)
    other["tools"] = other["tools"][:3]
    assert rig.prepare(other, session="ses_x").action == "warmed"  # the slot's current file now
    long_ago = int(time.time()) - 60 * 86400
    rig.store.update(lambda index: setattr(index.entries[head.fingerprint], "last_used", long_ago))
    back = rig.prepare(PROJ_B, session="ses_b")
    assert back.action == "restored" and back.fingerprint == head.fingerprint, back
    assert jobs
    for job in jobs:  # the gc that the saves scheduled, run after the restore
        job()
    assert (rig.settings.slot_dir / f"oc-prefix-{head.fingerprint}.bin").exists()
    assert head.fingerprint in rig.store.load().entries


def test_saves_in_a_row_queue_one_gc_pass(prep) -> None:
    """A warm and its project head are two saves; one gc pass after them sees both (each
    pass lists the folder and reads the index)."""
    _, rig = prep("qwen3")
    jobs: list[Callable[[], None]] = []
    rig.engine = rebuilt(rig, schedule=jobs.append)
    assert rig.prepare(PROJ_A, session="ses_a").action == "warmed"
    assert len(jobs) == 1
    jobs.pop()()
    other = capture(PROJ_A)
    other["tools"] = other["tools"][:3]
    assert rig.prepare(other, session="ses_x").action == "warmed"
    assert len(jobs) == 1  # once a pass has started, the next save queues the next


def test_after_a_restart_every_file_is_gated_again(prep) -> None:
    """Proofs belong to a server process: a restart voids them, whichever head comes first."""
    server, rig = prep("qwen3")
    rig.prepare(PROJ_A, session="ses_a")
    other = capture(PROJ_A)
    other["tools"] = other["tools"][:3]
    assert rig.prepare(other, session="ses_x").action == "warmed"
    server.restart()
    again = rig.prepare(PROJ_B, session="ses_b")
    assert again.action == "restored" and "gated" in again.reason, again
    assert_served(chat(server.url, capture(PROJ_B)), again)


def test_kv_cache_type_from_the_servers_flags_moves_the_fingerprint(prep) -> None:
    server, rig = prep("qwen3")
    plain = rig.prepare(PROJ_A)
    server.stop()
    _, rig2 = prep("qwen3", extra_args=("-ctk", "q8_0"))
    quantised = rig2.prepare(PROJ_A)
    assert quantised.action == "warmed" and quantised.fingerprint != plain.fingerprint


def test_a_conversation_whose_slot_another_took_comes_back_from_the_servers_ram(prep) -> None:
    """A's later turn after B took the slot: A was known (its request was reported) and too
    short to be worth a park, but not to be kept: the one token before B's restore made the
    server stash A in its RAM cache (on by default), so A comes back from RAM instead of
    re-processing everything; nothing is parked to disk."""
    server, rig = prep("qwen35")
    rig.turn(PROJ_A, session="ses_a")
    assert rig.turn(PROJ_B, session="ses_b")[0].action == "restored"
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "hit" and turn2.source == "ram", turn2
    assert "parked the slot" not in turn2.reason and rig.engine.stats.counters["parked"] == 0
    assert_served(chat(server.url, capture(PROJ_A_TURN2)), turn2)


def test_a_slot_ocpc_cannot_vouch_for_is_left_to_the_server(prep) -> None:
    """A's later turn after a request that bypassed ocpc took the slot: whatever it left
    there may be someone's live state, which ocpc cannot park, so it leaves the slot alone."""
    server, rig = prep("qwen35")
    rig.turn(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_B))  # another client, not through ocpc
    rig.transport.calls.clear()
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "skipped" and "cannot vouch" in turn2.reason, turn2
    assert rig.transport.changes() == []


def test_a_failed_warm_leaves_no_stale_view_behind(prep) -> None:
    import respx

    server, rig = prep("qwen3")
    first = rig.prepare(PROJ_A, session="ses_a")
    other = capture(PROJ_A)
    other["tools"] = other["tools"][:3]
    with respx.mock(assert_all_called=False) as mock:
        mock.post(url__regex=rf"{server.url}/slots/0\?action=save").respond(500, json={"error": {"message": "disk"}})
        mock.route().pass_through()
        failed = rig.prepare(other, session="ses_x")
    assert failed.action == "failed", failed
    again = rig.prepare(PROJ_B, session="ses_b")  # the slot holds the other head now, not A's
    assert again.action == "restored" and again.fingerprint == first.fingerprint, again
    assert_served(chat(server.url, capture(PROJ_B)), again)


# -- defect 2: plans keyed by what the server renders ---------------------------------------
def test_a_template_that_prints_the_date_gets_a_new_plan_never_a_stale_restore(prep, rig) -> None:
    """Llama 3.2's template prints `Today Date: <date_string>` before the system text, so the
    same request renders another head on another day."""
    template = rig.source_tree / "models" / "templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    server, ocpc = prep("qwen35", extra_args=("--chat-template-file", str(template)))
    monday = capture(PROJ_A) | {"chat_template_kwargs": {"date_string": "30 Nov 2026"}}
    tuesday = capture(PROJ_B) | {"chat_template_kwargs": {"date_string": "01 Dec 2026"}}
    first = ocpc.prepare(monday, session="ses_mon")
    assert first.action == "warmed", first
    second = ocpc.prepare(tuesday, session="ses_tue")
    assert second.action == "warmed" and second.fingerprint != first.fingerprint, second
    timings = chat(server.url, tuesday)
    assert timings.cache_n >= 0.9 * second.prefix_tokens, (timings, second)
    back = ocpc.prepare(capture(PROJ_B) | {"chat_template_kwargs": {"date_string": "30 Nov 2026"}}, session="ses_3")
    assert back.action == "restored" and back.fingerprint == first.fingerprint, back


# -- defect 4: one deadline per prepare -----------------------------------------------------
@contextlib.contextmanager
def slot_held(rig: Any, *, for_s: float) -> Iterator[None]:
    """Another prepare holds slot 0 for at most ``for_s`` seconds (released when the block ends)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with rig.engine.tracker.slot_lock(rig.engine.server, 0, deadline=Deadline.after(30)):
            held.set()
            release.wait(for_s)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(SUITE_WAIT_S), "the slot's lock was not taken"
    try:
        yield
    finally:
        release.set()
        holder.join()


def test_a_prepare_waiting_for_a_busy_slot_fails_open_within_its_budget(prep) -> None:
    server, rig = prep("qwen3")
    rig.prepare(PROJ_A, session="ses_a")
    with slot_held(rig, for_s=10):
        rig.transport.calls.clear()
        started = time.monotonic()
        result = rig.prepare(capture(PROJ_B), session="ses_b", **{"x-ocpc-budget-ms": "1500"})
        took = time.monotonic() - started
    assert result.action == "failed" and "busy" in result.reason, result
    assert took < 3.0
    assert rig.transport.changes() == []


def test_a_prepare_that_gets_the_slot_too_late_does_not_change_it(prep) -> None:
    """The plugin forwards when its budget is spent; a slot change after that would land
    under the real request. Within SLOT_CHANGE_MARGIN_S of the end, nothing starts."""
    server, rig = prep("qwen3")
    rig.prepare(PROJ_A, session="ses_a")
    server.restart()  # the next new session must restore: a slot-changing action
    with slot_held(rig, for_s=1.5):
        rig.transport.calls.clear()
        result = rig.prepare(PROJ_B, session="ses_b", **{"x-ocpc-budget-ms": "3000"})
    assert result.action == "failed" and "not starting" in result.reason, result
    assert rig.transport.changes() == []


def test_a_held_index_lock_does_not_hold_up_a_prepare_past_its_budget(prep) -> None:
    _, rig = prep("qwen3")
    holding = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with file_lock(rig.settings.lock_path):
            holding.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(SUITE_WAIT_S), "the index lock was not taken"
    started = time.monotonic()
    result = rig.prepare(PROJ_A, session="ses_a", **{"x-ocpc-budget-ms": "20000"})
    took = time.monotonic() - started
    done.set()
    holder.join()
    assert result.action == "warmed" and "not recorded in the index" in result.reason, result
    assert took < 20


# -- defect 5: what the slot holds is proven, not assumed -----------------------------------
def test_a_long_foreign_prompt_is_not_taken_for_the_head_on_a_transformer(prep) -> None:
    server, rig = prep("qwen3", extra_args=("--cache-ram", "0"))  # no RAM cache to hand the head back by luck
    rig.prepare(PROJ_A, session="ses_a")
    foreign = capture(PROJ_A)
    foreign["messages"][0]["content"] = "You are someone else entirely. " * 1200
    foreign.pop("tools")
    chat(server.url, foreign)  # bypasses ocpc (another client, or a 413 / back-off in the plugin)
    result = rig.prepare(PROJ_B, session="ses_b")
    assert result.action == "restored", result
    assert_served(chat(server.url, capture(PROJ_B)), result)


def test_a_restore_by_another_daemon_is_noticed(prep) -> None:
    """Slot actions do not change id_task; the slot's token count does."""
    server, mine = prep("qwen35", extra_args=("--cache-ram", "0"))
    theirs = Rig(server.url, tracker=SlotTracker())  # another daemon: its own tracker
    other = capture(PROJ_A)  # a longer head: the slot's token count alone would not tell
    other["tools"] += [
        t | {"function": t["function"] | {"name": t["function"]["name"] + "_mcp"}} for t in other["tools"]
    ]
    assert theirs.prepare(other, session="ses_x").action == "warmed"
    assert mine.prepare(PROJ_A, session="ses_a").action == "warmed"
    assert theirs.prepare(other, session="ses_y").action == "restored"  # proven: no probe, no task
    result = mine.prepare(PROJ_B, session="ses_b")
    assert result.action == "restored", result
    assert_served(chat(server.url, capture(PROJ_B)), result)
    theirs.client.close()


# -- defect 7: two servers saving the same head at once --------------------------------------
class BarrierTransport(httpx.HTTPTransport):
    """Holds the first save until both servers' first saves have arrived, so they run at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.waited = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if "action=save" in str(request.url) and not self.waited:
            self.waited = True
            self.barrier.wait(SUITE_WAIT_S)  # the other server's save: its warm may be slow on a loaded machine
        return super().handle_request(request)


def test_two_servers_saving_one_fingerprint_at_once_do_not_collide(llama_server) -> None:
    servers = [llama_server("qwen3"), llama_server("qwen3")]  # same model, same slot folder
    barrier = threading.Barrier(2)
    settings = Settings.from_env(dict(os.environ))
    engines = [
        build_engine(
            settings=settings,
            client=SlotClient(s.url, transport=BarrierTransport(barrier)),
            store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
        )
        for s in servers
    ]
    results: list[PrepareResult] = []
    threads = [
        threading.Thread(
            target=lambda p=p: results.append(p.prepare(capture_bytes(PROJ_A), {"User-Agent": UA, "x-session-id": "s"}))
        )
        for p in engines
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.action for r in results] == ["warmed", "warmed"], results
    assert results[0].fingerprint == results[1].fingerprint
    names = sorted(p.name for p in settings.slot_dir.iterdir())
    assert names[0] == f"oc-prefix-{results[0].fingerprint}.bin" and len(names) == 2  # and the project head
    assert names[1].startswith("oc-proj-")
    for server in servers:  # the one file that won serves both
        server.restart()
    for engine in engines:
        again = engine.prepare(capture_bytes(PROJ_B), {"User-Agent": UA, "x-session-id": "t"})
        assert again.action == "restored" and "gated" in again.reason, again
        engine.client.close()


# -- defect 8: uses recorded off the request path -------------------------------------------
def test_hits_move_last_used_without_writing_the_index_on_the_request_path(prep) -> None:
    _, rig = prep("qwen3")
    warmed, _ = rig.turn(PROJ_A, session="ses_a")
    old = int(time.time()) - 10 * 86400
    rig.store.update(lambda index: setattr(index.entries[warmed.fingerprint], "last_used", old))
    written = rig.settings.index_path.stat().st_mtime_ns
    assert rig.prepare(PROJ_A_TURN2, session="ses_a").action == "hit"
    assert rig.settings.index_path.stat().st_mtime_ns == written
    rig.engine.flush_usage()  # the daemon's background thread does this every few minutes
    assert rig.store.load().entries[warmed.fingerprint].last_used >= int(time.time()) - 5


def test_claude_code_after_a_commit_starts_from_the_project_heads_shorter_level(prep) -> None:
    """Claude Code as installed (tests/data/claude-code-2.1.332-installed): the first session warms the
    head and saves both project levels on it; a second session restores the project head and
    processes only its typed text; after a commit (only the git status differs) a new session
    restores the shorter level and saves its new project head on it, evaluating the git status, the
    date and the attribution (~290 tokens) instead of everything after the head (~3,200)."""
    from oc_prefix_cache.chat.anthropic import to_chat
    from oc_prefix_cache.disk.events import read_events
    from oc_prefix_cache.harness.base import Incoming
    from oc_prefix_cache.harness.claude_code import ClaudeCodeAdapter

    _, rig = prep("qwen35", ctx_size=16384)
    adapter = ClaudeCodeAdapter(off=frozenset({"environment-to-system"}))
    data = DATA / "claude-code-2.1.332-installed"

    def session(name: str) -> tuple[PrepareResult, Timings, int]:
        captured = json.loads((data / f"{name}.json").read_text())
        incoming = Incoming(
            api="anthropic", headers={k.lower(): v for k, v in captured["headers"]}, body=captured["body_json"]
        )
        body = to_chat(adapter.normalise(incoming)[0])
        started = time.time()
        result = rig.engine.prepare(json.dumps(body).encode(), incoming.headers, session=name, head_of=adapter.head)
        timings = chat(rig.url, body)
        rig.engine.report(
            fingerprint=result.fingerprint or "",
            cache_n=timings.cache_n,
            prompt_n=timings.prompt_n,
            prepare_id=result.prepare_id,
            predicted_n=timings.predicted_n,
        )
        own = sum(e.prompt_n for e in read_events(rig.settings.log_dir, since=started) if e.door == "ocpc")
        return result, timings, own

    first, _, warmed = session("A1")
    assert first.action == "warmed" and len(list(rig.settings.slot_dir.glob("oc-proj-*.bin"))) == 2  # both levels
    again, timings, own = session("A2")
    assert (again.action, again.source, again.prefix_tokens) == ("restored", "proj", first.prefix_tokens)
    assert timings.prompt_n < 20 and own < 10, (timings, own)  # its typed text (and the probe's few tokens)
    commit, timings, own = session("A3-commit")
    assert commit.action == "restored" and commit.source == "proj" and "shorter level" in commit.reason, commit
    assert timings.cache_n >= commit.prefix_tokens - 1 and timings.prompt_n < 20, (timings, commit)
    assert 200 < own < 400 and own < 0.15 * warmed, (own, warmed)  # the git status, date and attribution
    assert len(list(rig.settings.slot_dir.glob("oc-proj-*.bin"))) == 3
