"""The agents' binaries the end-to-end tests run: each one's package, and where it is installed
(under the rig cache, one folder per version), once.

Each ``tests/e2e/test_e2e_*.py`` names its binary as ``BIN``. ``python -m tests.harness_bins``
installs every one of them at once, in parallel: ``tests/run.sh`` runs it beside the
llama-server build, so a cold run downloads while it compiles (about 8 minutes of npm and
pip installs otherwise come after the build). A failure there fails nothing: the test's own
fixture installs again and fails loudly.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import RIG_DIR, outward_environ


@dataclass(frozen=True)
class Bin:
    folder: str  # under the rig cache's parent, with the version in its name
    package: str  # an npm spec, or a PyPI requirement when ``pypi``
    binary: str  # the binary's path inside the folder
    pypi: bool = False  # a PyPI package, in a venv of its own (Python 3.10-3.12)
    python: tuple[int, int] = (3, 10)  # the oldest Python the PyPI package installs on

    @property
    def path(self) -> Path:
        return RIG_DIR.parent / self.folder / self.binary

    def install(self) -> Path:
        """The binary, installed first when it is not there yet (fails loudly)."""
        if not self.path.exists():
            if self.pypi:
                _pip(self.package, RIG_DIR.parent / self.folder, oldest=self.python)
            else:
                _npm(self.package, RIG_DIR.parent / self.folder)
        assert self.path.exists(), f"{self.package} did not provide {self.path}"
        return self.path


def _npm(package: str, folder: Path) -> None:
    npm = shutil.which("npm")
    assert npm, f"npm is needed to install {package} for the end-to-end test"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", package],
        cwd=folder,
        check=True,
        capture_output=True,
        timeout=900,
        env=outward_environ(),
    )  # not through the tests' proxy stub


def _pip(package: str, folder: Path, *, oldest: tuple[int, int] = (3, 10)) -> None:
    python = _python(oldest)
    assert python, f"Python {oldest[0]}.{oldest[1]}-3.12 is needed to install {package} for the end-to-end test"
    subprocess.run([python, "-m", "venv", "--clear", str(folder)], check=True, capture_output=True, timeout=300)
    subprocess.run(
        [str(folder / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", package],
        check=True,
        capture_output=True,
        timeout=1800,
        env=outward_environ(),
    )  # not through the stub


def _python(oldest: tuple[int, int]) -> str | None:
    """The path of a Python from ``oldest`` to 3.12: this one, else ``python3.X`` on the PATH (a
    pyenv shim is asked for that version: it answers only for the versions it was set to)."""
    if oldest <= sys.version_info[:2] < (3, 13):
        return sys.executable
    for minor in range(12, oldest[1] - 1, -1):
        name = shutil.which(f"python3.{minor}")
        if not name:
            continue
        env = {**os.environ, "PYENV_VERSION": f"3.{minor}"}
        proc = subprocess.run(
            [name, "-c", "import sys; print(sys.executable)"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    return None


def npm_install(package: str, folder: Path, binary: Path) -> Path:
    """A harness from npm, installed once under ``folder`` (fails loudly without npm)."""
    if not binary.exists():
        _npm(package, folder)
    assert binary.exists(), f"{package} did not provide {binary}"
    return binary


def every_bin() -> list[Bin]:
    """The ``BIN`` of every end-to-end test module."""
    here = Path(__file__).parent / "e2e"
    found = []
    for path in sorted(here.glob("test_e2e_*.py")):
        module = importlib.import_module(f"tests.e2e.{path.stem}")
        if isinstance(getattr(module, "BIN", None), Bin):
            found.append(module.BIN)
    return found


def main() -> int:
    def one(b: Bin) -> str:
        started = time.monotonic()
        try:
            b.install()
        except (AssertionError, subprocess.SubprocessError, OSError) as exc:
            return f"{b.package}: not installed ({type(exc).__name__}: {str(exc)[:200]}); its test installs it again"
        return f"{b.package}: ready ({time.monotonic() - started:.0f} s)"

    with ThreadPoolExecutor(max_workers=4) as pool:
        for line in pool.map(one, every_bin()):
            print(f"- {line}", flush=True)
    return 0


if __name__ == "__main__":  # run as tests.harness_bins, so the test modules' Bin is this one
    from tests import harness_bins

    sys.exit(harness_bins.main())
