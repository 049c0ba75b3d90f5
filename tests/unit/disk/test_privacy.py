"""Private by default (issue 36, defect 4): a park's token ids decode to the whole prompt with the
model's tokenizer, and the logs hold session ids, so nothing ocpc keeps may be readable by other
local users. ocpc's folders are 0700, its files 0600, whatever the umask; llama-servers ocpc starts
write their slot files 0600; what an earlier ocpc left open is tightened at start (only ocpc's own
names), and `ocpc doctor` says what is still open, with the fix."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands.doctor import _privacy
from oc_prefix_cache.commands.launch import _write_runtime, launch_lock
from oc_prefix_cache.disk.events import Event, EventLog
from oc_prefix_cache.disk.index import Entry, Index, Store
from oc_prefix_cache.disk.privacy import scan, tighten, tighten_at_start
from oc_prefix_cache.disk.shared_store import SharedStore, box_id
from oc_prefix_cache.disk.slotfile import file_digest, slot_filename
from oc_prefix_cache.doors import token
from oc_prefix_cache.files import file_lock, private_dir, write_private
from oc_prefix_cache.install import install as install_opencode
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import Supervised
from oc_prefix_cache.logs import setup_logging
from oc_prefix_cache.settings import Settings

HEAD = "oc-prefix-0123456789abcdef.bin"
PARK = "oc-conv-fedcba9876543210.bin"


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask most users have: without ocpc's own modes, folders 0755 and files 0644."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) that group or others can read, write or enter."""
    found = []
    for folder, _dirs, files in os.walk(root):
        for path in [Path(folder)] + [Path(folder) / name for name in files]:
            if not os.path.islink(path) and mode(path) & 0o077:
                found.append(f"{path.relative_to(root.parent)} {mode(path):04o}")
    return found


def settings() -> Settings:
    return Settings.from_env()


def test_everything_ocpc_writes_without_a_server_is_private_under_umask_022(umask_022: None, tmp_path: Path) -> None:
    """Every writer of ocpc's state, each making the folders it needs: the index and its lock, the
    event log (and its rollover), the daemon's rotating log (and a rollover), a slot lock, a launch's
    lock and runtime file, the plugin and its settings, the install records and a config's backup,
    and a supervised child's log and what the child itself writes. Before: home, logs/ and
    plugin/ 0755, every file 0644 (the defect)."""
    s = settings()
    assert not s.home.exists()
    Store(index_path=s.index_path, lock_path=s.lock_path).update(lambda index: None)
    events = EventLog(s.log_dir, max_bytes=300)
    for _ in range(3):  # over max_bytes: one rollover to events.jsonl.1
        events.write(
            Event(
                at=1.0,
                door="proxy",
                server="http://x",
                slot=0,
                harness="pi",
                action="hit",
                source="slot",
                cache_n=10,
                prompt_n=1,
            )
        )
    root = logging.getLogger("ocpc")
    setup_logging(s.log_dir / "daemon.log")
    try:
        logging.getLogger("ocpc.test").warning("session ses_secret")
        for handler in root.handlers:
            if isinstance(handler, logging.handlers.RotatingFileHandler):
                handler.doRollover()  # daemon.log.1, and a new daemon.log
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
    with file_lock(s.home / "slot-0123abcd.lock"):
        pass
    port = free_port()
    with launch_lock(s, port):
        _write_runtime(s, port, 1, Path("/bin/llama-server"), ["llama-server"], "http://127.0.0.1:1")
    config = tmp_path / "home" / "config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text('{"$schema": "https://opencode.ai/config.json"}\n')
    install_opencode(
        s,
        config_path=config,
        base_url="http://127.0.0.1:8080",
        provider_id="llamacpp",
        model="local",
        opencode_version=None,
    )
    _run_child_writing(s.log_dir / "made-by-child.txt", log=s.log_dir / f"llama-server-{port}.log")
    # many boxes: the deployment's token (made, rotated), this box's name, and a shared store
    token.create(s.token_path)
    token.rotate(s.token_path)
    store = SharedStore(tmp_path / "store", box=box_id(s.home), slot_dir=s.slot_dir)
    private_dir(s.slot_dir)
    write_private(s.slot_dir / slot_filename("a" * 16, "conv"), b"kv")  # as llama-server under umask 077
    entry = Entry(
        file=slot_filename("a" * 16, "conv"),
        bytes=2,
        prefix_tokens=1,
        created=1,
        last_used=1,
        model="m",
        server_build="b",
        harness="h",
        xxh64=file_digest(s.slot_dir / slot_filename("a" * 16, "conv")),
        kind="conv",
    )
    store.publish(Index(entries={"a" * 16: entry}))
    other = SharedStore(tmp_path / "store", box="other-box", slot_dir=tmp_path / "another-box" / "slots")
    (item,) = other.others()
    assert other.bring(item) is not None

    written = {p.relative_to(s.home).as_posix() for p in s.home.rglob("*")}
    assert {
        "index.json",
        "index.lock",
        "logs/events.jsonl",
        "logs/events.jsonl.1",
        "logs/daemon.log",
        "logs/daemon.log.1",
        "slot-0123abcd.lock",
        f"launch-{port}.lock",
        f"server-{port}.json",
        "plugin/ocpc-plugin.js",
        "plugin/ocpc-plugin.json",
        "install.json",
        f"logs/llama-server-{port}.log",
        "logs/made-by-child.txt",
        "token",
        "token.previous",
        "box-id",
    } <= written, written
    shared = {p.relative_to(tmp_path).as_posix() for p in (tmp_path / "store").rglob("*")}
    assert {f"store/{box_id(s.home)}/index.json", f"store/{box_id(s.home)}/{entry.file}"} <= shared, shared
    assert open_to_others(tmp_path / "store") == [] and open_to_others(tmp_path / "another-box") == []
    assert any(name.startswith("backups/opencode.json.") for name in written), written
    assert open_to_others(s.home) == []
    assert mode(config) == 0o644  # the user's own config keeps its mode
    # and every file written is known as ocpc's: an earlier ocpc's open home is tightened, not left
    # alone as a home holding files not ocpc's (the token, once, was not known)
    for path in (s.home, s.slot_dir):
        path.chmod(0o755)
    tighten_at_start(s)
    assert (mode(s.home), mode(s.slot_dir)) == (0o700, 0o700)


