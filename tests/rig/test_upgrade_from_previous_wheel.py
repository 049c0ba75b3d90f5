"""An upgrade from the previous release changes nothing for a user: their head, their parked
conversation and their settings are all there after it.

The wheel of what users have (``PREVIOUS``) goes into a fresh virtualenv, with a temporary HOME,
as pipx installs it. The user's Claude Code settings hold their own content; ``ocpc install
--harness claude-code`` sends Claude Code to the proxy; ``ocpc launch`` (the rig's llama-server,
the tiny hybrid model, one slot) serves a captured first request of Claude Code as installed
(tests/data/claude-code-2.1.332-installed/A2.json), which warms its head, and SIGTERM stops it:
ocpc's graceful stop parks the conversation the slot holds (engine/lifecycle.py ``park_live``;
every conversation is worth a park here: ``OC_PREFIX_CACHE_PARK_MIN_TOKENS=0``). Then the wheel of
this working tree replaces it (``pip install --force-reinstall --no-deps``), ``ocpc launch`` starts
again with the same home and ports, and:

* the next session's first request (A1.json: the same project, another session) is served from
  the head the previous version warmed: the warm start restores it into the slot, the prepare
  answers ``hit`` or ``restored`` and the server's own ``cache_n`` covers the head;
* A2's next turn (A2-continue.json) is served from the park the previous version made: it is
  filed under the previous version's identity (FORMAT 3: paths, mtimes, ocpc's version), found
  there, adopted under the new one, and restored; ``cache_n`` covers the park, more than the head.

The previous version still reads the index the new one wrote (its own package loads it and finds
its own park in it), so a downgrade loses nothing either. ``ocpc uninstall`` of the new version
then gives the settings back byte for byte. The proxy's ``/ocpc/status`` answers with every field
the previous version's had.

The previous wheel is built once (``git archive`` of that commit, ``python -m build --wheel``)
and cached beside the rig and the agents' binaries, under a folder named for the commit; the
current one is built from the checkout's files each run, as tests/unit/test_packaging.py does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.files import file_lock
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from oc_prefix_cache.rig.build import Rig
from tests.conftest import RIG_DIR, outward_environ
from tests.helpers import SUITE_WAIT_S, TEST_SERVER_ARGS, wait_until

pytestmark = pytest.mark.rig

#: What users have: the commit before identities were by content (FORMAT 4).
PREVIOUS = "dd2e077"
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
CAPTURES = ROOT / "tests" / "data" / "claude-code-2.1.332-installed"
END_AT_ONCE = ("--logit-bias", "151645+30")  # <|im_end|> in the tiny models' vocabulary: every reply ends at once
#: The user's own Claude Code settings, in their own layout (4-space indent, no final newline), with a
#: value install replaces (and must put back) and keys it must not touch.
USER_SETTINGS = (
    b'{\n    "theme": "dark",\n    "env": {\n        "MY_VAR": "mine",\n'
    b'        "CLAUDE_CODE_ATTRIBUTION_HEADER": "1"\n    },\n'
    b'    "permissions": {"allow": ["Bash(ls:*)"]}\n}'
)


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def _build_wheel(source: Path, out: Path, env: dict[str, str]) -> Path:
    """``python -m build --wheel`` of ``source`` (setuptools from PyPI in its isolated env)."""
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def _pip_env(root: Path) -> dict[str, str]:
    """A throwaway HOME and pip cache, and the real environment's proxy variables (not the stub's)."""
    home = root / "pip-home"
    home.mkdir(parents=True, exist_ok=True)
    return outward_environ(
        {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "PIP_CACHE_DIR": str(root / "pip-cache"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8",
        }
    )


def previous_wheel(scratch: Path) -> Path:
    """The wheel of ``PREVIOUS``, built once per commit and cached beside the rig (the one place
    outside the temporary HOME a test writes: tests/conftest.py)."""
    try:
        commit = _git("rev-parse", "--verify", f"{PREVIOUS}^{{commit}}").strip()
    except AssertionError as exc:
        if _git("rev-parse", "--is-shallow-repository").strip() == "true":  # a CI's shallow clone
            pytest.skip(f"a shallow clone without {PREVIOUS}: this test needs the history back to it")
        raise AssertionError(f"{exc}: this test needs the history back to {PREVIOUS} (a full clone)") from None
    folder = RIG_DIR.parent / f"ocpc-wheel-{commit}"
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".lock"):  # two pytest workers build it once
        cached = sorted(folder.glob("*.whl"))
        if cached and zipfile.is_zipfile(cached[0]):
            return cached[0]
        started = time.monotonic()
        source = scratch / "previous-src"
        source.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit], capture_output=True, timeout=300, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, capture_output=True, timeout=300, check=True)
        wheel = _build_wheel(source, scratch / "previous-dist", _pip_env(scratch))
        partial = folder / f"{wheel.name}.partial"
        shutil.copyfile(wheel, partial)
        os.replace(partial, folder / wheel.name)  # a reader sees a whole wheel or none
        print(f"built the wheel of {commit[:12]} in {time.monotonic() - started:.1f} s: {folder / wheel.name}")
        return folder / wheel.name


def current_wheel(scratch: Path) -> Path:
    """The wheel of this working tree, from the files a clean clone of it would hold (tracked and
    untracked, less the ignored), so nothing generated in the tree leaks into it."""
    started = time.monotonic()
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    clone = scratch / "current-src"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, clone / name)
    wheel = _build_wheel(clone, scratch / "current-dist", _pip_env(scratch))
    print(f"built the working tree's wheel in {time.monotonic() - started:.1f} s")
    return wheel


@dataclass(frozen=True)
class User:
    """A user's machine: ocpc in a fresh virtualenv, their HOME (the test's), their ports."""

    venv: Path
    env: dict[str, str]
    cwd: Path  # an empty folder: no checkout on sys.path
    pip_env: dict[str, str]
    server_port: int
    proxy_port: int

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def ocpc(self, *args: str) -> str:
        done = subprocess.run(
            [str(self.venv / "bin" / "ocpc"), *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=SUITE_WAIT_S,
            check=False,
        )
        assert done.returncode == 0, f"ocpc {' '.join(args)} ({done.returncode}): {done.stdout}{done.stderr}"
        return done.stdout

    def pip_install(self, *args: str) -> None:
        done = subprocess.run(
            [str(self.venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
            env=self.pip_env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    def package_files(self) -> set[str]:
        """The installed package's files (bytecode aside), as a wheel names them."""
        (site,) = (self.venv / "lib").glob("python*/site-packages")
        package = site / "oc_prefix_cache"
        return {
            p.relative_to(site).as_posix() for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        }


