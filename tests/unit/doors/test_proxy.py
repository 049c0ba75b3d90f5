"""`ocpc proxy` against a stub upstream: faults the real server cannot make on demand, pass-through,
policies, slot holding and the event loop never waiting for a prepare. (The real server: see
test_proxy_server.py; the real harnesses: test_e2e_claude_code.py, test_e2e_pi.py.)"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.head import MAX_BODY_BYTES, Head
from oc_prefix_cache.doors.proxy import Bounds, Proxy
from oc_prefix_cache.doors.proxy_server import ProxyServer
from oc_prefix_cache.engine.prepare import PrepareResult
from oc_prefix_cache.engine.wiring import Engine, engine_for_url
from oc_prefix_cache.harness.base import head_by_markers
from oc_prefix_cache.settings import Settings
from tests.helpers import DATA, ROOT, SUITE_WAIT_S, wait_until

_spec = importlib.util.spec_from_file_location("proxy_bench", ROOT / "bench" / "proxy_bench.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
Stub = bench.Stub

CHAT = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
}


def capture(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    data = json.loads(path.read_text())
    pairs = data["headers"].items() if isinstance(data["headers"], dict) else data["headers"]
    skip = {"content-length", "host", "authorization", "connection"}
    return {str(k).lower(): str(v) for k, v in pairs if str(k).lower() not in skip}, data["body_json"]


class Running:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.server = ProxyServer(proxy, port=0)
        self.url = self.server.url

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = loopback.get(f"{self.url}/ocpc/status", timeout=5).json()
        return data

    def counters(self) -> dict[str, int]:
        return dict(self.status()["counters"])


@pytest.fixture
def proxy_for(tmp_path: Path) -> Iterator[Any]:
    running: list[Running] = []

    def start(
        url: str,
        *,
        bounds: Bounds | None = None,
        adapters: str | None = None,
        engine: Engine | None = None,
        workers: int = 32,
    ) -> Running:
        env = {"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")}
        if adapters is not None:
            env["OC_PREFIX_CACHE_ADAPTERS"] = adapters
        settings = Settings.from_env(env)
        prep = engine or engine_for_url(settings, server_url=url)
        run = Running(Proxy(settings=settings, engine=prep, bounds=bounds, workers=workers))
        run.server.start()
        running.append(run)
        return run

    yield start
    for run in running:
        run.server.stop()


@pytest.fixture
def stub() -> Iterator[Any]:
    with Stub() as running:
        yield running


def post(
    url: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
    timeout: float = 30,
) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return loopback.post(
        url + path, content=raw, headers={"content-type": "application/json", **(headers or {})}, timeout=timeout
    )


def reached(stub: Any, text: str) -> None:
    """Until the upstream has the chat request whose body holds ``text``: from then on that request
    holds its slot (the proxy takes it before forwarding). The event, not a guess of its time."""
    wait_until(
        lambda: any(
            s["method"] == "POST" and s["path"].startswith("/v1/chat/completions") and text.encode() in s["body"]
            for s in list(stub.seen)
        ),
        what=f"no chat request with {text!r} reached the upstream",
    )


def settled(proxy: Running) -> dict[str, Any]:
    """The proxy's status once no slot is busy: a request is recorded, then its slot given back, in a
    worker just after its answer's last byte, so a client can have the whole answer before that."""

    def idle() -> dict[str, Any] | None:
        status = proxy.status()
        return status if not any(slot["busy"] for slot in status["slots"].values()) else None

    return wait_until(idle, what="a slot stayed busy after its request")


# -- faults ------------------------------------------------------------------------------------------


def test_upstream_down_answers_502_with_the_reason(proxy_for: Any) -> None:
    proxy = proxy_for(f"http://127.0.0.1:{bench.free_port()}", bounds=Bounds(connect_s=1))
    started = time.monotonic()
    response = post(proxy.url, CHAT)
    assert response.status_code == 502 and time.monotonic() - started < 5
    assert "cannot reach llama-server" in response.json()["error"]["message"]
    assert loopback.get(proxy.url + "/health", timeout=5).status_code == 502  # pass-through too
    assert proxy.counters()["upstream_failed:unreachable"] == 2