def _run_child_writing(path: Path, *, log: Path) -> None:
    """A supervised child (as llama-server is run) that creates a file with the default 0666 and
    then answers /health: the file's mode is the umask ocpc gave the child."""
    port = free_port()
    code = (
        "import sys, http.server as h; open(sys.argv[1], 'w').close(); "
        "h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[2])), h.SimpleHTTPRequestHandler).serve_forever()"
    )
    child = Supervised(
        name="child",
        argv=[sys.executable, "-c", code, str(path), str(port)],
        health_url=f"http://127.0.0.1:{port}/",
        log_path=log,
    )
    child.start(timeout=30)
    child.stop(grace=5)


def test_write_private_makes_its_folders_0700_but_never_changes_a_folder_that_exists(
    umask_022: None, tmp_path: Path
) -> None:
    shared = tmp_path / "share"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    target = shared / "a" / "b" / "state.json"
    write_private(target, b"{}")
    assert (mode(shared), mode(shared / "a"), mode(shared / "a" / "b"), mode(target)) == (0o755, 0o700, 0o700, 0o600)


def _earlier_ocpc(s: Settings) -> dict[str, Path]:
    """What an ocpc before this fix left under umask 022: folders 0755, files 0644; and things
    that are not ocpc's to change."""
    s.slot_dir.mkdir(parents=True)
    s.log_dir.mkdir()
    outside = s.home.parent / "outside.txt"
    outside.write_text("a file of the user's")
    paths = {
        "home": s.home,
        "slots": s.slot_dir,
        "logs": s.log_dir,
        "index": s.index_path,
        "head": s.slot_dir / HEAD,
        "park": s.slot_dir / PARK,
        "part": s.slot_dir / f"{PARK}.0badcafe.part",
        "daemon_log": s.log_dir / "daemon.log",
        "events": s.log_dir / "events.jsonl",
        "theirs": s.slot_dir / "notes.txt",
        "outside": outside,
    }
    for key, path in paths.items():
        if key not in ("home", "slots", "logs", "outside"):
            path.write_bytes(b"x")
    (s.slot_dir / "oc-proj-0000000000000000.bin").symlink_to(outside)  # named like ours: never followed
    for path in paths.values():
        path.chmod(0o755 if path.is_dir() else 0o644)
    return paths


def test_tighten_makes_an_earlier_ocpcs_folders_0700_and_only_files_named_like_ours_0600() -> None:
    s = settings()
    p = _earlier_ocpc(s)
    before = {f.path for f in scan(s)}
    assert before == {p[k] for k in ("home", "slots", "logs", "index", "head", "park", "part", "daemon_log", "events")}
    assert all(mode(path) in (0o755, 0o644) for path in before)  # scan changes nothing

    found = tighten(s)
    assert {f.path for f in found if f.fixed} == before and all(not f.left for f in found)
    for key in ("home", "slots", "logs"):
        assert mode(p[key]) == 0o700, key
    for key in ("index", "head", "park", "part", "daemon_log", "events"):
        assert mode(p[key]) == 0o600, key
    assert mode(p["theirs"]) == 0o644  # not named like ours
    assert mode(p["outside"]) == 0o644  # behind a symlink named like ours
    assert scan(s) == [] and tighten(s) == []


