"""What users get from a package index: the sdist and the wheel carry the plugin, the
launcher files and the data files; the wheel, installed into a fresh virtualenv with no
source checkout (what `pipx install` / `uv tool install` do), installs the plugin byte for
byte, checks it, and uninstalls. The build uses PyPI (setuptools in its isolated env, the
dependencies of the fresh venv), as a user's install does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import __version__, loopback
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.install import plugin_version
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from oc_prefix_cache.rig.build import Rig
from tests.helpers import ROOT, SUITE_WAIT_S
from tests.proxy_stub import PROXY_VARS

PLUGIN = ROOT / "plugin-js" / "ocpc-plugin.js"
LAUNCHER = sorted(p for p in (ROOT / "launcher").iterdir() if p.is_file())
DATA = sorted((ROOT / "oc_prefix_cache" / "data").glob("*.json"))
URL = "http://127.0.0.1:8080"


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path
    clone: Path  # the files they were built from, as the checkout held them then
    pip_env: dict[str, str]  # a throwaway HOME and pip cache: nothing lands in the real home


def _pip_env(root: Path) -> dict[str, str]:
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PIP_CACHE_DIR": str(root / "pip-cache"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "LANG": "C.UTF-8",
    }


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """sdist, then the wheel from the sdist (`python -m build`), from the checkout's files as
    a clean clone has them: nothing generated in the tree can leak into the wheel."""
    root = tmp_path_factory.mktemp("dists")
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    clone = root / "clone"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes(source.read_bytes())
    out = root / "dist"
    env = _pip_env(root)
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(clone)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return Dists(next(out.glob("*.tar.gz")), next(out.glob("*.whl")), clone, env)


def test_wheel_carries_the_plugin_byte_for_byte_and_the_launcher_and_data(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
        assert wheel.read("oc_prefix_cache/shipped/ocpc-plugin.js") == _plugin(dists)
        for unit in LAUNCHER:
            assert wheel.read(f"oc_prefix_cache/shipped/launcher/{unit.name}") == unit.read_bytes()
        for data in DATA:
            assert wheel.read(f"oc_prefix_cache/data/{data.name}") == data.read_bytes()
    assert not [n for n in names if n.startswith(("plugin-js/", "tests/", "launcher/"))], names


def test_sdist_carries_the_one_source_of_plugin_and_launcher(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{top}/") for n in sdist.getnames()}
        plugin = sdist.extractfile(f"{top}/plugin-js/ocpc-plugin.js")
        assert plugin is not None and plugin.read() == _plugin(dists)
    assert {"setup.py", "MANIFEST.in", "pyproject.toml"} <= names
    assert {f"launcher/{u.name}" for u in LAUNCHER} <= names
    assert {f"oc_prefix_cache/data/{d.name}" for d in DATA} <= names
    assert not [n for n in names if "shipped" in n], "the sdist must not carry a second copy of the plugin"


def _plugin(dists: Dists) -> bytes:
    """plugin-js/ocpc-plugin.js as the build read it from the checkout."""
    return (dists.clone / "plugin-js" / "ocpc-plugin.js").read_bytes()


@dataclass(frozen=True)
class FreshVenv:
    """ocpc installed from the wheel alone, and a user's environment to run it in."""

    bin: Path
    plugin: bytes  # what the wheel was built from
    env: dict[str, str]
    home: Path  # the user's HOME
    ocpc_home: Path
    cwd: Path  # an empty folder: no checkout on sys.path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin / "ocpc"), *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert not check or proc.returncode == 0, f"ocpc {' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc

    def json(self, *args: str, check: bool = True) -> Any:
        proc = self.run(*args, "--json", check=check)
        try:
            return json.loads(proc.stdout)
        except ValueError:
            raise AssertionError(f"ocpc {' '.join(args)} --json printed no JSON: {proc.stdout}{proc.stderr}") from None


