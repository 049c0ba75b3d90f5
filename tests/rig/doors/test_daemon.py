"""The daemon's HTTP face, on loopback, against the real server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.engine.broker import Ask
from oc_prefix_cache.engine.wiring import build_engine
from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.settings import Settings
from tests.helpers import (
    CAPTURES,
    PROJ_A,
    PROJ_A_TURN2,
    PROJ_B,
    ROOT,
    SUITE_WAIT_S,
    UA,
    capture,
    capture_bytes,
    chat,
    sized,
    wait_until,
)


def settings_for(url: str) -> Settings:
    return Settings.from_env({**os.environ, "OC_PREFIX_CACHE_BASE_URL": url})


@pytest.fixture
def daemon_for(llama_server) -> Iterator:
    started: list[Daemon] = []

    def make(model: str = "qwen35") -> tuple:
        server = llama_server(model)
        runner = Daemon(settings=settings_for(server.url), port=0)
        runner.start()
        started.append(runner)
        return server, runner

    yield make
    for runner in started:
        runner.stop()


def post_prepare(daemon_url: str, name: str, session: str) -> dict:
    response = loopback.post(
        f"{daemon_url}/v1/prepare",
        content=capture_bytes(name),
        timeout=120,
        headers={"User-Agent": UA, "x-session-id": session, "Content-Type": "application/json"},
    )
    assert response.status_code == 200
    assert response.headers["x-ocpc-state"] == "working"
    return response.json()


@pytest.mark.rig
def test_prepare_report_and_status_over_http(daemon_for) -> None:
    server, runner = daemon_for("qwen35")
    first = post_prepare(runner.url, PROJ_A, "ses_a")
    assert first["action"] == "warmed"
    assert set(first) >= {"action", "fingerprint", "prefix_tokens", "elapsed_ms", "reason"}
    second = post_prepare(runner.url, PROJ_B, "ses_b")
    assert second["action"] == "restored"  # the slot holds project A's head: a hybrid restores the head
    timings = chat(server.url, capture(PROJ_B))
    report = loopback.post(
        f"{runner.url}/v1/report",
        json={"fingerprint": second["fingerprint"], "cache_n": timings.cache_n, "prompt_n": timings.prompt_n},
    )
    assert report.status_code == 200 and report.json()["verdict"] == "served"

    status = loopback.get(f"{runner.url}/v1/status").json()
    assert status["daemon"]["counters"]["warmed"] == 1
    assert status["daemon"]["counters"]["restored"] == 1
    assert status["daemon"]["last_report"]["cache_n"] == timings.cache_n
    assert first["fingerprint"] in [f["fingerprint"] for f in status["disk"]]
    assert status["server"]["healthy"] is True
    assert loopback.get(f"{runner.url}/health").json()["status"] == "ok"


@pytest.mark.rig
def test_two_sessions_starting_at_once_warm_only_once(daemon_for) -> None:
    _, runner = daemon_for("qwen3")
    answers: list[dict] = []

    def go(name: str, session: str) -> None:
        answers.append(post_prepare(runner.url, name, session))

    threads = [threading.Thread(target=go, args=(PROJ_A, "ses_a")), threading.Thread(target=go, args=(PROJ_B, "ses_b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a["action"] for a in answers) == ["hit", "warmed"]
    assert len({a["fingerprint"] for a in answers}) == 1


@pytest.mark.rig
def test_two_daemons_on_the_same_state_keep_the_index_whole(llama_server) -> None:
    server = llama_server("qwen35")
    settings = settings_for(server.url)
    engines = [
        build_engine(
            settings=settings,
            client=SlotClient(server.url),
            store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
        )
        for _ in range(2)
    ]
    answers: list = []
    threads = [
        threading.Thread(
            target=lambda p=p, s=s: answers.append(
                p.prepare(capture_bytes(PROJ_A), {"User-Agent": UA, "x-session-id": s})
            )
        )
        for p, s in zip(engines, ("a", "b"), strict=False)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    actions = sorted(a.action for a in answers)
    assert actions == ["restored", "warmed"], answers
    index = json.loads(settings.index_path.read_text())
    assert [k for k, e in index["entries"].items() if e["kind"] == "head"] == [answers[0].fingerprint]


def test_bad_input_gets_clear_errors(tmp_path) -> None:
    runner = Daemon(settings=settings_for("http://127.0.0.1:9"), port=0)
    runner.start()
    try:
        as_json = {"Content-Type": "application/json"}
        bad = loopback.post(f"{runner.url}/v1/report", content=b"{nope", headers=as_json)
        assert bad.status_code == 400 and "bad report" in bad.json()["error"]
        wrong = loopback.post(f"{runner.url}/v1/report", json={"fingerprint": "x", "cache_n": "many", "prompt_n": 1})
        assert wrong.status_code == 400
        garbage = loopback.post(f"{runner.url}/v1/prepare", content=b"\x00\x01garbage", headers=as_json)
        assert garbage.status_code == 200 and garbage.json()["action"] == "skipped"
        assert loopback.get(f"{runner.url}/nope").status_code == 404
        host, port = runner.httpd.server_address[:2]
        with socket.create_connection((str(host), port)) as sock:
            sock.sendall(
                b"POST /v1/prepare HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 999999999\r\n\r\n"
            )
            head = sock.recv(4096).decode()
        assert head.startswith("HTTP/1.1 413")
        with socket.create_connection((str(host), port)) as sock:
            sock.sendall(b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\r\n")
            answer = sock.recv(4096).decode()
        assert answer.count("HTTP/1.1 ") == 1 and answer.startswith("HTTP/1.1 411")
        assert loopback.get(f"{runner.url}/health").status_code == 200  # still serving
    finally:
        runner.stop()


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Origin": "https://evil.example", "Content-Type": "application/json"}, 403),
        ({"Host": "evil.example:8765", "Content-Type": "application/json"}, 403),
        ({"Content-Type": "text/plain"}, 415),
    ],
)
def test_browsers_and_rebound_names_are_refused(headers: dict, status: int) -> None:
    runner = Daemon(settings=settings_for("http://127.0.0.1:9"), port=0)
    runner.start()
    try:
        answer = loopback.post(f"{runner.url}/v1/prepare", content=capture_bytes(PROJ_A), headers=headers)
        assert answer.status_code == status, answer.text
        assert runner.engine.status()["counters"]["skipped"] == 0  # never reached the engine
    finally:
        runner.stop()


def test_daemon_refuses_non_loopback_hosts() -> None:
    with pytest.raises(ConfigError, match="loopback"):
        Daemon(settings=settings_for("http://127.0.0.1:9"), host="0.0.0.0", port=0)


@pytest.mark.rig
def test_the_daemon_notices_a_server_restart_by_itself(llama_server) -> None:
    server = llama_server("qwen35")
    runner = Daemon(settings=settings_for(server.url), port=0, watch_interval=0.1)
    runner.start()
    try:
        assert post_prepare(runner.url, PROJ_A, "ses_a")["action"] == "warmed"
        chat(server.url, capture(PROJ_A))
        epoch = runner.tracker.epoch(runner.engine.server)
        server.restart()
        wait_until(
            lambda: runner.tracker.epoch(runner.engine.server) > epoch,  # its watch, not a prepare
            what="the daemon's watch did not notice the restart",
        )
        turn2 = post_prepare(runner.url, PROJ_A_TURN2, "ses_a")
        assert turn2["action"] == "restored", turn2
    finally:
        runner.stop()


def test_daemon_listens_on_ipv6_loopback_too() -> None:
    runner = Daemon(settings=settings_for("http://127.0.0.1:9"), host="::1", port=0)
    runner.start()
    try:
        assert runner.url.startswith("http://[::1]:")
        assert loopback.get(f"{runner.url}/health").json()["status"] == "ok"
    finally:
        runner.stop()


# -- compatibility: the plugin a user installed earlier keeps working ------------------------


@pytest.mark.rig
@pytest.mark.parametrize("plugin", ["tests/data/plugin-0.1.0/ocpc-plugin.js", "plugin-js/ocpc-plugin.js"])
def test_the_previous_and_the_current_plugin_drive_the_new_daemon(daemon_for, plugin: str, tmp_path: Path) -> None:
    """`ocpc install` copies the plugin; an upgrade of the package must not break a copy
    that is already installed. Both talk to the new daemon through a real fetch chain."""
    node = shutil.which("node")
    assert node, "node is needed to run the OpenCode plugin"
    server, runner = daemon_for("qwen35")
    log = tmp_path / "plugin.jsonl"
    turns = [f"{CAPTURES / PROJ_A}:ses_a", f"{CAPTURES / PROJ_A_TURN2}:ses_a", f"{CAPTURES / PROJ_B}:ses_b"]
    proc = subprocess.run(
        [node, str(ROOT / "tests/node/drive_plugin.mjs"), str(ROOT / plugin), runner.url, server.url, str(log), *turns],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    sent = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [s["status"] for s in sent] == [200, 200, 200], sent
    events = [json.loads(line) for line in log.read_text().splitlines()]
    actions = [e["action"] for e in events if e["ev"] == "prepare"]
    assert len(actions) == 3 + sum(s["retried"] for s in sent), actions  # a retry is prepared again
    assert actions[0] == "warmed" and actions[-1] == "restored", actions
    # the old plugin does not wait for its report before the next prepare, so its second turn
    # may find the slot not yet tied to the conversation: then it is left alone ("skipped")
    assert set(actions[1:-1]) <= ({"hit", "skipped"} if "0.1.0" in plugin else {"hit"}), actions
    counters = runner.engine.status()["counters"]
    assert counters["report_served"] >= 2 and counters.get("report_missed", 0) == 0, counters


@pytest.mark.rig
@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_a_turn_sent_the_moment_a_restarted_server_answers_is_never_a_false_hit(daemon_for, model: str) -> None:
    """Defect 1: the hit path used to make no server call, and a restart was noticed by a
    1-second watcher; a turn arriving within that second was told `hit` on an empty slot.
    Like an on-demand starter, send the turn as soon as /health answers 200 (each try lands
    within the watcher's second): 8 times, 20 with OCPC_FULL_TESTS=1."""
    server, runner = daemon_for(model)
    first = post_prepare(runner.url, PROJ_A, "ses_a")
    head = first["prefix_tokens"]
    for i in range(sized(20, 8)):
        timings = chat(server.url, capture(PROJ_A_TURN2))
        loopback.post(
            f"{runner.url}/v1/report",
            json={"fingerprint": first["fingerprint"], "cache_n": timings.cache_n, "prompt_n": timings.prompt_n},
        )
        server.restart()  # returns the moment /health answers 200
        answer = post_prepare(runner.url, PROJ_A_TURN2, "ses_a")
        after = chat(server.url, capture(PROJ_A_TURN2))
        assert not (answer["action"] == "hit" and after.cache_n < 0.9 * head), (i, answer, after)
        assert answer["action"] == "restored", (i, answer)
        assert after.cache_n >= 0.9 * head, (i, after)


def test_reading_the_status_from_a_web_page_is_refused() -> None:
    """DNS rebinding: a page could read /v1/status (paths, models, sessions) through GET."""
    runner = Daemon(settings=settings_for("http://127.0.0.1:9"), port=0)
    runner.start()
    try:
        for headers in ({"Origin": "https://evil.example"}, {"Host": "evil.example"}):
            for path in ("/v1/status", "/health"):
                answer = loopback.get(f"{runner.url}{path}", headers=headers)
                assert answer.status_code == 403, (path, headers, answer.text)
        assert loopback.get(f"{runner.url}/health").status_code == 200
    finally:
        runner.stop()


@pytest.mark.rig
def test_a_pinning_plugin_on_one_slot_holds_it_until_its_report(llama_server) -> None:
    """`ocpc launch -np 1`: the plugin's prepare holds the one slot for its request until the
    report, as on `-np N`, and leaves the body unpinned (one slot: nothing to name). A proxied
    request meanwhile waits for the slot instead of preparing it under the plugin's request.
    Before, on a single-slot server the daemon held nothing: the other front door cleared or
    restored the slot while the plugin's request was on its way, and with 4 agents on `-np 1`
    ocpc served fewer turns than plain llama-server (every prepare skipped or failed)."""
    server = llama_server("qwen35")
    runner = Daemon(settings=settings_for(server.url), port=0)
    runner.start()
    try:
        broker = runner.engine.broker
        answer = loopback.post(
            f"{runner.url}/v1/prepare",
            content=capture_bytes(PROJ_A),
            timeout=120,
            headers={"User-Agent": UA, "x-session-id": "ses_a", "Content-Type": "application/json", "x-ocpc-pin": "1"},
        ).json()
        assert answer["fingerprint"] and (answer["slot"], answer["pin"]) == (0, False), answer
        assert broker.leases() == 1
        proxied = broker.take(Ask("ses_b", n_slots=broker.n_slots()), deadline=Deadline.after(0.5))
        assert proxied.hold is None and proxied.why_not, proxied  # the plugin's request has the slot
        broker.give_back(proxied)
        timings = chat(server.url, capture(PROJ_A))
        verdict = loopback.post(
            f"{runner.url}/v1/report",
            timeout=10,
            json={
                "fingerprint": answer["fingerprint"],
                "prepare_id": answer["prepare_id"],
                "cache_n": timings.cache_n,
                "prompt_n": timings.prompt_n,
                "predicted_n": 4,
            },
        ).json()["verdict"]
        assert verdict == "served" and broker.leases() == 0
        after = broker.take(Ask("ses_b", n_slots=broker.n_slots()), deadline=Deadline.after(5))
        assert after.hold is not None, after  # the report gave it back
        broker.give_back(after)
    finally:
        runner.stop()


@pytest.mark.rig
def test_a_pinning_plugin_on_two_slots_keeps_each_session_on_its_own_slot(llama_server) -> None:
    """`-np 2`, the plugin path with pinning (``x-ocpc-pin: 1``): two sessions get two slots, each
    request is sent to the slot its prepare named, and each session's next turn finds its own
    conversation there (a hit), with no park written: nothing displaced anything. Before, the
    daemon prepared slot 0 for every session and the second session parked the first's."""
    server = llama_server("qwen35", ctx_size=32768, parallel=2)
    runner = Daemon(settings=settings_for(server.url), port=0)
    runner.start()
    try:

        def turn(name: str, session: str) -> dict:
            answer = loopback.post(
                f"{runner.url}/v1/prepare",
                content=capture_bytes(name),
                timeout=120,
                headers={
                    "User-Agent": UA,
                    "x-session-id": session,
                    "Content-Type": "application/json",
                    "x-ocpc-pin": "1",
                },
            ).json()
            assert answer["pin"] is True, answer
            timings = chat(server.url, {**capture(name), "id_slot": answer["slot"]})
            verdict = loopback.post(
                f"{runner.url}/v1/report",
                timeout=10,
                json={
                    "fingerprint": answer["fingerprint"],
                    "prepare_id": answer["prepare_id"],
                    "cache_n": timings.cache_n,
                    "prompt_n": timings.prompt_n,
                    "predicted_n": 4,
                },
            ).json()["verdict"]
            return answer | {"verdict": verdict, "processed": timings.prompt_n}

        a1, b1 = turn(PROJ_A, "ses_a"), turn(PROJ_B, "ses_b")
        assert {a1["slot"], b1["slot"]} == {0, 1}
        a2 = turn(PROJ_A_TURN2, "ses_a")
        assert (a2["slot"], a2["action"], a2["verdict"]) == (a1["slot"], "hit", "served"), a2
        counters = runner.engine.status()["counters"]
        assert counters.get("parked", 0) == 0 and counters.get("report_missed", 0) == 0, counters
        assert runner.engine.broker.leases() == 0  # every report gave its slot back
    finally:
        runner.stop()


def pinned_prepare(runner: Daemon, name: str, session: str) -> socket.socket:
    """A pinning plugin's prepare sent on a raw connection, so a test can close it (the plugin
    giving up) while the daemon works on it."""
    raw = capture_bytes(name)
    sock = socket.create_connection(("127.0.0.1", int(runner.url.rsplit(":", 1)[1])))
    sock.sendall(
        b"POST /v1/prepare HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"user-agent: %s\r\nx-session-id: %s\r\nx-ocpc-pin: 1\r\ncontent-length: %d\r\n\r\n%s"
        % (UA.encode(), session.encode(), len(raw), raw)
    )
    return sock


def counters_once(runner: Daemon, key: str, *, within: float = SUITE_WAIT_S) -> dict:
    """The daemon's counters as soon as ``key`` is counted (or when ``within`` seconds ran out)."""
    until = time.monotonic() + within
    counters: dict = runner.engine.status()["counters"]
    while time.monotonic() < until and not counters.get(key):
        time.sleep(0.2)
        counters = runner.engine.status()["counters"]
    return counters


@pytest.mark.rig
def test_a_plugin_that_gives_up_while_its_prepare_waits_for_the_slot_gets_nothing_prepared(llama_server) -> None:
    """The plugin's prepare waits for the slot another request holds, and the user cancels the
    turn (the plugin aborts its fetch, closing the connection). Once the slot frees, the daemon
    must not prepare it for nobody, nor lend it for a report that will never come: before, it
    warmed the head and kept the slot from the next request until the lease was taken back."""
    server = llama_server("qwen3")
    runner = Daemon(settings=settings_for(server.url), port=0)
    runner.start()
    try:
        broker = runner.engine.broker
        held = broker.take(Ask("ses_other", n_slots=broker.n_slots()), deadline=Deadline.after(5))
        assert held.hold is not None
        with pinned_prepare(runner, PROJ_A, "ses_a") as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # "working": the prepare waits for the slot
        # The plugin is gone: the daemon notices (it looks every 0.25 s) and stops waiting; then the slot frees.
        counters = counters_once(runner, "client_gone_before_prepare")
        broker.give_back(held)
        assert counters.get("client_gone_before_prepare") == 1, counters
        counters = runner.engine.status()["counters"]
        assert not any(counters.get(k) for k in ("warmed", "restored", "hit")), counters  # nothing done to the slot
        assert broker.leases() == 0
        after = broker.take(Ask("ses_b", n_slots=broker.n_slots()), deadline=Deadline.after(2))
        assert after.hold is not None, after  # the next request has the slot at once
        broker.give_back(after)
    finally:
        runner.stop()


@pytest.mark.rig
def test_a_slot_prepared_for_a_plugin_that_gave_up_meanwhile_is_not_lent(llama_server) -> None:
    """The plugin gives up while its prepare warms the head (a first warm takes seconds). The
    warm finishes (the head is saved for the next session), but no report will come: the slot
    goes back at once, not after the lease's grace and two idle looks at the server."""
    server = llama_server("qwen3")
    runner = Daemon(settings=settings_for(server.url), port=0)
    runner.start()
    try:
        broker = runner.engine.broker
        with pinned_prepare(runner, PROJ_A, "ses_a") as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # "working"
            until = time.monotonic() + SUITE_WAIT_S
            while time.monotonic() < until and not any(
                s["is_processing"] for s in loopback.get(f"{server.url}/slots").json()
            ):
                time.sleep(0.05)  # leave once the warm runs in the server
        counters = counters_once(runner, "warmed")
        assert counters.get("warmed") == 1 and counters.get("client_gone_during_prepare") == 1, counters
        assert broker.leases() == 0
        after = broker.take(Ask("ses_b", n_slots=broker.n_slots()), deadline=Deadline.after(2))
        assert after.hold is not None, after  # free for the next request at once
        broker.give_back(after)
    finally:
        runner.stop()