def test_a_slot_folder_the_user_configured_open_to_others_is_reported_not_changed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    given = tmp_path / "shared-slots"  # e.g. readable by a llama-server service account
    monkeypatch.setenv("OC_PREFIX_CACHE_SLOT_DIR", str(given))
    s = settings()
    given.mkdir()
    (given / HEAD).write_bytes(b"x")
    given.chmod(0o755)
    (given / HEAD).chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="ocpc.privacy"):
        found = tighten_at_start(s)
    assert {f.path for f in found} == {given, given / HEAD} and not any(f.fixed for f in found)
    assert (mode(given), mode(given / HEAD)) == (0o755, 0o644)
    assert "OC_PREFIX_CACHE_SLOT_DIR" in caplog.text and str(given) in caplog.text
    check = _privacy(s)
    assert check.status == "warn" and str(given) in check.detail
    assert f"chmod 700 {given}" in check.fix and "if no other account needs them" in check.fix
    assert "umask 077" in check.fix

    given.chmod(0o700)  # private now: its files named like ours are ocpc's to tighten
    assert [(f.path, f.fixed) for f in tighten(s)] == [(given / HEAD, True)]
    assert mode(given / HEAD) == 0o600


def test_a_folder_shared_on_purpose_is_left_and_reported() -> None:
    s = settings()
    s.slot_dir.mkdir(parents=True, mode=0o700)
    s.home.chmod(0o700)
    (s.slot_dir / HEAD).write_bytes(b"x")
    (s.slot_dir / HEAD).chmod(0o640)
    s.slot_dir.chmod(0o2770)  # setgid: a group shares it
    found = tighten(s)
    assert [f.path for f in found] == [s.slot_dir, s.slot_dir / HEAD] and not any(f.fixed for f in found)
    assert "shared on purpose" in found[0].left
    assert (mode(s.slot_dir), mode(s.slot_dir / HEAD)) == (0o2770, 0o640)