def test_upstream_hung_is_bounded_by_the_headers_wait(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url, bounds=Bounds(headers_s=0.5))
    started = time.monotonic()
    response = post(proxy.url, CHAT, headers={"x-stub": "hang"})
    assert response.status_code == 504 and 0.4 < time.monotonic() - started < 5
    assert "did not answer within 0.5 s" in response.json()["error"]["message"]
    assert post(proxy.url, CHAT).status_code == 200  # nothing stuck: the next request goes through


def test_upstream_error_comes_back_unchanged(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    response = post(proxy.url, CHAT, headers={"x-stub": "500"})
    assert response.status_code == 500
    assert response.json() == {"error": {"code": 500, "message": "stub failure", "type": "server_error"}}
    assert post(proxy.url, CHAT).status_code == 200


def test_a_silent_stream_is_cut_at_the_chunk_gap_bound(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url, bounds=Bounds(chunk_gap_s=0.3))
    started = time.monotonic()
    response = post(proxy.url, CHAT, headers={"x-stub": "slow:3:2000"})
    assert response.status_code == 200 and time.monotonic() - started < 2.0  # before the stub's next chunk
    assert response.content.count(b"data:") == 1  # the first chunk, then the gap bound
    assert proxy.counters()["upstream_failed:mid_answer"] == 1
    assert post(proxy.url, CHAT).status_code == 200


def test_streams_pass_through_as_they_arrive(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    arrivals = []
    started = time.monotonic()
    with loopback.stream(
        "POST",
        proxy.url + "/v1/chat/completions",
        content=json.dumps(CHAT).encode(),
        headers={"x-stub": "slow:5:200"},
        timeout=30,
    ) as response:
        for _ in response.iter_raw():
            arrivals.append(time.monotonic() - started)
    # The first chunk long before the last (0.8 s apart as sent; buffered, they would come together).
    # Not "within 0.5 s of the start": on a loaded machine the request's own way there takes longer.
    assert arrivals[-1] - arrivals[0] > 0.4, arrivals


def test_a_client_that_goes_away_cancels_the_upstream_request(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    with loopback.stream(
        "POST",
        proxy.url + "/v1/chat/completions",
        content=json.dumps(CHAT).encode(),
        headers={"x-stub": "slow:100:50"},
        timeout=30,
    ) as response:
        next(response.iter_raw())
    # the stub's next write fails once the proxy has closed the upstream request
    wait_until(lambda: stub.seen[-1].get("cut"), what="the upstream request was not cancelled")
    assert proxy.counters()["client_disconnected"] == 1
    assert post(proxy.url, CHAT).status_code == 200


def test_a_client_that_leaves_once_it_has_the_final_event_still_has_its_reuse_learned(
    proxy_for: Any, stub: Any
) -> None:
    """Codex closes its connection the moment it has the last event, before the server's stream
    ends: the reuse numbers were already relayed, and the report must not be lost with the client
    (a failing Codex end-to-end run after a restart)."""
    proxy = proxy_for(stub.url)
    with loopback.stream(
        "POST",
        proxy.url + "/v1/chat/completions",
        content=json.dumps(CHAT).encode(),
        headers={"x-stub": "linger:2000"},
        timeout=30,
    ) as response:
        for line in response.iter_lines():
            if "[DONE]" in line:
                break
    recent = wait_until(
        lambda: proxy.counters().get("client_disconnected") and proxy.status()["recent"],
        what="the request was not recorded",
    )
    assert proxy.counters()["client_disconnected"] == 1
    assert recent[-1]["cache_n"] == 100 and recent[-1]["prompt_n"] == 5, recent


# -- what is forwarded unchanged -----------------------------------------------------------------------


def test_everything_else_passes_through_untouched(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    for path in ("/health", "/v1/models", "/props", "/"):
        response = loopback.get(proxy.url + path, headers={"x-custom": "1"}, timeout=5)
        assert response.status_code == 200 and stub.seen[-1]["path"] == path
        assert stub.seen[-1]["headers"]["x-custom"] == "1"
    raw = b'{"content": "hello", "with_pieces": true}'
    for path in ("/tokenize", "/v1/messages/count_tokens?beta=true"):
        assert post(proxy.url, raw, path=path).json() == {"echo": len(raw)}
        assert stub.seen[-1]["body"] == raw and stub.seen[-1]["path"] == path
    assert proxy.counters()["passed_through"] == 6 and not any(k.startswith("prepare") for k in proxy.counters())


def test_an_oversized_body_streams_through_unprepared(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    body = json.dumps({**CHAT, "pad": "x" * (MAX_BODY_BYTES + 1000)}).encode()
    response = post(proxy.url, body)
    assert response.status_code == 200  # never a 413
    assert stub.seen[-1]["body"] == body
    counters = proxy.counters()
    assert counters["not_prepared:oversized"] == 1 and "prepare:skipped" not in counters


@pytest.mark.parametrize(
    ("headers", "counter"),
    [
        ({"origin": "https://example.com"}, "not_prepared:foreign_origin"),
        ({"host": "attacker.example:8766"}, "not_prepared:foreign_host"),
    ],
)
def test_requests_a_web_page_could_send_are_forwarded_without_a_prepare(
    proxy_for: Any, stub: Any, headers: dict[str, str], counter: str
) -> None:
    proxy = proxy_for(stub.url)
    raw = json.dumps(CHAT).encode()
    assert post(proxy.url, raw, headers=headers).status_code == 200
    assert stub.seen[-1]["body"] == raw
    assert proxy.counters()[counter] == 1
    refused = loopback.get(proxy.url + "/ocpc/status", headers={"origin": "https://example.com"}, timeout=5)
    assert refused.status_code == 403


def test_a_garbage_body_goes_to_the_server_unchanged(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url)
    assert post(proxy.url, b"{not json").status_code == 200
    assert stub.seen[-1]["body"] == b"{not json"
    assert proxy.counters()["not_prepared:not_json"] == 1


def test_a_switched_off_adapter_passes_the_bytes_unchanged(proxy_for: Any, stub: Any) -> None:
    headers, body = capture(DATA / "claude-code-2.1.332" / "A1.json")
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    off = proxy_for(stub.url, adapters="none")
    assert post(off.url, raw, headers=headers, path="/v1/messages?beta=true").status_code == 200
    assert stub.seen[-1]["path"] == "/v1/messages?beta=true" and stub.seen[-1]["body"] == raw
    assert off.counters()["not_prepared:adapter_off"] == 1
    on = proxy_for(stub.url, adapters="opencode,pi,generic")  # claude-code off, generic on: still unchanged
    assert post(on.url, raw, headers=headers, path="/v1/messages?beta=true").status_code == 200
    assert stub.seen[-1]["body"] == raw and on.counters()["not_prepared:adapter_off"] == 1


def test_opencode_through_the_proxy_cuts_its_head_at_the_operators_markers(stub: Any, tmp_path: Path) -> None:
    """``OC_PREFIX_CACHE_MARKERS`` moves OpenCode's head cut on the plugin's path; through the
    proxy the same request must be cut at the same place (the proxy's OpenCode adapter used a
    fixed ``<env>``, so the two paths of one ``ocpc launch`` planned two different heads)."""
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"), "OC_PREFIX_CACHE_MARKERS": "<mine>"})
    seen: list[dict[str, Any]] = []

    class Recording(SlowEngine):
        def prepare(self, raw: bytes, headers: Any, **kwargs: Any) -> PrepareResult:
            seen.append(kwargs)
            return super().prepare(raw, headers, **kwargs)

    recording = Recording(engine_for_url(settings, server_url=stub.url), delay=0)
    run = Running(Proxy(settings=settings, engine=recording))  # type: ignore[arg-type]
    run.server.start()
    try:
        body = {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "read", "parameters": {}}}],
            "messages": [
                {"role": "system", "content": "You are OpenCode. <mine>cwd: /a"},
                {"role": "user", "content": "hi"},
            ],
        }
        assert post(run.url, body, headers={"user-agent": "opencode/1.18.33"}).status_code == 200
    finally:
        run.server.stop()
    assert seen and seen[0]["head_of"].__self__.name == "opencode"
    head = seen[0]["head_of"](body)
    assert isinstance(head, Head) and head.marker == "<mine>" and head.system_head == "You are OpenCode. "
    assert head == head_by_markers(body, settings.markers)  # the plugin's path: the Engine's default rule


# -- slots and the event loop ------------------------------------------------------------------------


class SlowEngine:
    """A real Engine whose prepare takes ``delay`` s for requests marked ``x-slow`` (a warm)."""

    def __init__(self, inner: Engine, delay: float) -> None:
        self._inner, self.delay = inner, delay
        self.server, self.tracker = inner.server, inner.tracker
        self.calls: list[float] = []

    def prepare(self, raw: bytes, headers: Any, **kwargs: Any) -> PrepareResult:
        self.calls.append(time.monotonic())
        if "x-slow" in headers:
            time.sleep(self.delay)
        return self._inner.prepare(raw, headers, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_slow_prepare_never_stalls_another_stream(proxy_for: Any, tmp_path: Path) -> None:
    with Stub(slots=2) as stub:
        settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
        slow = SlowEngine(engine_for_url(settings, server_url=stub.url), delay=2.0)
        proxy = proxy_for(stub.url, engine=slow)  # type: ignore[arg-type]
        gaps: list[float] = []

        def stream() -> None:
            last = time.monotonic()
            with loopback.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                timeout=30,
                content=json.dumps(CHAT).encode(),
                headers={"x-stub": "slow:40:50"},
            ) as response:
                for _ in response.iter_raw():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.3)
        other = {**CHAT, "messages": [{"role": "user", "content": "another conversation"}]}
        started = time.monotonic()
        assert post(proxy.url, other, headers={"x-slow": "1"}).status_code == 200
        assert time.monotonic() - started >= 2.0  # that prepare did take its 2 s
        reader.join(SUITE_WAIT_S)
        # ...while the stream flowed: chunks 50 ms apart, no gap near the prepare's 2 s (a loaded
        # machine stretches a gap now and then, so not "under 0.5 s")
        assert len(gaps) > 30 and max(gaps[1:]) < 1.5, gaps


def test_a_request_for_a_held_slot_waits_within_its_deadline_then_fails_open(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url, bounds=Bounds(prepare_s=0.6))  # -np 1: both want slot 0
    first_done: list[float] = []

    def first() -> None:
        response = post(proxy.url, CHAT, headers={"x-stub": "slow:30:100"})  # holds slot 0 for ~3 s
        assert response.status_code == 200
        first_done.append(time.monotonic())

    thread = threading.Thread(target=first)
    thread.start()
    reached(stub, "hi")  # the first request has the slot
    started = time.monotonic()
    second = post(proxy.url, {**CHAT, "messages": [{"role": "user", "content": "other"}]})
    waited = time.monotonic() - started
    assert second.status_code == 200 and 0.5 < waited < 2.5  # waited its 0.6 s, then went on (not ~3 s)
    thread.join(SUITE_WAIT_S)
    assert first_done and first_done[0] > started + waited  # ...while the first still streamed
    assert proxy.counters()["fail_open:slot_busy"] == 1
    # once free, the slot is taken at once: no second fail-open (a clock would measure the machine)
    assert post(proxy.url, CHAT).status_code == 200
    assert proxy.counters()["fail_open:slot_busy"] == 1


def last_post(stub: Any) -> dict[str, Any]:
    """The last request the upstream got from the proxy's forward (a prepare's or a report's
    look at the slots may come after it)."""
    return next(seen for seen in reversed(stub.seen) if seen["method"] == "POST")


def test_with_two_slots_requests_are_pinned(proxy_for: Any) -> None:
    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url)
        chat_a = {**CHAT, "messages": [{"role": "user", "content": "a"}]}
        chat_b = {**CHAT, "messages": [{"role": "user", "content": "b"}]}
        slots = []
        for body in (chat_a, chat_b, chat_a, chat_b):
            assert post(proxy.url, body).status_code == 200
            sent = json.loads(last_post(stub)["body"])
            slots.append(sent["id_slot"])
            assert {k: v for k, v in sent.items() if k != "id_slot"} == body  # nothing else changed
        assert slots[0] != slots[1] and slots[0] == slots[2] and slots[1] == slots[3]
        assert post(proxy.url, {**chat_a, "id_slot": 1}).status_code == 200
        assert json.loads(last_post(stub)["body"])["id_slot"] == 1  # a client's own choice is kept...
        assert {k: proxy.status()["recent"][-1][k] for k in ("slot", "rule")} == {"slot": 1, "rule": "client"}
        # ...and is the slot prepared and held
        assert post(proxy.url, {**chat_b, "id_slot": -1}).status_code == 200  # llama.cpp's "any slot"
        ran = json.loads(last_post(stub)["body"])["id_slot"]
        assert ran in (0, 1) and ran == proxy.status()["recent"][-1]["slot"]  # runs where it was prepared
        assert post(proxy.url, {**chat_b, "id_slot": 7}).status_code == 200  # no such slot: not ours to fix
        assert json.loads(last_post(stub)["body"])["id_slot"] == 7
        assert proxy.counters()["not_prepared:unknown_slot"] == 1

        def new_conversation(i: int) -> None:
            post(
                proxy.url,
                {**CHAT, "messages": [{"role": "user", "content": f"new {i}"}]},
                headers={"x-stub": "slow:3:100"},
            )

        threads = [threading.Thread(target=new_conversation, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SUITE_WAIT_S)
        last_two = [r["slot"] for r in settled(proxy)["recent"][-2:]]
        assert sorted(last_two) == [0, 1], last_two  # two new conversations at once: one slot each


def test_more_waiting_requests_than_workers_do_not_deadlock_the_releases(proxy_for: Any, stub: Any) -> None:
    """Every worker may be waiting for the held slot; the request holding it still releases it
    (releases have workers of their own), so the waiting ones get the slot one after another."""
    proxy = proxy_for(stub.url, bounds=Bounds(prepare_s=20), workers=2)  # -np 1: all want slot 0
    done: list[tuple[int, float]] = []
    started = time.monotonic()

    def one(i: int) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": f"conversation {i}"}]}
        assert post(proxy.url, body, headers={"x-stub": "slow:5:60"}).status_code == 200
        done.append((i, time.monotonic() - started))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join(SUITE_WAIT_S)
    assert len(done) == 5 and max(t for _, t in done) < 10.0, done  # ~5 x 0.3 s, not a 20 s deadline
    assert "fail_open:slot_busy" not in proxy.counters()


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--port", "TAKEN"]])
def test_the_cli_says_what_is_wrong_in_one_line(args: list[str]) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        proc = subprocess.run(
            [sys.executable, "-m", "oc_prefix_cache", "proxy", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert ("loopback only" if "--host" in args else "cannot listen on 127.0.0.1") in lines[0]


# -- many agents on a few slots (issue 17's defects; each failed before its fix) ---------------------

TOOLS = [
    {
        "type": "function",
        "function": {"name": "read", "description": "read a file", "parameters": {"type": "object", "properties": {}}},
    }
]


def agent_body(text: str) -> dict[str, Any]:
    return {
        **CHAT,
        "tools": TOOLS,
        "messages": [{"role": "system", "content": "you are an agent"}, {"role": "user", "content": text}],
    }


def sent_slot(stub: Any, text: str) -> int:
    """The id_slot the upstream got for the request whose last message is ``text``."""
    for seen in reversed(stub.seen):
        if seen["method"] == "POST" and text.encode() in seen["body"]:
            return int(json.loads(seen["body"])["id_slot"])
    raise AssertionError(f"no request with {text!r} reached the upstream")


def test_a_conversation_the_plugin_left_in_a_slot_is_not_given_to_a_proxied_one(proxy_for: Any) -> None:
    """`ocpc launch -np 2`: the plugin's conversation lives on slot 0 (the daemon's record in the
    shared tracker). A new proxied conversation takes the idle slot 1, not slot 0."""
    from oc_prefix_cache.engine.tracker import Holding, Observation

    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url)
        left = Observation(id_task=1, n_tokens=0, n_processed=None, n_cached=None)
        proxy.proxy.tracker.leave(
            stub.url,
            0,
            Holding(kind="conv", key="ses_oc", head="H", n_tokens=9000, exact=False, left=left, conversation="ses_oc"),
        )
        assert post(proxy.url, agent_body("a claude code session")).status_code == 200
        assert sent_slot(stub, "a claude code session") == 1


def test_with_every_slot_busy_a_request_takes_the_first_slot_that_frees(proxy_for: Any) -> None:
    """Both slots busy, slot 0 for long: a new conversation waits for whichever slot frees first
    (slot 1, soon), not on the LRU slot's lock until its long answer ends."""
    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url)
        threads = [
            threading.Thread(target=post, args=(proxy.url, agent_body(text)), kwargs={"headers": {"x-stub": mode}})
            for text, mode in (("long one", "slow:60:100"), ("short one", "slow:6:100"))
        ]
        for thread, (text, _) in zip(threads, (("long one", ""), ("short one", "")), strict=True):
            thread.start()
            reached(stub, text)  # in this order: the long one on a slot first
        started = time.monotonic()
        assert post(proxy.url, agent_body("a third agent")).status_code == 200
        waited = time.monotonic() - started
        assert sent_slot(stub, "a third agent") == sent_slot(stub, "short one")
        assert waited < 4.5, waited  # the long answer takes ~6 s, the short one ~0.6
        for thread in threads:
            thread.join(SUITE_WAIT_S)


def test_a_request_with_no_head_does_not_run_over_its_sessions_slot(proxy_for: Any) -> None:
    """A title request (no tools) of a session whose conversation holds slot 0 goes to the free
    slot: it would wipe the conversation it shares the session id with."""
    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url)
        session = {"x-session-id": "ses_title"}
        assert post(proxy.url, agent_body("the conversation"), headers=session).status_code == 200
        own = sent_slot(stub, "the conversation")
        title = {**CHAT, "messages": [{"role": "user", "content": "a title for this"}]}
        assert post(proxy.url, title, headers=session).status_code == 200
        assert sent_slot(stub, "a title for this") != own
        assert post(proxy.url, agent_body("the conversation"), headers=session).status_code == 200
        assert sent_slot(stub, "the conversation") == own  # the conversation kept its slot


