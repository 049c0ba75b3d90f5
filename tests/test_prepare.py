"""The prepare path against the real llama-server and tiny models (both architectures)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.prepare import Preparer, PrepareResult
from oc_prefix_cache.settings import Settings
from oc_prefix_cache.slot_client import SlotClient
from oc_prefix_cache.store import Entry, Store

from .helpers import (
    PROJ_A,
    PROJ_A_TURN2,
    PROJ_B,
    TITLE,
    UA,
    capture,
    capture_bytes,
    chat,
)

pytestmark = pytest.mark.rig
BOTH = pytest.mark.parametrize("model", ["qwen35", "qwen3"])


class CountingTransport(httpx.HTTPTransport):
    """Counts the calls that reach the server: the hit path must make none."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        return super().handle_request(request)


class Rig:
    """A Preparer on a running server, with what the tests look at."""

    def __init__(self, url: str) -> None:
        self.settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_BASE_URL": url})
        self.transport = CountingTransport()
        self.client = SlotClient(url, transport=self.transport)
        self.store = Store(index_path=self.settings.index_path, lock_path=self.settings.lock_path)
        self.preparer = Preparer(settings=self.settings, client=self.client, store=self.store)

    def prepare(self, name_or_body: str | dict[str, Any], session: str = "ses_1") -> PrepareResult:
        raw = capture_bytes(name_or_body) if isinstance(name_or_body, str) else json.dumps(name_or_body).encode()
        return self.preparer.prepare(raw, {"User-Agent": UA, "x-session-id": session})

    def slot_files(self) -> list[Path]:
        return sorted(self.settings.slot_dir.glob("oc-prefix-*.bin"))


@pytest.fixture
def prep(llama_server) -> Iterator[Callable[..., tuple[Any, Rig]]]:
    rigs: list[Rig] = []

    def make(model: str = "qwen35", **kwargs: Any) -> tuple[Any, Rig]:
        server = llama_server(model, **kwargs)
        rig = Rig(server.url)
        rigs.append(rig)
        return server, rig

    yield make
    for rig in rigs:
        rig.client.close()


def assert_served(timings, result: PrepareResult) -> None:
    assert result.prefix_tokens > 7000
    assert timings.cache_n >= 0.9 * result.prefix_tokens, (timings, result)


@BOTH
def test_warm_then_new_session_in_same_process_is_a_hit(prep, model: str) -> None:
    server, rig = prep(model)
    first = rig.prepare(PROJ_A, session="ses_a")
    assert first.action == "warmed", first
    assert len(rig.slot_files()) == 1
    second = rig.prepare(PROJ_B, session="ses_b")
    assert second.action == "hit", second
    assert second.fingerprint == first.fingerprint
    assert_served(chat(server.url, capture(PROJ_B)), second)


@BOTH
def test_later_turns_of_a_session_are_hits_without_a_server_call(prep, model: str) -> None:
    server, rig = prep(model)
    assert rig.prepare(PROJ_A, session="ses_a").action == "warmed"
    chat(server.url, capture(PROJ_A))
    rig.transport.calls.clear()
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "hit", turn2
    assert rig.transport.calls == []
    assert_served(chat(server.url, capture(PROJ_A_TURN2)), turn2)


@BOTH
def test_after_a_server_restart_the_head_is_restored_and_gated(prep, model: str) -> None:
    server, rig = prep(model)
    warmed = rig.prepare(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_A))
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
    rig.prepare(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_A))
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


def test_touched_model_file_gives_a_new_fingerprint(prep, models, tmp_path: Path) -> None:
    private = tmp_path / "model.gguf"
    private.write_bytes(models["qwen3"].read_bytes())
    server, rig = prep("qwen3")
    server.config = type(server.config)(**{**server.config.__dict__, "model": private})
    server.restart()
    original = rig.prepare(PROJ_A)
    os.utime(private, ns=(private.stat().st_atime_ns, private.stat().st_mtime_ns + 10**9))
    server.restart()
    result = rig.prepare(PROJ_B, session="ses_2")
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


def _corrupt_truncate(path: Path, rig: Rig) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_flip(path: Path, rig: Rig) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_flip_tokens(path: Path, rig: Rig) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside the token list
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_flip_tokens])
def test_corrupted_file_fails_the_gate_and_is_rebuilt(prep, corrupt) -> None:
    server, rig = prep("qwen35")
    warmed = rig.prepare(PROJ_A)
    chat(server.url, capture(PROJ_A))
    server.restart()
    corrupt(rig.slot_files()[0], rig)
    result = rig.prepare(PROJ_B, session="ses_b")
    assert result.action == "warmed", result
    assert "gate failed" in result.reason
    assert result.fingerprint == warmed.fingerprint
    assert rig.preparer.stats.counters["gate_failed"] == 1
    assert_served(chat(server.url, capture(PROJ_B)), result)


def test_another_models_file_renamed_to_this_fingerprint_is_rejected(prep, llama_server) -> None:
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