@pytest.fixture
def fresh_venv(dists: Dists, tmp_path: Path) -> FreshVenv:
    """The wheel installed into a new virtualenv with its dependencies, as pipx does."""
    started = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(dists.wheel)],
        env=dists.pip_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    home = tmp_path / "user"
    for sub in ("config", "data", "cache", "state"):
        (home / sub).mkdir(parents=True)
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_STATE_HOME": str(home / "state"),
        "OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc"),
        # nothing listens here: status and doctor must report that, not find a real server
        "OC_PREFIX_CACHE_BASE_URL": f"http://127.0.0.1:{free_port()}",
        "OC_PREFIX_CACHE_DAEMON_PORT": str(free_port()),
    }
    print(f"fresh venv from the wheel in {time.monotonic() - started:.1f} s")
    return FreshVenv(venv / "bin", _plugin(dists), env, home, tmp_path / "ocpc", cwd)


def test_wheel_in_a_fresh_venv_installs_checks_and_uninstalls(fresh_venv: FreshVenv) -> None:
    v = fresh_venv
    where = subprocess.run(
        [str(v.bin / "python"), "-c", "import oc_prefix_cache; print(oc_prefix_cache.__file__)"],
        env=v.env,
        cwd=v.cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(v.bin.parent)), f"ocpc was imported from {where}, not from the fresh venv"

    expected = plugin_version(v.plugin) or "(no version mark)"
    assert v.run("--version").stdout.strip() == f"ocpc {__version__}, plugin {expected}"

    config = v.home / "config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text('{"theme": "dark"}\n')
    said = v.run("install", "--base-url", URL).stdout
    assert "added the plugin" in said and "copied the plugin" in said, said
    installed = v.ocpc_home / "plugin" / "ocpc-plugin.js"
    assert installed.read_bytes() == v.plugin
    assert installed.as_uri() in json.loads(config.read_text())["plugin"]

    status = v.json("status")
    assert status["verdict"], status
    checks = {c["name"]: c for c in v.json("doctor", check=False)["checks"]}
    assert checks["opencode"]["status"] == "ok", checks["opencode"]
    assert checks["server"]["status"] == "fail"  # nothing listens at the base URL: said, not hidden

    installed.write_bytes(installed.read_bytes() + b"// an older copy\n")
    checks = {c["name"]: c for c in v.json("doctor", check=False)["checks"]}
    assert checks["opencode"]["status"] == "warn" and "ocpc install" in checks["opencode"]["fix"], checks

    assert "restored" in v.run("uninstall").stdout
    assert config.read_text() == '{"theme": "dark"}\n'


@pytest.mark.rig
def test_wheel_in_a_fresh_venv_launches(fresh_venv: FreshVenv, rig: Rig, models: dict[str, Path]) -> None:
    v = fresh_venv
    port = free_port()
    # the run's proxy stub too (tests/proxy_stub.py): the installed ocpc must reach its server directly
    env = {
        **v.env,
        **{k: os.environ[k] for k in PROXY_VARS if k in os.environ},
        "OC_PREFIX_CACHE_BASE_URL": f"http://127.0.0.1:{port}",
    }
    log = v.cwd / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [
                str(v.bin / "ocpc"),
                "launch",
                "--port",
                str(port),
                "--server-bin",
                str(rig.server),
                "-m",
                str(models["qwen35"]),
                "--",
                "-c",
                "8192",
            ],
            env=env,
            cwd=v.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        daemon = f"http://127.0.0.1:{env['OC_PREFIX_CACHE_DAEMON_PORT']}/health"
        deadline = time.monotonic() + SUITE_WAIT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            try:
                if loopback.get(daemon, timeout=1).status_code == 200:
                    break
            except ServerError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"ocpc launch from the wheel did not come up:\n{log.read_text()[-3000:]}")
        status = replace(v, env=env).json("status")
        assert status["server"]["reachable"] and status["daemon"]["up"], status
    finally:
        stop_group(launcher, grace=10)