def test_a_body_that_cannot_be_serialised_leaves_no_slot_busy(proxy_for: Any) -> None:
    """A lone surrogate (a truncated emoji) cannot be written as UTF-8: the request goes on
    unchanged and the slot it was about to take is not left busy for ever."""
    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url)
        raw = (
            b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"},'
            b'{"role":"assistant","content":"yes"},{"role":"user","content":"broken \\ud83d"}]}'
        )
        post(proxy.url, raw, path="/v1/messages")
        settled(proxy)  # the slot goes back in a worker just after the answer: not left busy for ever


def test_a_client_that_stops_reading_gives_its_slot_up(proxy_for: Any, stub: Any) -> None:
    """A Ctrl-Z'd agent: its socket full, the proxy's send waits. Past the stall bound its answer
    is cut and the slot freed for the next request (-np 1: everyone's)."""
    import socket

    proxy = proxy_for(stub.url, bounds=Bounds(client_stall_s=1.0))
    port = int(proxy.url.rsplit(":", 1)[1])
    raw = json.dumps(agent_body("never read")).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"x-stub: stream:400000\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    try:
        reached(stub, "never read")  # its answer streams into a socket nobody reads
        started = time.monotonic()
        assert post(proxy.url, agent_body("the next agent"), timeout=60).status_code == 200
        assert time.monotonic() - started < 15
        assert proxy.counters().get("client_stalled") == 1
    finally:
        sock.close()