def test_a_reported_miss_reproves_the_file_and_a_second_miss_rebuilds_it(prep) -> None:
    server, rig = prep("qwen35")
    warmed = rig.prepare(PROJ_A)
    chat(server.url, capture(PROJ_A))
    verdict = rig.preparer.report(fingerprint=warmed.fingerprint, cache_n=0, prompt_n=7499)
    assert verdict["verdict"] == "missed"
    again = rig.prepare(PROJ_B, session="ses_b")
    assert again.action == "restored" and "gated" in again.reason, again  # not trusted on its proof
    rig.preparer.report(fingerprint=again.fingerprint, cache_n=10, prompt_n=7489)
    third = rig.prepare(capture(PROJ_A), session="ses_c")
    assert third.action == "warmed" and "2 real requests in a row missed" in third.reason, third
    assert rig.preparer.stats.counters["report_missed"] == 2
    ok = rig.preparer.report(fingerprint=third.fingerprint, cache_n=third.prefix_tokens, prompt_n=354)
    assert ok["verdict"] == "served"


@BOTH
def test_a_conversation_going_on_after_a_restart_gets_its_head_back(prep, model: str) -> None:
    server, rig = prep(model)
    rig.prepare(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_A))
    server.restart()
    rig.preparer.watch()  # the daemon's watcher does this every second
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "restored", turn2
    assert_served(chat(server.url, capture(PROJ_A_TURN2)), turn2)


def test_the_watcher_leaves_a_live_conversation_alone(prep) -> None:
    server, rig = prep("qwen35")
    rig.prepare(PROJ_A, session="ses_a")
    rig.preparer.watch()
    chat(server.url, capture(PROJ_A))
    rig.preparer.watch()
    rig.transport.calls.clear()
    assert rig.prepare(PROJ_A_TURN2, session="ses_a").action == "hit"
    assert rig.transport.calls == []


def test_the_index_records_the_file(prep) -> None:
    _, rig = prep("qwen35")
    warmed = rig.prepare(PROJ_A)
    index = rig.store.load()
    entry = index.entries[warmed.fingerprint]
    assert entry.file == f"oc-prefix-{warmed.fingerprint}.bin"
    assert entry.prefix_tokens == warmed.prefix_tokens
    assert entry.bytes == (rig.settings.slot_dir / entry.file).stat().st_size
    assert entry.harness == "opencode/1.18.33"
    assert list(index.current.values()) == [warmed.fingerprint]
    assert warmed.tools_in_head is True


def test_server_without_slot_save_path_fails_open_with_the_fix(prep) -> None:
    _, rig = prep("qwen3", slot_dir=None)
    result = rig.prepare(PROJ_A)
    assert result.action == "failed"
    assert "--slot-save-path" in result.reason


def test_the_daemon_collects_garbage_after_a_save(prep, monkeypatch) -> None:
    monkeypatch.setenv("OC_PREFIX_CACHE_KEEP_RECENT", "0")
    _, rig = prep("qwen3")
    rig.settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_BASE_URL": rig.client.base_url})
    rig.preparer.settings = rig.settings
    old_fp = "00000000000000aa"
    rig.settings.slot_dir.mkdir(parents=True, exist_ok=True)
    old_file = rig.settings.slot_dir / f"oc-prefix-{old_fp}.bin"
    old_file.write_bytes(b"x" * 100)
    stranger = rig.settings.slot_dir / "someone-elses.bin"
    stranger.write_bytes(b"keep me")
    long_ago = int(time.time()) - 60 * 86400
    rig.store.update(lambda index: index.entries.__setitem__(old_fp, Entry(
        file=old_file.name, bytes=100, prefix_tokens=1, created=long_ago, last_used=long_ago,
        model="m", server_build="b", harness="h")))
    warmed = rig.prepare(PROJ_A)
    assert warmed.action == "warmed"
    assert not old_file.exists() and stranger.exists()
    assert (rig.settings.slot_dir / f"oc-prefix-{warmed.fingerprint}.bin").exists()
    assert list(rig.store.load().entries) == [warmed.fingerprint]


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


def test_another_conversation_going_on_is_left_to_the_server(prep) -> None:
    """A's later turn after B took the slot: restoring the head would wipe B's and A's own
    cached state for 7k tokens, so ocpc leaves the slot alone (the server's cache decides)."""
    server, rig = prep("qwen35")
    rig.prepare(PROJ_A, session="ses_a")
    chat(server.url, capture(PROJ_A))
    assert rig.prepare(PROJ_B, session="ses_b").action == "restored"
    chat(server.url, capture(PROJ_B))
    rig.transport.calls.clear()
    turn2 = rig.prepare(PROJ_A_TURN2, session="ses_a")
    assert turn2.action == "skipped" and "conversation going on" in turn2.reason, turn2
    assert not [c for c in rig.transport.calls if "action=" in c or "/completion" in c]  # slot untouched


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