def test_a_home_that_holds_the_users_own_files_is_left_but_ocpcs_files_in_it_are_made_0600(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    users = tmp_path / "users-folder"  # OC_PREFIX_CACHE_HOME pointed at a folder of the user's
    monkeypatch.setenv("OC_PREFIX_CACHE_HOME", str(users))
    s = settings()
    users.mkdir(mode=0o755)
    users.chmod(0o755)
    (users / ".bashrc").write_text("mine")
    (users / ".bashrc").chmod(0o644)
    s.index_path.write_text("{}")
    s.index_path.chmod(0o644)
    s.log_dir.mkdir()
    s.log_dir.chmod(0o755)
    found = tighten(s)
    assert mode(users) == 0o755 and mode(users / ".bashrc") == 0o644 and mode(s.log_dir) == 0o755
    assert mode(s.index_path) == 0o600
    left = {f.path: f.left for f in found if not f.fixed}
    assert set(left) == {users, s.log_dir} and "not ocpc's" in left[users]


def test_a_symlinked_slot_folder_is_never_changed(tmp_path: Path) -> None:
    s = settings()
    s.home.mkdir(mode=0o700)
    target = tmp_path / "big-disk-slots"
    target.mkdir()
    target.chmod(0o755)
    (target / HEAD).write_bytes(b"x")
    (target / HEAD).chmod(0o644)
    s.slot_dir.symlink_to(target)
    found = tighten(s)
    assert [(f.path, f.fixed) for f in found] == [(s.slot_dir, False)] and "symlink" in found[0].left
    assert (mode(target), mode(target / HEAD)) == (0o755, 0o644)


@pytest.mark.parametrize("door", ["daemon", "proxy"])
def test_the_daemon_and_the_proxy_tighten_what_an_earlier_ocpc_left_when_they_start(door: str) -> None:
    """`ocpc daemon` (the systemd unit's) and `ocpc proxy` start on their own: each tightens first
    and logs what it changed (no server needed: the door starts and answers without one)."""
    from tests.unit.commands.test_launch import wait_for

    s = settings()
    p = _earlier_ocpc(s)
    log = s.log_dir / f"{door}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oc_prefix_cache",
            door,
            "--server",
            f"http://127.0.0.1:{free_port()}",
            "--port",
            str(free_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: log.exists() and "0700" in log.read_text() or proc.poll() is not None, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "made 3 of ocpc's folders 0700 and 6 of its files 0600" in log.read_text()
    assert (mode(p["slots"]), mode(p["park"]), mode(p["theirs"])) == (0o700, 0o600, 0o644)
    assert mode(log) == 0o600


def test_doctor_flags_what_is_open_and_its_fix_tightens_only_ocpcs_own() -> None:
    s = settings()
    p = _earlier_ocpc(s)
    check = _privacy(s)
    assert check.status == "warn"
    assert str(p["slots"]) in check.detail and "decodes to its whole prompt" in check.detail
    assert check.fix.startswith("`ocpc doctor --fix`") and f"chmod 700 {p['home']}" in check.fix

    result = CliRunner().invoke(app, ["doctor", "--fix", "--json", "--server", f"http://127.0.0.1:{free_port()}"])
    assert f"made {p['slots']} 0700 (was 0755)" in result.stderr.replace("\n", "")
    privacy = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "privacy")
    assert privacy["status"] == "ok", privacy
    assert (mode(p["home"]), mode(p["head"]), mode(p["theirs"])) == (0o700, 0o600, 0o644)


def test_doctor_says_ok_for_a_private_home() -> None:
    s = settings()
    Store(index_path=s.index_path, lock_path=s.lock_path).update(lambda index: None)
    assert _privacy(s).status == "ok"


# -- against the real llama-server -----------------------------------------------------------------


@pytest.mark.rig
def test_a_llama_server_ocpc_starts_writes_private_slot_files_under_umask_022(
    umask_022: None, llama_server: Any
) -> None:
    """The server runs as ocpc runs it (LlamaServer: `ocpc demo`, the benches, every rig test;
    `ocpc launch` shares Supervised): its slot folder is made 0700, and what the server itself
    writes there, a slot file, is 0600. Before: 0755 and 0644."""
    s = settings()
    assert not s.slot_dir.exists()
    server = llama_server("qwen35")
    with SlotClient(server.url) as client:
        client.evaluate(client.tokenize("a prompt only its user may read", add_special=True), slot=0, prefill=True)
        client.save(0, HEAD)
    assert (mode(s.slot_dir), mode(s.slot_dir / HEAD)) == (0o700, 0o600)
    assert (s.slot_dir / HEAD).stat().st_size > 0
    assert mode(server.log_path) == 0o600


@pytest.mark.rig
def test_a_realistic_run_under_umask_022_leaves_nothing_open_to_other_users(
    umask_022: None, models: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ocpc launch` (server, daemon, proxy) from nothing, then what a day does: a head warmed and
    saved, a conversation parked when another session takes the slot, a request through the proxy,
    `ocpc gc`, `ocpc install`, and a graceful stop that parks what the server holds. Then every path
    under ocpc's home, slot files, index, locks, runtime files, logs and event log included, is the
    user's alone."""
    from tests.helpers import PROJ_A, PROJ_B, capture, chat
    from tests.rig.commands.test_proxy_launch import stop
    from tests.rig.doors.test_daemon import post_prepare

    monkeypatch.setenv("OC_PREFIX_CACHE_PARK_MIN_TOKENS", "0")  # park every displaced conversation
    s = settings()
    assert not s.home.exists()
    proxy_port = free_port()
    proc, port, daemon_port, log = _launch(models, tmp_path, proxy_port)
    try:
        assert proc.poll() is None, log.read_text()
        daemon, server = f"http://127.0.0.1:{daemon_port}", f"http://127.0.0.1:{port}"
        for name, session in ((PROJ_A, "ses_a"), (PROJ_B, "ses_b")):
            answer = post_prepare(daemon, name, session)
            timings = chat(server, capture(name))
            report = httpx.post(
                f"{daemon}/v1/report",
                timeout=10,
                trust_env=False,
                json={
                    "fingerprint": answer["fingerprint"],
                    "prepare_id": answer.get("prepare_id"),
                    "cache_n": timings.cache_n,
                    "prompt_n": timings.prompt_n,
                },
            )
            assert report.status_code == 200, report.text
        proxied = httpx.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            timeout=60,
            trust_env=False,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert proxied.status_code == 200
        gc = subprocess.run(
            [sys.executable, "-m", "oc_prefix_cache", "gc"], capture_output=True, text=True, timeout=120
        )
        assert gc.returncode == 0, gc.stderr
        config = tmp_path / "home" / "config" / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        config.write_text("{}\n")
        install_opencode(s, config_path=config, base_url=server, provider_id="llamacpp", model="local")
        server_pid = json.loads((s.home / f"server-{port}.json").read_text())["pid"]
        assert umask_of(server_pid) == 0o077  # what it writes itself: slot files 0600
    finally:
        stop(proc)  # a graceful stop: parks what the server holds
    slots = {p.name for p in s.slot_dir.iterdir()}
    assert any(n.startswith("oc-prefix-") for n in slots) and any(n.startswith("oc-conv-") for n in slots), slots
    logs = {p.name for p in s.log_dir.iterdir()}
    assert {"daemon.log", f"llama-server-{port}.log", "events.jsonl"} <= logs, logs
    assert {"index.json", "index.lock", f"launch-{port}.lock", "install.json"} <= {p.name for p in s.home.iterdir()}
    assert open_to_others(s.home) == []
    s.home.chmod(0o755)  # every name this run left in the home is one tighten knows for ocpc's
    assert [(f.path, f.fixed) for f in tighten(s)] == [(s.home, True)]


@pytest.mark.rig
def test_a_router_ocpc_launches_and_the_model_servers_it_spawns_run_under_umask_077(
    umask_022: None, models: Any, tmp_path: Path
) -> None:
    """`ocpc launch --models-dir`: the router, and each model's server it starts on demand, write
    their slot files 0600 (their umask is 077, inherited from the router ocpc started)."""
    from tests.helpers import TEST_SERVER_ARGS
    from tests.rig.commands.test_proxy_launch import stop
    from tests.unit.commands.test_launch import wait_for

    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "qwen35.gguf").symlink_to(models["qwen35"])
    port, daemon_port, proxy_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oc_prefix_cache",
                "launch",
                "--models-dir",
                str(folder),
                "--port",
                str(port),
                "--",
                "-c",
                "4096",
                *TEST_SERVER_ARGS,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    s = settings()
    try:
        wait_for(lambda: "ready: llama-server" in log.read_text() or proc.poll() is not None, timeout=120)
        answer = httpx.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            timeout=120,
            trust_env=False,
            json={"model": "qwen35", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert answer.status_code == 200, answer.text[:300]
        router = json.loads((s.home / f"server-{port}.json").read_text())["pid"]
        spawned = children_of(router)
        assert spawned, "the router started no model server"
        assert [umask_of(pid) for pid in (router, *spawned)] == [0o077] * (1 + len(spawned))
        with SlotClient(f"http://127.0.0.1:{port}", model="qwen35") as client:
            client.save(0, HEAD)  # the model's server itself writes it, not ocpc
        assert mode(s.slot_dir / HEAD) == 0o600
    finally:
        stop(proc)
    assert open_to_others(s.home) == []


def umask_of(pid: int) -> int:
    """A live process's umask, from /proc (Linux 4.7+)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no Umask line for pid {pid}")


def children_of(pid: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


@pytest.mark.rig
def test_launch_tightens_what_an_earlier_ocpc_left_before_it_starts(
    umask_022: None, models: Any, tmp_path: Path
) -> None:
    """First start after the upgrade: the folders and files an earlier ocpc made under umask 022
    are made private, a file not named like ocpc's keeps its mode, and the log says so."""
    from tests.rig.commands.test_proxy_launch import stop

    s = settings()
    p = _earlier_ocpc(s)
    proc, port, _, log = _launch(models, tmp_path, free_port())
    try:
        assert proc.poll() is None, log.read_text()
    finally:
        stop(proc)
    for key in ("home", "slots", "logs"):
        assert mode(p[key]) == 0o700, key
    for key in ("index", "head", "park", "daemon_log", "events"):
        assert mode(p[key]) == 0o600, key
    assert (mode(p["theirs"]), mode(p["outside"])) == (0o644, 0o644)
    said = (s.log_dir / "daemon.log").read_text()
    assert "made 3 of ocpc's folders 0700" in said, said


def _launch(models: Any, tmp_path: Path, proxy_port: int) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """`ocpc launch` on the tiny model with room for OpenCode's captured requests; it inherits
    this test's umask."""
    from tests.helpers import TEST_SERVER_ARGS
    from tests.unit.commands.test_launch import wait_for

    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    log = tmp_path / f"launch-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oc_prefix_cache",
                "launch",
                "--port",
                str(port),
                "-m",
                str(models["qwen35"]),
                "--",
                "-c",
                "16384",
                *TEST_SERVER_ARGS,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(lambda: "ready:" in log.read_text() or proc.poll() is not None, timeout=120)
    return proc, port, daemon_port, log
