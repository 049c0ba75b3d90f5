"""A supervised child process: a small state machine (stopped, starting, ready, stopping).

The child gets its own process group, so stopping it also stops anything it spawned:
SIGTERM to the group, SIGKILL after a grace period. Start-up polls a health URL and
fails fast, with the tail of the child's log, if the child exits instead of getting ready.
The child runs under umask 077 (disk/privacy.py): what it writes, such as llama-server's slot
files, is the user's alone; its log is 0600.
"""

from __future__ import annotations

import ctypes
import enum
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oc_prefix_cache import loopback
from oc_prefix_cache.errors import ProcessError, ServerError
from oc_prefix_cache.files import private_dir, private_opener

PR_SET_PDEATHSIG = 1
MAX_PID = 1 << 22  # Linux pid_max's ceiling: a larger number (say, in a file name) is no live process
PRIVATE_UMASK = 0o077  # a child's files: 0600, its folders 0700 (a slot file decodes to the whole prompt)


class State(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


@dataclass
class Supervised:
    """One child process; ``start`` returns once ``health_url`` answers 200."""

    name: str
    argv: Sequence[str]
    health_url: str
    log_path: Path
    env: dict[str, str] | None = None
    die_with_parent: bool = False  # Linux: SIGTERM the child if this process is killed outright
    umask: int = PRIVATE_UMASK  # the child's umask (-1: this process's)
    state: State = State.STOPPED
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, *, timeout: float = 120.0, on_wait: Callable[[float], None] | None = None) -> None:
        if self.state is not State.STOPPED:
            raise ProcessError(f"{self.name} is {self.state.value}, not stopped")
        private_dir(self.log_path.parent)
        self.state = State.STARTING
        with open(self.log_path, "ab", opener=private_opener) as log:
            try:
                self.proc = subprocess.Popen(
                    list(self.argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=self.env,
                    umask=self.umask,
                    preexec_fn=_term_with_parent if self.die_with_parent else None,
                )
            except OSError as exc:
                self.state = State.STOPPED
                raise ProcessError(f"could not start {self.name} ({self.argv[0]}): {exc}") from exc
        try:
            self._wait_healthy(timeout, on_wait)
        except BaseException:
            self.stop()
            raise
        self.state = State.READY

    def _wait_healthy(self, timeout: float, on_wait: Callable[[float], None] | None) -> None:
        assert self.proc is not None
        started = time.monotonic()
        with loopback.client(timeout=2.0, what=self.name) as client:  # never through a proxy from the environment
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ProcessError(
                        f"{self.name} {exit_words(code)} while starting{start_advice(code, self.argv)}; "
                        f"last log lines:\n{tail(self.log_path)}"
                    )
                try:
                    if client.get(self.health_url).status_code == 200:
                        return
                except ServerError:  # not up yet
                    pass
                elapsed = time.monotonic() - started
                if elapsed > timeout:
                    raise ProcessError(
                        f"{self.name} was not healthy at {self.health_url} after {timeout:.0f} s; "
                        f"last log lines:\n{tail(self.log_path)}"
                    )
                if on_wait:
                    on_wait(elapsed)
                time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace`` s; returns the exit code."""
        if self.proc is None:
            self.state = State.STOPPED
            return None
        self.state = State.STOPPING
        code = stop_group(self.proc, grace=grace)
        self.proc = None
        self.state = State.STOPPED
        return code


def stop_group(proc: subprocess.Popen[bytes], *, grace: float) -> int | None:
    """Stop a child started with ``start_new_session=True`` and everything in its group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait(timeout=10)


def stop_on_sigterm() -> None:
    """From the main thread: SIGTERM (a CI timeout, ``timeout``, a supervisor) ends this process
    as Ctrl-C does, by raising KeyboardInterrupt, so its ``finally`` blocks and pytest's fixture
    teardowns run and stop the children they started by PID. By default SIGTERM ends Python at
    once, and a child started in its own session (every ``Supervised`` one) keeps running: a
    bench or test run killed by a timeout left its llama-servers holding ports and cores."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _term_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM us when our parent dies.

    Signals cover Ctrl-C, SIGTERM and a closed terminal; this covers a SIGKILL of the
    launcher, which would otherwise leave llama-server holding the port and the GPU.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the signal handlers still stop the child


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (even one we may not signal)."""
    if pid <= 0 or pid > MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def exit_words(code: int) -> str:
    """``exited with code 1`` or ``was killed by signal 11 (SIGSEGV)``: Popen gives -N for a signal."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


#: How a llama.cpp CPU build dies on start when its repacked weights crash: the same model and
#: flags give a different signal on different CPUs, so the advice names the flag for each.
#: SIGSEGV: the repacked Q4_K/Q4_0 kernels (ggml-cpu/repack.cpp: AVX2 on x86, NEON on ARM) crash
#: right after "llama threadpool init" (b11434 on the test machines this was first seen on;
#: llama.cpp issues #16479, #19561; an AVX-512 AMD EPYC without AMX loads it). SIGILL: on a
#: CPU with AMX (amx_tile in /proc/cpuinfo) a native build also compiles ggml-cpu/amx/, whose
#: buffer type takes Q4_K/Q4_0 weights before the repack one does (ggml-cpu.cpp's extra buffer
#: types), and AMX/AVX-512 code dies with SIGILL wherever the CPU advertises an instruction set
#: the OS or hypervisor does not let the process use (issue #28756: SIGILL with AMX_INT8 on;
#: #28328 and PR #20388: llama.cpp reads CPUID, not XCR0). --no-repack turns off every extra
#: buffer type, AMX included (llama-model.cpp, make_cpu_buft_list), so it is the fix for both.
REPACK_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGILL)


def start_advice(code: int, argv: Sequence[str]) -> str:
    """What to try when llama-server dies on start, from what is known to cause it."""
    repack_off = "--no-repack" in argv or "-nr" in argv
    if code == -signal.SIGILL:
        other_build = (
            "a build made for another CPU (GGML_NATIVE: -march=native) dies like this too: "
            "rebuild it on this machine (the rig keys its build by this CPU, `ocpc rig info`)"
        )
        if repack_off:
            return f"; an illegal instruction: {other_build}"
        return (
            "; an illegal instruction: on CPUs with AMX (amx_tile) the repacked (AMX) Q4_K/Q4_0 weight "
            "kernels of llama.cpp CPU builds die like this while loading: try again with --no-repack (after `--`); "
            f"{other_build}"
        )
    if code == -signal.SIGSEGV and not repack_off:
        return (
            "; on some CPUs the repacked Q4_K/Q4_0 kernels of llama.cpp CPU builds crash right after "
            '"llama threadpool init": try again with --no-repack (after `--`)'
        )
    if code == -signal.SIGBUS:
        return (
            "; the model file is memory-mapped, and a file shortened or replaced while the server reads it "
            "raises SIGBUS: check the file (its size, its sha256), or try --no-mmap (after `--`)"
        )
    if code == -signal.SIGKILL:
        return "; the kernel may have killed it for memory: try a smaller -c (context) or model"
    return ""
