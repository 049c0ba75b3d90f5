"""OpenCode's title request, measured in the real OpenCode TUI: what it costs a new session.

At a session's first message OpenCode's TUI asks the same model for a title (no tools, its own
~500-token system prompt, up to the model's output limit), about when it sends the first main
request. `opencode run` sends none: only the TUI does, so the TUI is what this drives (tmux on
a socket of its own, the way tests/rig/commands/test_top.py drives `ocpc top`).

Set-up, as `ocpc install` wires it: one real llama-server (`-np 1` or `-np 2`, the flags
`ocpc launch` gives it), `ocpc daemon`, OpenCode 1.18.33 with the plugin, one project with an
AGENTS.md. Two arms, alternated session by session on the same server and daemon:

- ``title``: `ocpc install --keep-title` (OpenCode's title request on);
- ``no-title``: `ocpc install --no-keep-title` (``agent.title.disable``).

Each session is a fresh TUI with two messages. Figures per session, from the plugin's log
(the prepares and the reports of the server's own counts) and the server's log (each task's
prompt and generation):

- the title request: tokens processed and reused, prompt and generation ms, its slot;
- the first and the second main request: the prepare's answer and its ms, tokens processed and
  reused, and the request's time from its prepare to the end of its answer (what the title can
  delay: on one slot the main request waits while the title runs, and finds the head displaced);
- the session: every prompt token the server processed (ocpc's own restores' probes included).

Model: the real Gemma 3 270M (`--no-repack`, `--swa-full` as `ocpc launch` gives it) by default:
the tiny models crash b11434 when two slots process at once (docs/performance.md), which the
title and the first main request do on `-np 2`; its replies are real text, capped by the
output limit (`--output-limit`, 16 here: a title's length) like every reply of this bench.
`--model qwen3` runs the tiny transformer with OpenCode's real 7.5k-token first request
(`-np 1` only).

    .venv/bin/python bench/title_bench.py                       # gemma3, -np 1 and 2, 3 rounds
    .venv/bin/python bench/title_bench.py --model qwen3 --slots 1 --json bench/results/title-qwen3-np1.json
    .venv/bin/python bench/title_bench.py --smoke               # the mechanics: qwen3, -np 1, 1 round
    .venv/bin/python bench/title_bench.py --render bench/results/title-gemma3-np1.json   # a kept run's tables
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.launch import family_flags
from oc_prefix_cache.errors import ServerError
from oc_prefix_cache.llama.server_info import model_family
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_group, stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.rig.tiny_models import ensure_model
from oc_prefix_cache.settings import Settings
from tests.e2e.test_e2e_opencode import BIN, OPENCODE_VERSION  # noqa: E402

ARMS = ("title", "no-title")
LAUNCH = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics")
OUTPUT_LIMIT = 16  # every reply, the title's too: a title's length
HEAD_MIN = 1000  # a main request carries the head (Gemma 3: ~1.9k tokens, Qwen: ~7.5k); a title ~600
#: A session's first message, each session its own: a request repeated word for word (the title's,
#: or a main request of the same project) would be served whole from the server's RAM cache, by
#: the session of the other arm that sent it first. Both arms draw from the list in turn.
FIRST = (
    "list the files in this project and say what each one is for",
    "why does main.py print hello and not the project's name?",
    "add a test for main.py that checks what it prints",
    "explain the rules in AGENTS.md in one short paragraph",
    "what would it take to turn main.py into a command-line tool?",
    "rename main.py to app.py and update every reference to it",
    "is there anything in this project that breaks the AGENTS.md rules?",
    "write a README for this project, three lines at most",
)
SECOND = "and which of them should I read first?"
PRIME = "hello, what is in this folder?"
AGENTS_MD = "# Project A\nUse tabs. Run `make test` before every commit.\n"
PANE = (160, 45)


# -- the server's log: one record per completion task -----------------------------------------
@dataclass
class Task:
    """One completion as llama-server logged it (INF level: no timestamps needed)."""

    task: int
    slot: int
    start: float = 0.0  # seconds since the server started (its log's timestamps)
    end: float = 0.0
    processed: int = 0  # prompt tokens evaluated
    prompt_ms: float = 0.0
    generated: int = 0
    gen_ms: float = 0.0
    n_tokens: int = 0  # what the slot held when the task ended (prompt + reply)

    @property
    def reused(self) -> int:
        return max(0, self.n_tokens - self.processed - self.generated)


LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w slot\s+(\w+): id\s+(\d+) \| task (-?\d+) \| (.*)")


def server_tasks(text: str) -> list[Task]:
    """The completion tasks in ``text`` (a slice of the server's log, ``--log-timestamps``),
    in the order they ended."""
    tasks: dict[int, Task] = {}
    ended: list[Task] = []
    for line in text.splitlines():
        match = LINE.search(line)
        if not match:
            continue
        minutes, seconds, ms, us = (int(g) for g in match.group(1, 2, 3, 4))
        at = minutes * 60 + seconds + ms / 1e3 + us / 1e6
        slot, task, rest = int(match.group(6)), int(match.group(7)), match.group(8)
        if rest.startswith("processing task"):
            tasks[task] = Task(task=task, slot=slot, start=at)
        elif task in tasks and (m := re.search(r"^prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", rest)):
            tasks[task].prompt_ms, tasks[task].processed = float(m.group(1)), int(m.group(2))
        elif task in tasks and (m := re.search(r"^\s*eval time =\s*([\d.]+) ms /\s*(\d+) tokens", rest)):
            tasks[task].gen_ms, tasks[task].generated = float(m.group(1)), int(m.group(2))
        elif task in tasks and (m := re.search(r"stop processing: n_tokens = (\d+)", rest)):
            tasks[task].n_tokens, tasks[task].end = int(m.group(1)), at
            ended.append(tasks.pop(task))
    return ended


# -- the plugin's log ------------------------------------------------------------------------
def plugin_events(path: Path, since: int) -> list[dict[str, Any]]:
    """The plugin's log lines after the first ``since`` ones."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()[since:] if line.strip()]


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# -- the TUI ---------------------------------------------------------------------------------
class Tui:
    """OpenCode's TUI in a tmux server of its own (the user's tmux is never touched)."""

    def __init__(self, tmux: str, sock: Path, binary: Path, env: dict[str, str], project: Path, model: str) -> None:
        self.run = [tmux, "-S", str(sock)]
        keep = ("HOME", "XDG_", "OPENCODE_", "OC_PREFIX_CACHE_", "PATH", "TERM")
        pairs = [
            a
            for k, v in {**env, "PWD": str(project), "TERM": "xterm-256color"}.items()
            if k.startswith(keep)
            for a in ("-e", f"{k}={v}")
        ]
        subprocess.run(
            [
                *self.run,
                "new-session",
                "-d",
                "-x",
                str(PANE[0]),
                "-y",
                str(PANE[1]),
                "-s",
                "oc",
                "-c",
                str(project),
                *pairs,
                f"{binary} --model llamacpp/{model}",
            ],
            check=True,
            timeout=30,
        )
        self.pid = int(
            subprocess.run(
                [*self.run, "list-panes", "-t", "oc", "-F", "#{pane_pid}"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.split()[0]
        )

    def screen(self) -> str:
        return subprocess.run(
            [*self.run, "capture-pane", "-p", "-t", "oc"], capture_output=True, text=True, check=False, timeout=10
        ).stdout

    def wait_ready(self, timeout: float = 240) -> None:
        wait_for(lambda: "Ask anything" in self.screen(), "the TUI's prompt", timeout)

    def send(self, text: str) -> float:
        subprocess.run([*self.run, "send-keys", "-t", "oc", "-l", text], check=True, timeout=10)
        time.sleep(0.5)
        sent = time.time()
        subprocess.run([*self.run, "send-keys", "-t", "oc", "Enter"], check=True, timeout=10)
        return sent

    def busy(self) -> bool:
        return "esc interrupt" in self.screen()

    def close(self) -> None:
        try:
            os.kill(self.pid, 15)
        except ProcessLookupError:
            pass
        subprocess.run([*self.run, "kill-server"], check=False, timeout=10, capture_output=True)


def wait_for(check: Any, what: str, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        time.sleep(0.25)
    raise RuntimeError(f"timed out waiting for {what}")


# -- one session -----------------------------------------------------------------------------
@dataclass
class Request:
    """One main request of a session: the plugin's log (its prepare) and the server's task for
    it, on one clock (the server's log, calibrated to the wall clock)."""

    action: str
    daemon_ms: float  # the prepare in the daemon (a wait for a busy slot included)
    processed: int
    reused: int
    slot: int
    server_ms: float  # the server's prompt processing + generation for it
    latency_ms: float  # OpenCode handed it to the plugin -> the server's answer ended
    sent_at: float  # wall clock: OpenCode handed it to the plugin
    started_at: float  # the server began it
    ended_at: float
    reason: str = ""


@dataclass
class Title:
    processed: int
    reused: int
    ms: float  # prompt + generation
    slot: int
    started_at: float
    ended_at: float
    held_first_ms: float  # it ran while the first request, sent, waited to start (one slot: in front of it)
    beside_first_ms: float  # it ran while the first request ran (two slots: beside it)


@dataclass
class Session:
    arm: str
    round: int
    message: str
    title: Title | None
    title_prepare: str
    first: Request | None
    second: Request | None
    processed_total: int  # every prompt token the server evaluated in the session (ocpc's own included)
    enter_to_answer_ms: float  # Enter in the TUI -> the first answer's end (OpenCode's own work included)
    tasks: list[dict[str, Any]] = field(default_factory=list)


def _overlap_ms(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0])) * 1000


def replies(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """The server's tasks that generated a reply (ocpc's own prefills and probes generate
    nothing), split into main requests (they carry the head) and the rest (titles)."""
    answered = [t for t in tasks if t.gen_ms > 0]
    return (
        [t for t in answered if t.n_tokens - t.generated >= HEAD_MIN],
        [t for t in answered if t.n_tokens - t.generated < HEAD_MIN],
    )


def main_requests(events: list[dict[str, Any]], tasks: list[Task], offset: float) -> list[Request]:
    """The main requests of a message: the server's tasks that carry the head, in order, each
    with the plugin's prepare for it (its answer, or a prepare that failed open: then the
    request went on unprepared). Counts come from the server's log, so a request whose report
    never came (a prepare that failed open has no fingerprint to report on) is counted too."""
    asked = [
        e
        for e in events
        if (e.get("ev") == "prepare" and e.get("fingerprint"))
        or (e.get("ev") == "error" and e.get("stage") == "prepare")
    ]
    found: list[Request] = []
    for task, prepare in zip(replies(tasks)[0], asked, strict=False):
        sent_at = (prepare["t"] - prepare.get("ms", 0)) / 1000  # the breaker's "not asked" has no ms
        ended = offset + task.end
        found.append(
            Request(
                action=prepare.get("action", "fail-open"),
                daemon_ms=float(prepare.get("daemon_ms") or 0),
                processed=task.processed,
                reused=task.reused,
                slot=task.slot,
                server_ms=task.prompt_ms + task.gen_ms,
                latency_ms=(ended - sent_at) * 1000,
                sent_at=sent_at,
                started_at=offset + task.start,
                ended_at=ended,
                reason=prepare.get("reason") or prepare.get("error", ""),
            )
        )
    return found


def title_of(tasks: list[Task], mains: list[Request], offset: float) -> Title | None:
    """The title request among a first message's tasks (the reply without the head), and how
    it met the first request: in front of it (it waited) or beside it (both ran at once)."""
    titles = replies(tasks)[1]
    if not titles:
        return None
    task = titles[0]
    span = (offset + task.start, offset + task.end)
    first = mains[0] if mains else None
    return Title(
        processed=task.processed,
        reused=task.reused,
        ms=task.prompt_ms + task.gen_ms,
        slot=task.slot,
        started_at=span[0],
        ended_at=span[1],
        held_first_ms=_overlap_ms(span, (first.sent_at, first.started_at)) if first else 0.0,
        beside_first_ms=_overlap_ms(span, (first.started_at, first.ended_at)) if first else 0.0,
    )


class Bench:
    def __init__(self, work: Path, *, model: str, model_path: Path, binary: Path, slots: int) -> None:
        self.work, self.model, self.slots = work, model, slots
        self.settings = Settings.from_env({**os.environ, "OC_PREFIX_CACHE_HOME": str(work / "ocpc")})
        extra = (
            *(REAL_MODELS[model].server_args if model in REAL_MODELS else ()),
            *(a for f in family_flags(model_family(str(model_path))) for a in f.args()),
            *LAUNCH,
            "--log-timestamps",
            "-t",
            str(max(1, (os.cpu_count() or 2) - 1)),
        )
        self.server = LlamaServer(
            config=ServerConfig(
                binary=binary,
                model=model_path,
                port=free_port(),
                slot_dir=self.settings.slot_dir,
                ctx_size=32768 * slots,
                parallel=slots,
                extra_args=extra,
            ),
            log_path=work / "server.log",
        )
        self.daemon: subprocess.Popen[bytes] | None = None
        self.daemon_port = free_port()
        self.project = work / "project"
        self.opencode = BIN.install()
        self.offset = 0.0  # wall clock = offset + the server log's timestamp
        self.tmux = shutil.which("tmux") or ""
        if not self.tmux:
            raise SystemExit("tmux is needed to drive OpenCode's TUI (README prerequisites)")

    def env(self, arm: str) -> dict[str, str]:
        home = self.work / arm / "home"
        scripts = sysconfig.get_path("scripts")  # rg for OpenCode's tools, from the test extra
        return {
            **os.environ,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "config"),
            "XDG_DATA_HOME": str(home / "data"),
            "XDG_CACHE_HOME": str(home / "cache"),
            "XDG_STATE_HOME": str(home / "state"),
            "OC_PREFIX_CACHE_HOME": str(self.work / "ocpc"),
            "OC_PREFIX_CACHE_DAEMON_PORT": str(self.daemon_port),
            "OC_PREFIX_CACHE_BASE_URL": self.server.url,
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def start(self) -> None:
        self.project.mkdir(parents=True, exist_ok=True)
        (self.project / "AGENTS.md").write_text(AGENTS_MD)
        (self.project / "main.py").write_text("print('hello')\n")
        self.server.start(timeout=300)
        self.offset = self._calibrate()
        for arm in ARMS:
            env = self.env(arm)
            for sub in ("config", "data", "cache", "state"):
                Path(env["HOME"], sub).mkdir(parents=True, exist_ok=True)
            said = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "oc_prefix_cache",
                    "install",
                    "--base-url",
                    self.server.url,
                    "--model",
                    self.model,
                    "--output-limit",
                    str(OUTPUT_LIMIT),
                    "--opencode-version",
                    OPENCODE_VERSION,
                    "--keep-title" if arm == "title" else "--no-keep-title",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            if said.returncode != 0:
                raise SystemExit(f"ocpc install failed: {said.stderr[-2000:]}")
        with open(self.work / "daemon.log", "ab") as out:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "oc_prefix_cache", "daemon", "--server", self.server.url, "-v"],
                env=self.env(ARMS[0]),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: _up(f"http://127.0.0.1:{self.daemon_port}/health"), "the daemon", 60)

    def _calibrate(self) -> float:
        """The server log's clock against the wall clock: one short completion, whose end the
        log stamps just before the answer leaves."""
        loopback.post(
            f"{self.server.url}/completion",
            json={"prompt": "calibrate", "n_predict": 2, "cache_prompt": False},
            timeout=120,
        ).raise_for_status()
        done = time.time()
        tasks = server_tasks(self.server.log_path.read_text(errors="replace"))
        return done - tasks[-1].end

    def stop(self) -> None:
        if self.daemon is not None:
            stop_group(self.daemon, grace=5)
        self.server.stop()

    def idle(self) -> bool:
        try:
            return not any(s.get("is_processing") for s in loopback.get(f"{self.server.url}/slots", timeout=5).json())
        except (ServerError, ValueError):
            return False

    def settled(self, tui: Tui, since: int) -> bool:
        """The message's work is done: a main request answered, the TUI idle, every slot idle."""
        text = self.server.log_path.read_bytes()[since:].decode(errors="replace")
        return bool(replies(server_tasks(text))[0]) and not tui.busy() and self.idle()

    def session(self, arm: str, number: int, first: str) -> Session:
        log = self.settings.log_dir / "plugin.jsonl"
        tui = Tui(
            self.tmux, self.work / f"tmux-{arm}-{number}.sock", self.opencode, self.env(arm), self.project, self.model
        )
        marks: list[tuple[int, int]] = []
        try:
            tui.wait_ready()
            time.sleep(1.0)
            sent = 0.0
            for message in (first, SECOND):
                marks.append((line_count(log), self.server.log_path.stat().st_size))
                at = tui.send(message)
                sent = sent or at
                wait_for(lambda: self.settled(tui, marks[-1][1]), f"the answer to {message!r}", 900)
                time.sleep(1.0)
        finally:
            tui.close()
        text = self.server.log_path.read_bytes()
        events = [plugin_events(log, marks[0][0])[: marks[1][0] - marks[0][0]], plugin_events(log, marks[1][0])]
        tasks = [
            server_tasks(text[marks[0][1] : marks[1][1]].decode(errors="replace")),
            server_tasks(text[marks[1][1] :].decode(errors="replace")),
        ]
        firsts = main_requests(events[0], tasks[0], self.offset)
        seconds = main_requests(events[1], tasks[1], self.offset)
        title_prepare = next((e for e in events[0] if e.get("ev") == "prepare" and not e.get("fingerprint")), {})
        return Session(
            arm=arm,
            round=number,
            message=first,
            title=title_of(tasks[0], firsts, self.offset),
            title_prepare=f"{title_prepare.get('action', '-')}: {title_prepare.get('reason', '')}"[:200],
            first=firsts[0] if firsts else None,
            second=seconds[0] if seconds else None,
            processed_total=sum(t.processed for t in tasks[0] + tasks[1]),
            enter_to_answer_ms=(firsts[0].ended_at - sent) * 1000 if firsts else float("nan"),
            tasks=[asdict(t) for t in tasks[0] + tasks[1]],
        )


def _up(url: str) -> bool:
    try:
        return loopback.get(url, timeout=0.5).status_code == 200
    except ServerError:
        return False


# -- the run and its table -------------------------------------------------------------------
def run(model: str, slots: int, rounds: int, work: Path) -> list[Session]:
    rig = ensure_rig(Settings.from_env())
    path = ensure_real_model(rig, Settings.from_env(), model) if model in REAL_MODELS else ensure_model(rig, model)
    bench = Bench(work, model=model, model_path=path, binary=rig.server, slots=slots)
    sessions: list[Session] = []
    try:
        bench.start()
        for arm in ARMS:  # the first session of each arm warms the head and the project head: not counted
            bench.session(arm, 0, PRIME)
        for i in range(1, rounds + 1):
            for arm in ARMS if i % 2 else ARMS[::-1]:
                sessions.append(bench.session(arm, i, FIRST[len(sessions) % len(FIRST)]))
                with open(work / "sessions.jsonl", "a") as out:  # kept as they come: a long run may be cut
                    out.write(json.dumps(asdict(sessions[-1]), default=str) + "\n")
                print(f"  -np {slots} round {i} {arm}: done", flush=True)
    finally:
        bench.stop()
    return sessions


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: list[float]) -> str:
    """The median, and the lowest and highest in parentheses."""
    return f"{_median(values):.0f} ({min(values):.0f}-{max(values):.0f})" if values else "-"