@contextmanager
def launched(user: User, rig: Rig, model: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`ocpc launch` as the user runs it; stopped by its PID: SIGTERM, then it must exit 0 (its
    group is killed when it does not)."""
    argv = [
        str(user.venv / "bin" / "ocpc"),
        "launch",
        "--port",
        str(user.server_port),
        "--server-bin",
        str(rig.server),
        "-m",
        str(model),
        "--",
        "-c",
        "16384",
        *END_AT_ONCE,
        *TEST_SERVER_ARGS,
    ]
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            argv, env=user.env, cwd=user.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            wait_until(lambda: _ready(launcher, log), what="ocpc launch did not come up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from None
        yield launcher
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=SUITE_WAIT_S) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)


def _ready(launcher: subprocess.Popen[bytes], log: Path) -> bool:
    if launcher.poll() is not None:
        raise AssertionError(f"ocpc launch exited ({launcher.returncode}):\n{log.read_text()[-3000:]}")
    return "ready: llama-server" in log.read_text()


def _direct(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """A request straight to this machine, never through the proxy the environment names (the
    test's stub): what oc_prefix_cache/loopback.py does, without the package under test."""
    with httpx.Client(trust_env=False, timeout=SUITE_WAIT_S) as client:
        return client.request(method, url, **kwargs)


def _status(user: User) -> dict[str, Any]:
    try:
        data: dict[str, Any] = _direct("GET", f"{user.proxy}/ocpc/status", timeout=10).json()
    except (httpx.HTTPError, ValueError):  # not up yet, or not answering JSON yet
        return {}
    return data


def send_first_request(user: User, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A captured first request of Claude Code as installed, through the proxy, as Claude Code
    sends it; the proxy's row for it once the server's timings are in, and its whole status."""
    captured = json.loads((CAPTURES / f"{name}.json").read_text())
    transport = {"host", "content-length", "connection", "accept-encoding"}  # this client's own
    headers = {k.lower(): v for k, v in captured["headers"] if k.lower() not in transport}
    rows = len(_status(user).get("recent") or [])  # this request's row is the next one
    answer = _direct("POST", f"{user.proxy}{captured['path']}", json=captured["body_json"], headers=headers)
    assert answer.status_code == 200, answer.text[:500]
    assert "message_stop" in answer.text, answer.text[:500]  # a whole Anthropic stream

    def row() -> dict[str, Any] | None:
        recent = _status(user).get("recent") or []
        return recent[-1] if len(recent) > rows and recent[-1]["cache_n"] is not None else None

    found = wait_until(row, what=f"the proxy's row for {name} with the server's timings")
    return found, _status(user)


def _warm_start_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "warm start" in line]


def _session_of(name: str) -> str:
    captured = json.loads((CAPTURES / f"{name}.json").read_text())
    return next(v for k, v in captured["headers"] if k.lower() == "x-claude-code-session-id")


def _parks(user: User) -> list[dict[str, Any]]:
    """The parked conversations in the user's index.json, as written."""
    index = json.loads((Path(user.env["OC_PREFIX_CACHE_HOME"]) / "index.json").read_text())
    return [e for e in index["entries"].values() if e.get("kind") == "conv"]


#: Run by the previous version's own package (its wheel unpacked, on PYTHONPATH): it reads the
#: index the new version wrote, and finds its own park of A2's session in it.
OLD_READER = """
import json, sys
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.park_files import find_park
from oc_prefix_cache.settings import Settings
s = Settings.from_env()
index = Store(index_path=s.index_path, lock_path=s.lock_path).load()
identity, session = sys.argv[1], sys.argv[2]
park = find_park(index, identity=identity, session=session, digests=())
print(json.dumps({"entries": len(index.entries), "foreign": len(index.foreign), "park": park.key if park else None}))
"""


def test_an_upgrade_from_the_previous_wheel_keeps_the_warm_head_and_the_users_settings(
    rig: Rig, models: dict[str, Path], isolated_home: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    scratch = tmp_path / "wheels"
    scratch.mkdir()
    old, new = previous_wheel(scratch), current_wheel(scratch)
    with zipfile.ZipFile(new) as wheel:
        new_files = {n for n in wheel.namelist() if n.startswith("oc_prefix_cache/")}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    cwd = tmp_path / "work"
    cwd.mkdir()
    server_port, proxy_port = free_port(), free_port()
    gone = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CLAUDE_CONFIG_DIR", "LLAMA_SERVER"}
    env = {k: v for k, v in os.environ.items() if k not in gone} | {  # the test's HOME and the proxy stub
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "OC_PREFIX_CACHE_BASE_URL": f"http://127.0.0.1:{server_port}",
        "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port),
        "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()),
    }
    env["OC_PREFIX_CACHE_PARK_MIN_TOKENS"] = "0"  # the graceful stop parks the slot's conversation, however short
    user = User(venv, env, cwd, _pip_env(tmp_path), server_port, proxy_port)
    user.pip_install(str(old))
    print(f"the previous wheel in a fresh venv: {user.ocpc('--version').strip()}")

    settings = isolated_home / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_bytes(USER_SETTINGS)
    said = user.ocpc("install", "--harness", "claude-code", "--model", "local-model")
    print(said)
    assert f"{user.proxy}" in json.loads(settings.read_text())["env"]["ANTHROPIC_BASE_URL"], settings.read_text()

    # The previous version warms the head of a session in project A; its stop parks the conversation.
    previous_log = tmp_path / "launch-previous.log"
    with launched(user, rig, models["qwen35"], previous_log):
        first, before = send_first_request(user, "A2")
    print(f"previous version, A2: {json.dumps(first)}")
    assert first["action"] == "warmed", first
    stop_lines = [line for line in previous_log.read_text().splitlines() if "park before stop" in line]
    print("\n".join(stop_lines))
    (old_park,) = [p for p in _parks(user) if p["session"] == _session_of("A2")]
    assert old_park["prefix_tokens"] > first["prefix_tokens"], old_park  # the conversation, past its head

    # The upgrade, as `pipx upgrade` / `pip install --force-reinstall` does it.
    user.pip_install("--force-reinstall", "--no-deps", str(new))
    installed = user.package_files()
    assert installed == new_files, (  # nothing of the previous version's layout left to import
        f"left: {sorted(installed - new_files)}; missing: {sorted(new_files - installed)}"
    )
    print(f"upgraded: {user.ocpc('--version').strip()}")

    # The next session's first request is served from what the previous version warmed; A2's next
    # turn, from the park the previous version made.
    log = tmp_path / "launch-current.log"
    with launched(user, rig, models["qwen35"], log):
        wait_until(lambda: any("warm start: slot 0:" in line for line in _warm_start_lines(log)), what="warm start")
        second, after = send_first_request(user, "A1")
        resumed, _ = send_first_request(user, "A2-continue")
        parks = [p for p in _parks(user) if p["session"] == _session_of("A2")]  # before the stop parks it again
    warm = _warm_start_lines(log)
    print("\n".join(warm))
    print(f"current version, A1: {json.dumps(second)}")
    print(f"current version, A2-continue: {json.dumps(resumed)}")
    assert resumed["action"] == "restored", resumed
    assert resumed["prefix_tokens"] == old_park["prefix_tokens"], (old_park, resumed)  # the park, whole
    assert resumed["cache_n"] >= 0.9 * old_park["prefix_tokens"], resumed  # the server reused the park
    assert resumed["prompt_n"] < 0.1 * old_park["prefix_tokens"], resumed
    adopted = [p for p in parks if p["identity"] != old_park["identity"]]
    assert old_park in parks and len(adopted) == 1, parks  # adopted under the new identity; the old entry as it was
    assert adopted[0]["xxh64"] == old_park["xxh64"] and adopted[0]["file"] != old_park["file"], parks
    after_stop = [p for p in _parks(user) if p["session"] == _session_of("A2")]
    assert old_park in after_stop, after_stop  # the new version's stop parked A2 again: under its new key only

    # The previous version reads the index the new one wrote, and still finds its own park.
    unpacked = tmp_path / "previous-package"
    with zipfile.ZipFile(old) as wheel:
        wheel.extractall(unpacked)
    read = subprocess.run(
        [str(venv / "bin" / "python"), "-c", OLD_READER, old_park["identity"], _session_of("A2")],
        env=env | {"PYTHONPATH": str(unpacked)},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SUITE_WAIT_S,
        check=False,
    )
    assert read.returncode == 0, read.stdout + read.stderr
    seen = json.loads(read.stdout)
    print(f"the previous version reads the new index: {seen}")
    assert seen["park"] is not None and seen["foreign"] == 0 and seen["entries"] >= 3, seen
    assert any("warm start: slot 0:" in line and ": restored" in line for line in warm), warm
    assert second["action"] in ("hit", "restored"), second
    assert second["prefix_tokens"] == first["prefix_tokens"], (first, second)
    assert second["cache_n"] >= 0.9 * second["prefix_tokens"], second  # the server reused the head
    assert second["prompt_n"] < 0.1 * second["prefix_tokens"], second  # it processed only what follows the head

    # What the proxy says about a request, and its status, keep every field the previous version had
    # (a new one is no break: a reader of the previous fields reads on).
    assert set(second) >= set(first), (sorted(first), sorted(second))
    assert set(after) >= set(before), (sorted(before), sorted(after))
    print(f"counters: previous {before.get('counters')}, current {after.get('counters')}")

    said = user.ocpc("uninstall", "--harness", "claude-code")
    print(said)
    assert settings.read_bytes() == USER_SETTINGS, settings.read_text()
    print(f"the upgrade test took {time.monotonic() - started:.1f} s")
