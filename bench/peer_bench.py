"""ocpc against its peer hearth-llm, side by side in one run, on the real rig.

hearth-llm (PyPI) is a caching proxy for llama-server: it keys a chat request by a hash
chain over its messages (role + content only, seeded by the model id), restores the
longest saved prefix with ``/slots/0?action=restore`` before forwarding the request,
and after every response saves the whole slot under the hash of messages + reply.
It runs here in attach mode, ``hearth serve --upstream URL --cache-dir DIR --port P``,
in its own venv (installed on first use, cached by version).

Three arms, each its own llama-server from the same binary and model with the same flags
(``-c 16384 -np 1 -t <cores - 1> --slot-save-path <its own temp dir>``; see
``oc_prefix_cache.commands.demo.server_threads`` for the threads): ``none`` (plain llama-server),
``ocpc`` (the plugin's path: POST /v1/prepare to the daemon, then the request straight
to the server, then the untimed /v1/report that ties the slot to the conversation) and
``hearth`` (the request through its proxy). Every step runs for all three arms in turn,
the order rotating from step to step and run to run (none/ocpc/hearth, ocpc/hearth/none,
...), so load from other work on the machine lands on every arm alike, and no arm always
goes first after a restart:

1. warm-up: a first request of project B's OpenCode session (first ever: ocpc warms
   and saves the head; hearth saves its snapshot); then every server restarts;
2. a new session (project A) after the restart: its first request is table 1's main
   row, and its N turns (each appends the arm's own reply as the assistant message and
   a new user message, as OpenCode does) give table 2;
3. every server restarts again, then the same session's turn N+1 (hearth's design case:
   resuming a conversation). The ocpc arm's restart is the graceful one `ocpc launch` does
   on SIGTERM (and `ocpc park` in the systemd unit's ExecStop): the live conversation is
   parked before the server stops (its time is reported, not part of any request), so the
   resumed turn is restored from that park.

Requests are OpenCode's captured bodies, non-streaming, ``max_tokens: 1`` and
``temperature: 0``: wall time is the time to the first (only) token. prompt_n/cache_n
come from the server's ``timings``. Turns run back to back like an agent loop, so
hearth's save after a reply is paid by the next turn (the last save is not timed).
The whole scenario runs ``--repeat`` times on fresh temp state; tables show medians and
the range over runs, and every "vs none" ratio is taken within a run before its median.

Uneven by design, not by set-up: hearth keys on whole messages, so a new session's first
request (no assistant message yet) can never hit; its snapshots are whole turns, which a
hybrid model cannot reuse once the next prompt diverges before their end (no context
checkpoints in a restored slot on this build); and it ignores the tools in its key.

    .venv/bin/python bench/peer_bench.py                 # full run: qwen35 and qwen3, 10 turns, 3 runs
    .venv/bin/python bench/peer_bench.py --smoke         # CI: one model, 3 turns, 1 run
    .venv/bin/python bench/peer_bench.py --json bench/results/peer-NAME.json --turns 10 --models qwen35
    .venv/bin/python bench/peer_bench.py --peer-dir /tmp/peer    # install hearth-llm there instead
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import platformdirs
from rich.console import Console
from rich.table import Table

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.demo import (
    ChatTiming,
    Spread,
    load_average,
    opencode_body,
    prepare_over_http,
    report_over_http,
    server_threads,
)
from oc_prefix_cache.disk.slotfile import FILE_RE
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.errors import OcpcError, ProcessError
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import Supervised, stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.tiny_models import ensure_model
from oc_prefix_cache.settings import Settings

HEARTH_VERSION = "0.1.1"
PEER_DIR = Path(platformdirs.user_cache_dir("oc-prefix-cache")) / "peer" / f"hearth-llm-{HEARTH_VERSION}"
ARMS = ("none", "ocpc", "hearth")
CASES = ("warm-up: first request ever", "new session after restart", "resume after restart")


def ensure_hearth(peer_dir: Path = PEER_DIR) -> Path:
    """hearth's CLI from its own venv, installed once per version; fails loudly."""
    venv, exe = peer_dir / "venv", peer_dir / "venv" / "bin" / "hearth"
    if not exe.exists():
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            subprocess.run(
                [
                    str(venv / "bin" / "pip"),
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    f"hearth-llm=={HEARTH_VERSION}",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise SystemExit(f"cannot install hearth-llm=={HEARTH_VERSION} into {venv}: {exc}\n{exc.stderr}") from exc
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False).stdout.strip()
    if version != f"hearth {HEARTH_VERSION}":
        raise SystemExit(f"{exe} --version said {version!r}, expected hearth {HEARTH_VERSION}; remove {venv}")
    return exe


def user_turn(k: int) -> str:
    """A new user message of ~350 tokens (a failing test pasted in), different every turn."""
    lines = "\n".join(f"    assert parse_line('{i} {k}') == ({i}, {k * i})  # case {k}.{i}" for i in range(20))
    return (
        f"Turn {k}: this test still fails, fix parse_line in src/parser.py.\n```python\ndef test_{k}():\n{lines}\n```"
    )


class Arm:
    """One llama-server (own port and slot dir) and how a request reaches it."""

    def __init__(self, name: str, binary: Path, model: Path, work: Path, slot_dir: Path) -> None:
        self.name, self.work = name, work
        config = ServerConfig(
            binary=binary,
            model=model,
            port=free_port(),
            slot_dir=slot_dir,
            ctx_size=16384,
            extra_args=("-t", str(server_threads())),
        )
        self.server = LlamaServer(config=config, log_path=work / f"{name}-server.log")
        self.http = loopback.client(timeout=1800)

    def start(self) -> None:
        self.server.start(timeout=300)

    def stop(self) -> None:
        self.http.close()
        self.server.stop()

    def chat(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        data = {**body, "max_tokens": 1, "stream": False, "temperature": 0}
        data.pop("stream_options", None)
        started = time.perf_counter()
        response = self.http.post(f"{url}/v1/chat/completions", json=data)
        request_ms = (time.perf_counter() - started) * 1000
        response.raise_for_status()
        payload = response.json()
        return {
            "prompt_n": int(payload["timings"]["prompt_n"]),
            "cache_n": int(payload["timings"]["cache_n"]),
            "predicted_n": int(payload["timings"].get("predicted_n", 0)),
            "request_ms": request_ms,
            "prepare_ms": 0.0,
            "total_ms": request_ms,
            "action": "-",
            "reply": payload["choices"][0]["message"].get("content") or "",
            "headers": response.headers,
        }

    def send(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        return self.chat(self.server.url, body)

    def restart(self) -> float:
        """Restart the server; returns the ms spent before the stop (nothing here)."""
        self.server.restart()
        return 0.0


class OcpcArm(Arm):
    def __init__(self, binary: Path, model: Path, work: Path) -> None:
        home = work / "ocpc-home"
        super().__init__("ocpc", binary, model, work, home / "slots")
        self.settings = Settings.from_env(
            {**os.environ, "OC_PREFIX_CACHE_HOME": str(home), "OC_PREFIX_CACHE_BASE_URL": self.server.url}
        )
        self.binary = binary
        self.daemon: Daemon | None = None

    def start(self) -> None:
        super().start()
        self.daemon = Daemon(settings=self.settings, server_url=self.server.url, port=0, server_binary=self.binary)
        self.daemon.start()

    def stop(self) -> None:
        try:
            if self.daemon is not None:
                self.daemon.stop()
        finally:
            super().stop()

    def restart(self) -> float:
        """A graceful restart, as `ocpc launch` does on SIGTERM (and `ocpc park` in the systemd
        unit's ExecStop): the live conversation is parked before the server stops."""
        assert self.daemon is not None
        started = time.perf_counter()
        self.http.post(f"{self.daemon.url}/v1/park", json={"timeout_s": 10}, timeout=30).raise_for_status()
        parked_ms = (time.perf_counter() - started) * 1000
        self.server.restart()
        return parked_ms

    def send(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        assert self.daemon is not None
        raw = json.dumps(body).encode()  # the bytes OpenCode would send (max_tokens etc. do not move the head)
        started = time.perf_counter()
        answer = prepare_over_http(self.http, self.daemon.url, raw, session)
        prepare_ms = (time.perf_counter() - started) * 1000
        row = self.chat(self.server.url, body)
        row.update(prepare_ms=prepare_ms, total_ms=prepare_ms + row["request_ms"], action=answer["action"])
        # The plugin's report, off the timed path: it ties the slot to the conversation.
        report_over_http(
            self.http,
            self.daemon.url,
            answer,
            ChatTiming(
                prompt_n=row["prompt_n"],
                cache_n=row["cache_n"],
                prompt_ms=0.0,
                wall_ms=row["request_ms"],
                predicted_n=row["predicted_n"],
            ),
        )
        return row


class HearthArm(Arm):
    def __init__(self, exe: Path, binary: Path, model: Path, work: Path) -> None:
        super().__init__("hearth", binary, model, work, work / "hearth-cache")
        port = free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        self.proxy = Supervised(
            name="hearth",
            health_url=f"{self.proxy_url}/health",
            log_path=work / "hearth.log",
            argv=[
                str(exe),
                "serve",
                "--upstream",
                self.server.url,
                "--port",
                str(port),
                "--cache-dir",
                str(self.server.config.slot_dir),
            ],
        )

    def start(self) -> None:
        super().start()
        try:
            self.proxy.start(timeout=60)
        except ProcessError as exc:
            raise SystemExit(f"hearth-llm {HEARTH_VERSION} did not start: {exc}") from exc

    def stop(self) -> None:
        try:
            self.proxy.stop()
        finally:
            super().stop()

    def send(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        row = self.chat(self.proxy_url, body)
        headers = row["headers"]
        row["action"] = f"{headers.get('x-hearth-cache', '?')} ({headers.get('x-hearth-restored-msgs', '0')} msgs)"
        return row


def arm_order(step: int, run: int) -> list[str]:
    """The arms' order for one step: rotated by step and run, so none of them always goes
    first (right after a restart, or after another arm's burst of work)."""
    k = (step + run) % len(ARMS)
    return list(ARMS[k:] + ARMS[:k])


def bench_model(
    label: str, binary: Path, model: Path, work: Path, turns: int, hearth: Path, run: int = 0
) -> dict[str, Any]:
    work.mkdir(parents=True)
    arms: dict[str, Arm] = {}
    cases: dict[str, dict[str, Any]] = {case: {} for case in CASES}
    per_turn: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    order: list[list[str]] = []

    def in_turn(step: int) -> list[tuple[str, Arm]]:
        names = arm_order(step, run)
        order.append(names)
        return [(name, arms[name]) for name in names]

    try:
        arms["none"] = Arm("none", binary, model, work, work / "none-slots")
        arms["ocpc"] = OcpcArm(binary, model, work)
        arms["hearth"] = peer = HearthArm(hearth, binary, model, work)
        for arm in arms.values():
            arm.start()
        for name, arm in in_turn(0):
            cases[CASES[0]][name] = arm.send(json.loads(opencode_body("B")), "ses_warmup")
        for _, arm in in_turn(1):
            arm.restart()
        talks = {name: json.loads(opencode_body("A")) for name in ARMS}
        for k in range(1, turns + 1):
            for name, arm in in_turn(k + 1):
                row = arm.send(talks[name], "ses_bench")
                per_turn[name].append(row)
                talks[name]["messages"] += [
                    {"role": "assistant", "content": row["reply"]},
                    {"role": "user", "content": user_turn(k + 1)},
                ]
        for name in ARMS:
            cases[CASES[1]][name] = per_turn[name][0]
        park_ms = 0.0
        for name, arm in in_turn(turns + 2):
            spent = arm.restart()
            if name == "ocpc":
                park_ms = spent
        time.sleep(1.5)  # a user comes back a while later; the same for every arm
        for name, arm in in_turn(turns + 3):
            cases[CASES[2]][name] = arm.send(talks[name], "ses_bench")
        hearth_stats = peer.http.get(f"{peer.proxy_url}/hearth/stats").json()
    finally:
        for arm in reversed(list(arms.values())):
            try:
                arm.stop()
            except (OSError, OcpcError) as exc:  # keep stopping the others
                print(f"warning: stopping {arm.name}: {exc}", file=sys.stderr)
    digests = {hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:12] for t in talks.values()}
    ocpc_files = [p for p in (work / "ocpc-home" / "slots").iterdir() if FILE_RE.fullmatch(p.name)]  # every kind

    def clean(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in ("headers", "reply")}

    return {
        "cases": {c: {a: clean(r) for a, r in rows.items()} for c, rows in cases.items()},
        "turns": {a: [clean(r) for r in rows] for a, rows in per_turn.items()},
        "order": order,
        "bodies_identical": len(digests) == 1,
        "hearth_stats": hearth_stats,
        "ocpc_park_before_stop_ms": park_ms,
        "disk": {
            "ocpc_files": len(ocpc_files),
            "ocpc_bytes": sum(p.stat().st_size for p in ocpc_files),
            "hearth_files": hearth_stats["snapshots"],
            "hearth_bytes": hearth_stats["cache_bytes"],
        },
    }


def merge(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges over the runs (fresh temp state each); every "vs none" ratio is
    taken within its run first; counts and actions from all of them."""

    def row(rows: list[dict[str, Any]], base: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out = dict(rows[0])
        for key in ("prepare_ms", "request_ms", "total_ms"):
            out[key] = statistics.median(r[key] for r in rows)
        out["total_spread"] = Spread.of([r["total_ms"] for r in rows]).to_json()
        if base is not None:
            out["vs_none"] = Spread.of(
                [b["total_ms"] / r["total_ms"] for b, r in zip(base, rows, strict=True)]
            ).to_json()
        for key in ("action", "prompt_n", "cache_n"):
            out[key] = "/".join(dict.fromkeys(str(r[key]) for r in rows))
        out["runs_total_ms"] = [round(r["total_ms"], 1) for r in rows]
        return out

    first = reps[0]
    cases = {
        c: {a: row([r["cases"][c][a] for r in reps], [r["cases"][c]["none"] for r in reps]) for a in ARMS}
        for c in CASES
    }
    merged = {
        "cases": cases,
        "turns": {a: [row([r["turns"][a][i] for r in reps]) for i in range(len(first["turns"][a]))] for a in ARMS},
        "bodies_identical": all(r["bodies_identical"] for r in reps),
        "disk": first["disk"],
        "hearth_stats": [r["hearth_stats"] for r in reps],
        "repeat": len(reps),
        "orders": [r["order"] for r in reps],
    }
    merged["summary"] = summarize(merged["turns"])
    for arm in ARMS:  # a whole session per run, against none's in the same run
        sessions = [sum(t["total_ms"] for t in r["turns"][arm]) for r in reps]
        none = [sum(t["total_ms"] for t in r["turns"]["none"]) for r in reps]
        merged["summary"][arm]["session_spread"] = Spread.of(sessions).to_json()
        merged["summary"][arm]["session_vs_none"] = Spread.of(
            [n / s for n, s in zip(none, sessions, strict=True)]
        ).to_json()
    return merged


def summarize(turns: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per arm over turns 2..N (turn 1 is the new-session case of table 1)."""
    out: dict[str, dict[str, Any]] = {}
    for arm, rows in turns.items():
        later = rows[1:] or rows
        ms = [r["total_ms"] for r in later]
        out[arm] = {
            "turn1_ms": rows[0]["total_ms"],
            "mean_ms": statistics.mean(ms),
            "p50_ms": statistics.median(ms),
            "max_ms": max(ms),
            "prepare_mean_ms": statistics.mean(r["prepare_ms"] for r in later),
            "prompt_n_mean": statistics.mean(int(r["prompt_n"].split("/")[0]) for r in later),
            "cache_n_mean": statistics.mean(int(r["cache_n"].split("/")[0]) for r in later),
            "session_ms": sum(r["total_ms"] for r in rows),
        }
    for summary in out.values():
        summary["overhead_ms"] = summary["mean_ms"] - out["none"]["mean_ms"]
    return out


def _range(spread: dict[str, float], unit: str = "", digits: int = 1) -> str:
    return f"{spread['median']:,.{digits}f}{unit} ({spread['low']:,.{digits}f}-{spread['high']:,.{digits}f})"


def render(results: dict[str, dict[str, Any]], turns: int, console: Console) -> None:
    for label, res in results.items():
        runs = res["repeat"]
        table = Table(
            title=f"{label}: time to first token, OpenCode request (non-streaming, max_tokens 1)",
            caption=f"median (range) over {runs} run(s); arms in rotating order; vs none taken within each run",
        )
        for col in ("case", "arm", "action", "prompt_n", "cache_n", "prepare ms", "request ms", "total ms", "vs none"):
            table.add_column(col, justify="left" if col in ("case", "arm", "action") else "right")
        for case in CASES:
            for arm in ARMS:
                r = res["cases"][case][arm]
                table.add_row(
                    case if arm == "none" else "",
                    arm,
                    r["action"],
                    r["prompt_n"],
                    r["cache_n"],
                    f"{r['prepare_ms']:.1f}",
                    f"{r['request_ms']:.1f}",
                    _range(r["total_spread"]),
                    _range(r["vs_none"], "x", 2),
                )
            table.add_section()
        console.print(table)
        table = Table(
            title=f"{label}: per-turn wall time over a {turns}-turn session (stats over turns 2..{turns}, "
            f"each turn the median of {runs} run(s))",
            caption="session: all turns summed per run, median (range); vs none within each run",
        )
        for col in (
            "arm",
            "turn 1 ms",
            "mean ms",
            "p50 ms",
            "max ms",
            "of which prepare",
            "overhead vs none",
            "prompt_n",
            "cache_n",
            "session ms",
            "session vs none",
        ):
            table.add_column(col, justify="left" if col == "arm" else "right")
        for arm in ARMS:
            s = res["summary"][arm]
            table.add_row(
                arm,
                f"{s['turn1_ms']:.1f}",
                f"{s['mean_ms']:.1f}",
                f"{s['p50_ms']:.1f}",
                f"{s['max_ms']:.1f}",
                f"{s['prepare_mean_ms']:.1f}",
                f"{s['overhead_ms']:+.1f}",
                f"{s['prompt_n_mean']:.0f}",
                f"{s['cache_n_mean']:.0f}",
                _range(s["session_spread"], digits=0),
                _range(s["session_vs_none"], "x", 2),
            )
        console.print(table)
        disk, hs = res["disk"], res["hearth_stats"][0]
        console.print(
            f"hearth's last slot restore {hs.get('last_restore_ms', '-')} ms, last save "
            f"{hs.get('last_save_ms', '-')} ms (its own timers, first run). "
            f"Disk after a run: ocpc {disk['ocpc_files']} file(s), {disk['ocpc_bytes'] / 2**20:.1f} MiB; "
            f"hearth {disk['hearth_files']} snapshot(s), {disk['hearth_bytes'] / 2**20:.1f} MiB. "
            f"Request bodies identical across arms: {res['bodies_identical']} "
            "(each arm appends its own reply; temperature 0).\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="short run for CI: one model, 3 turns")
    parser.add_argument("--turns", type=int, default=10, help="turns in the session (>= 2)")
    parser.add_argument("--models", default="qwen35,qwen3", help="tiny rig models, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the whole scenario; medians (smoke: 1)")
    parser.add_argument("--peer-dir", type=Path, default=PEER_DIR, help="where hearth-llm's venv is (installed once)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    turns, models, repeat = (
        (3, ["qwen35"], 1) if args.smoke else (max(2, args.turns), args.models.split(","), max(1, args.repeat))
    )
    load_start = load_average()
    print(f"load average (1/5/15 min) at the start: {load_start}", file=sys.stderr)
    rig = ensure_rig(Settings.from_env())  # the cached rig: its location does not depend on OC_PREFIX_CACHE_HOME
    hearth = ensure_hearth(args.peer_dir)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ocpc-peer-bench-") as tmp:
        os.environ["OC_PREFIX_CACHE_HOME"] = str(Path(tmp) / "home")  # nothing touches the real ocpc home
        for label in models:
            model = ensure_model(rig, label)
            results[label] = merge(
                [
                    bench_model(label, rig.server, model, Path(tmp) / label / f"run{i}", turns, hearth, run=i)
                    for i in range(repeat)
                ]
            )
    console = Console(width=max(150, shutil.get_terminal_size().columns))
    render(results, turns, console)
    load_end = load_average()
    console.print(
        f"load average (1/5/15 min): {load_start} at the start, {load_end} at the end; llama-server -t "
        f"{server_threads()}; other work on this machine makes single timings noisy, hence the rotating order "
        "and the ranges",
        soft_wrap=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "hearth_version": HEARTH_VERSION,
                    "turns": turns,
                    "repeat": repeat,
                    "load_average": {"start": load_start, "end": load_end},
                    "models": results,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