def _cell(request: Request | None) -> str:
    if request is None:
        return f"{'-':<9} {'-':>6} {'-':>11} {'-':>5} {'-':>7}"
    return (
        f"{request.action:<9} {request.daemon_ms:>6.0f} {f'{request.processed}/{request.reused}':>11} "
        f"{request.slot:>5} {request.latency_ms:>7.0f}"
    )


def render(sessions: list[Session], *, model: str, slots: int) -> dict[str, Any]:
    print(f"\nmodel {model}, -np {slots}: a new OpenCode TUI session, two messages ({len(sessions) // 2} per arm)")
    print(f"{'':14} {'title request':^39} | {'first main request':^44} | {'second main request':^44} |")
    print(
        f"{'round':>5} {'arm':<8} {'proc/reused':>11} {'ms':>5} {'slot':>4} {'held':>6} {'beside':>6} | "
        f"{'action':<9} {'dmn ms':>6} {'proc/reused':>11} {'slot':>5} {'ms':>7} | "
        f"{'action':<9} {'dmn ms':>6} {'proc/reused':>11} {'slot':>5} {'ms':>7} | {'Enter->1st':>10}"
    )
    for s in sessions:
        t = s.title
        title = (
            f"{f'{t.processed}/{t.reused}':>11} {t.ms:>5.0f} {t.slot:>4} {t.held_first_ms:>6.0f} "
            f"{t.beside_first_ms:>6.0f}"
            if t
            else f"{'-':>11} {'-':>5} {'-':>4} {'-':>6} {'-':>6}"
        )
        print(f"{s.round:>5} {s.arm:<8} {title} | {_cell(s.first)} | {_cell(s.second)} | {s.enter_to_answer_ms:>10.0f}")
    summary: dict[str, Any] = {}
    for arm in ARMS:
        rows = [s for s in sessions if s.arm == arm]
        firsts = [s.first for s in rows if s.first]
        titles = [s.title for s in rows if s.title]
        summary[arm] = {
            "enter_to_answer_ms": _spread([s.enter_to_answer_ms for s in rows]),
            "first_ms": _spread([r.latency_ms for r in firsts]),
            "first_server_ms": _spread([r.server_ms for r in firsts]),
            "first_daemon_ms": _spread([r.daemon_ms for r in firsts]),
            "first_processed": _spread([r.processed for r in firsts]),
            "second_ms": _spread([s.second.latency_ms for s in rows if s.second]),
            "session_processed": _spread([s.processed_total for s in rows]),
            "title_processed": _spread([t.processed for t in titles]),
            "title_reused": _spread([t.reused for t in titles]),
            "title_ms": _spread([t.ms for t in titles]),
            "title_held_first_ms": _spread([t.held_first_ms for t in titles]),
            "title_beside_first_ms": _spread([t.beside_first_ms for t in titles]),
            "title_other_slot": f"{sum(1 for s in rows if s.title and s.first and s.title.slot != s.first.slot)} "
            f"of {len(titles)}",
        }
    on, off = summary["title"], summary["no-title"]
    print("medians (lowest-highest), title on vs off:")
    for key, what in (
        ("enter_to_answer_ms", "Enter to the first answer, ms"),
        ("first_ms", "the first request, ms (OpenCode handed it over -> its answer's end)"),
        ("first_server_ms", "  its server time, ms"),
        ("first_daemon_ms", "  its prepare, ms"),
        ("first_processed", "  its prompt tokens processed"),
        ("second_ms", "the second request, ms"),
        ("session_processed", "prompt tokens the server processed in the session"),
    ):
        print(f"  {what:<70} {on[key]:>22} vs {off[key]}")
    print(
        f"  the title request: {on['title_processed']} tokens processed, {on['title_reused']} reused, "
        f"{on['title_ms']} ms; ran in front of the first request (which waited) {on['title_held_first_ms']} ms, "
        f"beside it {on['title_beside_first_ms']} ms; on another slot in {on['title_other_slot']}"
    )
    return summary


