"""`ocpc launch` against the rig: both processes up, SIGTERM stops both, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.launch import Flag, build_advice, build_argv, supported_options
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import SUITE_WAIT_S


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now (not yet listening: False)."""
    try:
        return loopback.get(url, timeout=5).status_code == 200
    except ServerError:
        return False


def wait_for(predicate, timeout: float = SUITE_WAIT_S) -> None:
    """Until ``predicate()``, within the suite's bound (helpers.SUITE_WAIT_S): the event, not a guess of its time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.mark.rig
def test_launch_starts_both_and_sigterm_stops_both(models, tmp_path: Path) -> None:
    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port)}
    home = Path(env["OC_PREFIX_CACHE_HOME"])
    cmd = [
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
        "8192",
    ]
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        runtime = home / f"server-{port}.json"
        wait_for(runtime.exists)
        info = json.loads(runtime.read_text())
        server_pid = info["pid"]
        assert "--slot-save-path" in info["argv"] and "--checkpoint-min-step" in info["argv"]
        assert info["argv"][-2:] == ["-c", "8192"]
        assert loopback.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        wait_for(lambda: answers(f"http://127.0.0.1:{daemon_port}/health"))  # the daemon may start after the server
        assert alive(server_pid) and alive(launcher.pid)

        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"already running on port {port} (pid {launcher.pid})" in second.stderr.replace("\n", " ")

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=SUITE_WAIT_S) == 0
        wait_for(lambda: not alive(server_pid))
        assert not runtime.exists()
        with pytest.raises(ServerError):  # gone
            loopback.get(f"http://127.0.0.1:{daemon_port}/health", timeout=1)
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
    assert "ready: llama-server pid" in log.read_text()
    daemon_log = home / "logs" / "daemon.log"  # defect: launch used to write none
    assert f"for llama-server http://127.0.0.1:{port}" in daemon_log.read_text()


def test_argv_keeps_user_flags_and_skips_unknown_ones() -> None:
    flags = [
        Flag(("--metrics",), None, "why"),
        Flag(("-np", "--parallel"), "1", "why"),
        Flag(("--new-flag",), "3", "why"),
    ]
    argv, notes = build_argv(
        Path("/bin/ls"), Path("m.gguf"), flags, {"--metrics", "-np", "--parallel"}, ["--parallel", "4"]
    )
    assert argv == ["/bin/ls", "-m", "m.gguf", "--metrics", "--parallel", "4"]
    assert any("yours" in n for n in notes) and any("does not know" in n for n in notes)


def test_supported_options_read_from_help() -> None:
    text = "-cms,  --checkpoint-min-step N   spacing\n--metrics   enable\n  -ub, --ubatch-size N"
    assert {"-cms", "--checkpoint-min-step", "--metrics", "-ub", "--ubatch-size"} <= supported_options(text)


def test_build_advice() -> None:
    assert "unknown" in build_advice("0.6.0-dev (build 0, commit unknown)")
    assert "older than" in build_advice("b11434-abcdef")
    assert build_advice("b11600-abc") is None


@pytest.mark.rig
def test_a_killed_launcher_leaves_no_server_behind(models, tmp_path: Path) -> None:
    port, daemon_port = free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port)}
    home = Path(env["OC_PREFIX_CACHE_HOME"])
    server_pid = None
    with open(tmp_path / "launch.log", "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "oc_prefix_cache", "launch", "--port", str(port), "-m", str(models["qwen3"])],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        runtime = home / f"server-{port}.json"
        wait_for(runtime.exists)
        server_pid = json.loads(runtime.read_text())["pid"]
        launcher.send_signal(signal.SIGKILL)  # no handler runs: only the kernel can help
        launcher.wait(timeout=SUITE_WAIT_S)
        wait_for(lambda: not alive(server_pid))
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
        if server_pid is not None and alive(server_pid):  # the orphan, if the feature failed
            os.kill(server_pid, signal.SIGKILL)


STUB_SERVER = '''#!{python}
"""A stand-in llama-server: --version, --help, and a /health that answers 200 on --port."""
import http.server, os, pathlib, sys
args = sys.argv[1:]
if "--version" in args:
    sys.stderr.write("version: 9999 (stub)\\n")
    sys.exit(0)
if "--help" in args:
    print("--host --port --slot-save-path -np --parallel --ctx-checkpoints --checkpoint-min-step -ub --cache-ram "
          "--metrics")
    sys.exit(0)
pathlib.Path(os.environ["STUB_STARTED"]).write_text(" ".join(args))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
'''


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OC_PREFIX_CACHE_DAEMON_PORT", "70000"),
        ("OC_PREFIX_CACHE_PROXY_PORT", "65536"),
        ("OC_PREFIX_CACHE_MAX_GB", "1e300"),
    ],
)
def test_launch_refuses_bad_settings_before_it_starts_llama_server(tmp_path: Path, name: str, value: str) -> None:
    """OC_PREFIX_CACHE_DAEMON_PORT=70000 passed the settings, `ocpc launch` started llama-server,
    and the daemon's bind died with an OverflowError traceback that tore the server down. Now
    the setting is refused first, in one line that names it: nothing is started."""
    stub = tmp_path / "llama-server"
    stub.write_text(STUB_SERVER.format(python=sys.executable))
    stub.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a model")
    started = tmp_path / "started"
    env = {**os.environ, "STUB_STARTED": str(started), name: value}
    cmd = [
        sys.executable,
        "-m",
        "oc_prefix_cache",
        "launch",
        "--server-bin",
        str(stub),
        "-m",
        str(model),
        "--port",
        str(free_port()),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    said = done.stdout + done.stderr
    assert done.returncode == 1 and name in said and "Traceback" not in said, said
    assert not started.exists(), "llama-server was started before the settings were checked"


def test_launch_refuses_a_server_port_out_of_range(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", "launch", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--port" in done.stderr and "65535" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
