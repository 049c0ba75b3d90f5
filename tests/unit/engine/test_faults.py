"""Faults the real server cannot produce on demand: every one fails open, within its bound.

Hangs and refused connections use real sockets; error statuses and a save that times out
use respx in front of the real server (everything else passes through to it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import respx

from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.engine.wiring import Engine, build_engine
from oc_prefix_cache.errors import ServerTimeout, ServerUnreachable
from oc_prefix_cache.llama.client import SlotClient, Timeouts
from oc_prefix_cache.settings import Settings
from tests.helpers import PROJ_A, UA, capture_bytes

FAST = Timeouts(connect=0.5, quick=0.5, probe=1.0, prefill=60.0, slot_io=1.0)


def make_engine(url: str, timeouts: Timeouts = FAST) -> Engine:
    """A Engine whose every call goes through httpx, so respx can stand in for the server
    (the client's own fast GET /slots path is tested on real sockets below)."""
    settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_BASE_URL": url})
    client = SlotClient(url, timeouts=timeouts, transport=httpx.HTTPTransport())
    return build_engine(
        settings=settings, client=client, store=Store(index_path=settings.index_path, lock_path=settings.lock_path)
    )


def prepare(engine: Engine, raw: bytes | None = None):
    return engine.prepare(
        raw if raw is not None else capture_bytes(PROJ_A), {"User-Agent": UA, "x-session-id": "ses_f"}
    )


@pytest.fixture
def hung_server() -> Iterator[str]:
    """Accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_hung_server_fails_open_within_the_bound(hung_server: str) -> None:
    started = time.monotonic()
    result = prepare(make_engine(hung_server))
    elapsed = time.monotonic() - started
    assert result.action == "failed"
    assert "did not answer within" in result.reason
    assert elapsed < 3.0


def test_refused_connection_fails_open_at_once() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    result = prepare(make_engine(f"http://127.0.0.1:{port}"))
    assert result.action == "failed"
    assert "cannot reach llama-server" in result.reason
    assert result.elapsed_ms < 2000


def test_server_errors_fail_open_with_the_status() -> None:
    url = "http://127.0.0.1:9"
    with respx.mock(base_url=url) as mock:
        mock.route().respond(500, json={"error": {"message": "boom"}})
        result = prepare(make_engine(url))
    assert result.action == "failed"
    assert "HTTP 500" in result.reason and "boom" in result.reason


def test_garbage_server_answers_fail_open() -> None:
    url = "http://127.0.0.1:9"
    with respx.mock(base_url=url) as mock:
        mock.route().respond(200, content=b"\x00not json")
        result = prepare(make_engine(url))
    assert result.action == "failed"
    assert "invalid JSON" in result.reason


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"messages": 3}', b"\xff\xfe", b'{"messages": [1, 2]}'])
def test_garbage_request_bodies_are_skipped_without_a_server(raw: bytes) -> None:
    result = prepare(make_engine("http://127.0.0.1:9"), raw)
    assert result.action == "skipped"
    assert result.reason


@pytest.mark.rig
@pytest.mark.parametrize("fault", ["timeout", "disk-full"])
def test_failed_save_fails_open_and_leaves_no_file(llama_server, fault: str) -> None:
    server = llama_server("qwen3")
    engine = make_engine(server.url, Timeouts(slot_io=1.0))
    with respx.mock(assert_all_called=False) as mock:
        save = mock.post(url__regex=rf"{server.url}/slots/0\?action=save")
        if fault == "timeout":
            save.side_effect = httpx.ReadTimeout("no answer")
        else:
            save.respond(500, json={"error": {"message": "Unable to save slot"}})
        mock.route().pass_through()
        result = prepare(engine)
    assert result.action == "failed"
    assert "could not save" in result.reason
    slot_dir: Path = engine.settings.slot_dir
    assert not list(slot_dir.glob("oc-prefix-*"))  # neither a file nor a .part left behind
    assert not engine.settings.index_path.exists()


@pytest.mark.parametrize("answer", [b"<html>proxy error</html>", b"[1, 2]", b'{"slots": []}'])
def test_the_restart_watch_survives_garbage_slots_answers(answer: bytes) -> None:
    url = "http://127.0.0.1:9"
    engine = make_engine(url)
    with respx.mock(base_url=url) as mock:
        mock.get("/slots").respond(200, content=answer)
        engine.watch()  # must not raise: the daemon's watcher thread would die


def test_the_fast_slots_call_is_bounded_and_translated(hung_server: str) -> None:
    """GET /slots (the hit path's one call) goes over http.client; hung and refused servers
    must still give the client's own errors, within the bound."""
    from oc_prefix_cache.errors import ServerTimeout, ServerUnreachable

    started = time.monotonic()
    with pytest.raises(ServerTimeout, match="did not answer within"):
        SlotClient(hung_server, timeouts=FAST).slots()
    assert time.monotonic() - started < 2.0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnreachable, match="cannot reach llama-server"):
        SlotClient(f"http://127.0.0.1:{port}", timeouts=FAST).slots()


@pytest.mark.rig
def test_the_fast_slots_call_survives_a_server_restart(llama_server) -> None:
    """Its kept-alive connection dies with the server; the next call reconnects."""
    server = llama_server("qwen3", slot_dir=None)
    client = SlotClient(server.url)
    assert client.slots()[0]["id"] == 0
    server.restart()
    assert client.slots()[0]["id"] == 0
    client.close()


PROPS = {
    "model_path": "",
    "total_slots": 1,
    "chat_template": "t",
    "build_info": "b1",
    "default_generation_settings": {"n_ctx": 4096},
}


def test_a_server_without_lora_flags_is_not_asked_for_its_adapters() -> None:
    """`GET /lora-adapters` is a task on the server's queue: under load it took over 5 s and
    prepares failed open on it (issue 17's first ramp). A server started without `--lora` has
    no adapter to activate, so it is not asked; one with `--lora` is."""
    from oc_prefix_cache.llama.server_info import gather_identity

    with respx.mock(base_url="http://127.0.0.1:9", assert_all_called=False) as mock:
        mock.get("/props").respond(json=PROPS)
        adapters = mock.get("/lora-adapters").respond(json=[{"id": 0, "path": "a.gguf", "scale": 1.0}])
        with SlotClient("http://127.0.0.1:9", transport=httpx.HTTPTransport()) as client:
            plain = gather_identity(client, binary=None, argv=["llama-server", "-m", "m.gguf", "-np", "2"])
            assert plain.lora == () and not adapters.called
            loaded = gather_identity(client, binary=None, argv=["llama-server", "--lora", "a.gguf"])
            assert loaded.lora and adapters.call_count == 1
            unknown = gather_identity(client, binary=None, argv=None)  # its command line unseen: ask
            assert unknown.lora == loaded.lora and adapters.call_count == 2


def test_a_lora_read_that_times_out_uses_the_last_answer_of_that_server_process() -> None:
    from oc_prefix_cache.llama.server_info import LoraMemo

    memo = LoraMemo()
    with respx.mock(base_url="http://127.0.0.1:9") as mock:
        route = mock.get("/lora-adapters")
        with SlotClient("http://127.0.0.1:9", timeouts=FAST, transport=httpx.HTTPTransport()) as client:
            route.respond(json=[{"id": 0, "path": "a.gguf", "scale": 0.5}])
            first = memo.read(client, epoch=1, deadline=None)
            route.side_effect = httpx.ReadTimeout("busy")
            assert memo.read(client, epoch=1, deadline=None) == first and memo.fallbacks == 1
            with pytest.raises(ServerTimeout):  # a new server process: nothing known to fall back to
                memo.read(client, epoch=2, deadline=None)
            route.side_effect = httpx.ConnectError("refused")
            with pytest.raises(ServerUnreachable):  # only a timeout falls back
                memo.read(client, epoch=1, deadline=None)