def load(path: Path) -> tuple[str, list[tuple[int, list[Session]]]]:
    """A saved run (``--json``), to render again."""
    data = json.loads(path.read_text())
    runs = []
    for run_ in data["runs"]:
        sessions = []
        for raw in run_["sessions"]:
            raw = dict(raw)
            raw["title"] = Title(**raw["title"]) if raw["title"] else None
            raw["first"] = Request(**raw["first"]) if raw["first"] else None
            raw["second"] = Request(**raw["second"]) if raw["second"] else None
            sessions.append(Session(**raw))
        runs.append((int(run_["slots"]), sessions))
    return str(data["model"]), runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="gemma3", help="gemma3 (default: Gemma 3 270M), or qwen3 / qwen35 (tiny: -np 1 only)"
    )
    parser.add_argument("--slots", default="1,2", help="comma-separated -np values")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the mechanics: qwen3, -np 1, one round")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the work folder (logs) here")
    parser.add_argument("--render", type=Path, help="print the tables of a saved --json run again")
    args = parser.parse_args()
    if args.render:
        saved, runs = load(args.render)
        for slots, sessions in runs:
            render(sessions, model=saved, slots=slots)
        return 0
    slot_counts = [1] if args.smoke else [int(n) for n in args.slots.split(",")]
    model = "qwen3" if args.smoke else args.model
    rounds = 1 if args.smoke else args.rounds
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {"model": model, "runs": []}
    for slots in slot_counts:
        with tempfile.TemporaryDirectory(prefix="ocpc-title-") as tmp:
            work = args.keep / f"np{slots}" if args.keep else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            sessions = run(model, slots, rounds, work)
            summary = render(sessions, model=model, slots=slots)
            results["runs"].append({"slots": slots, "summary": summary, "sessions": [asdict(s) for s in sessions]})
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if not args.smoke:
        return 0
    sessions_ok = all(s["first"] is not None for r in results["runs"] for s in r["sessions"])
    titles_seen = all(s["title"] is not None for r in results["runs"] for s in r["sessions"] if s["arm"] == "title")
    return 0 if sessions_ok and titles_seen else 1  # the smoke checks the mechanics


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