def test_a_client_that_leaves_while_waiting_for_its_slot_gets_no_prepare(proxy_for: Any, tmp_path: Path) -> None:
    """A request waiting for a held slot whose client gives up (a cancelled turn) must not, once
    the slot frees, prepare, park or evict anything for nobody."""
    import socket

    with Stub(slots=1) as stub:
        settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
        counting = SlowEngine(engine_for_url(settings, server_url=stub.url), delay=0.0)
        proxy = proxy_for(stub.url, engine=counting)  # type: ignore[arg-type]
        first = threading.Thread(
            target=post, args=(proxy.url, agent_body("holds the slot")), kwargs={"headers": {"x-stub": "slow:20:100"}}
        )
        first.start()
        reached(stub, "holds the slot")
        raw = json.dumps(agent_body("gives up")).encode()
        arrived = proxy.proxy.counters.snapshot().get("requests", 0)
        with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)
            )
            wait_until(lambda: proxy.proxy.counters.snapshot().get("requests", 0) > arrived, what="it did not arrive")
            time.sleep(0.3)  # and waits for the slot (a shorter stay only tests the earlier way out)
        first.join(SUITE_WAIT_S)
        wait_until(lambda: proxy.counters().get("client_gone_before_prepare"), what="the departure was not seen")
        assert len(counting.calls) == 1  # the first request's prepare only
        assert not any(b"gives up" in s["body"] for s in stub.seen)
        assert proxy.counters().get("client_gone_before_prepare") == 1


# -- fallbacks forward a body the server accepts (issue 18) ------------------------------------------


def claude_code_request() -> tuple[dict[str, str], dict[str, Any]]:
    headers, body = capture(DATA / "claude-code-2.1.332" / "A1.json")
    assert any(m["role"] == "system" for m in body["messages"])  # what b11434 answers with HTTP 500
    return headers, body


def system_entries(seen: dict[str, Any]) -> int:
    return sum(m.get("role") == "system" for m in json.loads(seen["body"])["messages"])


def test_an_oversized_claude_code_body_is_forwarded_normalised(proxy_for: Any, stub: Any) -> None:
    """A Claude Code session past the 8 MiB prepare limit (screenshots) went upstream raw, with
    its in-message `role: system` entries: on the Qwen3.5 template every turn failed with HTTP 500.
    Now it is read whole (up to 64 MiB) and forwarded with the adapter's normalisations, unprepared."""
    proxy = proxy_for(stub.url)
    headers, body = claude_code_request()
    body["messages"][0]["content"].append({"type": "text", "text": "x" * (MAX_BODY_BYTES + 1000)})
    response = post(proxy.url, body, headers=headers, path="/v1/messages")
    assert response.status_code == 200
    seen = last_post(stub)
    assert seen["path"].startswith("/v1/messages") and system_entries(seen) == 0
    counters = proxy.counters()
    assert counters["not_prepared:oversized"] == 1 and counters["normalised_unprepared:claude-code"] == 1


def test_a_request_whose_planning_fails_is_forwarded_normalised(
    proxy_for: Any, stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = proxy_for(stub.url)

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(proxy.proxy, "_parse", broken)
    headers, body = claude_code_request()
    assert post(proxy.url, body, headers=headers, path="/v1/messages").status_code == 200
    assert system_entries(last_post(stub)) == 0 and proxy.counters()["fail_open:internal"] == 1
    raw = json.dumps(CHAT).encode()  # nothing to normalise: the very bytes
    assert post(proxy.url, raw).status_code == 200 and last_post(stub)["body"] == raw


def test_a_switched_off_adapter_still_forwards_the_very_bytes_when_oversized(proxy_for: Any, stub: Any) -> None:
    proxy = proxy_for(stub.url, adapters="opencode,pi,generic")
    headers, body = claude_code_request()
    body["messages"][0]["content"].append({"type": "text", "text": "x" * (MAX_BODY_BYTES + 1000)})
    raw = json.dumps(body).encode()
    assert post(proxy.url, raw, headers=headers, path="/v1/messages").status_code == 200
    assert last_post(stub)["body"] == raw  # the user switched its normalisations off


def test_a_pinned_chat_body_that_cannot_be_serialised_leaves_no_slot_held(proxy_for: Any) -> None:
    """Issue 36, defect 2: ``"id_slot": -1`` plus a lone surrogate (an agent in JS cutting tool output
    mid-emoji). The body parses, the broker takes a slot, and re-serialising the body with its
    slot failed: the request must still go on, and the slot must come back (busy 0, lock free),
    so the next request for that slot does not wait out its deadline."""
    with Stub(slots=2) as stub:
        proxy = proxy_for(stub.url, bounds=Bounds(prepare_s=5))
        raw = (
            b'{"model":"m","id_slot":-1,"messages":[{"role":"system","content":"be brief"},'
            b'{"role":"user","content":"broken \\ud83d"}]}'
        )
        assert post(proxy.url, raw).status_code == 200
        assert all(s["busy"] == 0 for s in proxy.status()["slots"].values()), proxy.status()["slots"]
        tracker = proxy.proxy.tracker
        assert tracker.locked(proxy.proxy.server) == []
        started = time.monotonic()
        for _ in range(2):  # both slots: neither waits for a lock nobody will release
            assert post(proxy.url, {**CHAT, "messages": [{"role": "user", "content": "next"}]}).status_code == 200
        assert time.monotonic() - started < 4.0
        assert "fail_open:slot_busy" not in proxy.counters()


def test_a_request_queued_behind_busy_workers_waits_its_bound_from_arrival_not_twice(proxy_for: Any, stub: Any) -> None:
    """Issue 36, defect 7: the deadline starts when a request arrives, not when a planning worker
    picks it up. One worker, -np 1, a first request holding the slot: the second waits in the
    worker for the slot, the third in the worker queue behind it. The third must go on once its
    own bound (counted from its arrival) is spent, not after its queue time plus a whole bound."""
    bound = 1.5
    proxy = proxy_for(stub.url, bounds=Bounds(prepare_s=bound), workers=1)
    threading.Thread(
        target=post, args=(proxy.url, CHAT), kwargs={"headers": {"x-stub": "slow:60:100"}}, daemon=True
    ).start()  # holds slot 0 for ~6 s
    reached(stub, "hi")
    waits: dict[int, float] = {}

    def other(i: int) -> None:
        started = time.monotonic()
        post(proxy.url, {**CHAT, "messages": [{"role": "user", "content": f"other {i}"}]})
        waits[i] = time.monotonic() - started

    threads = [threading.Thread(target=other, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(SUITE_WAIT_S)
    # both waited about their bound (each the slot, one of them the worker too), neither twice it
    assert len(waits) == 2 and max(waits.values()) < 2 * bound - 0.2, waits


def test_a_client_that_stalls_on_the_last_send_gives_its_slot_up(tmp_path: Path) -> None:
    """Issue 36, defect 6: the last send of an answer (``more_body: False``) was not bounded, so a
    client that stopped reading just then held its slot for good. The socket cannot be made to
    fill at exactly that send, so the ASGI ``send`` is a stand-in that never returns for it."""
    import asyncio

    with Stub(slots=2) as stub:
        settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
        proxy = Proxy(
            settings=settings, engine=engine_for_url(settings, server_url=stub.url), bounds=Bounds(client_stall_s=0.5)
        )
        body = json.dumps({**CHAT, "stream": False}).encode()
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1:8766"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client never leaves: it only stops reading
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await asyncio.sleep(3600)  # the socket is full at the very last send
            sent.append(message)

        async def run() -> None:
            await asyncio.wait_for(proxy(scope, receive, send), timeout=20)

        asyncio.run(run())
        assert sent and sent[0]["type"] == "http.response.start"
        assert proxy.counters.snapshot().get("client_stalled") == 1
        assert proxy.broker.table.busy() == set() and proxy.tracker.locked(proxy.server) == []
        proxy.close()
