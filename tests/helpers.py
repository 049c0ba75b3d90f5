"""Shared test helpers: the captured OpenCode bodies and direct server calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.head import Head, extract_head, parse_body
from oc_prefix_cache.engine.head_render import render_head
from oc_prefix_cache.llama.client import SlotClient, Timings

T = TypeVar("T")

#: The tests' folder, its captures (tests/data), and the repository's root: for a test at any depth.
TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"
ROOT = TESTS.parent

CAPTURES = DATA / "opencode-1.18.33"
TITLE = "01_projA_turn1_title_request.json"
PROJ_A = "02_projA_turn1_main_request.json"
PROJ_B = "03_projB_turn1_main_request.json"
PROJ_A_TURN2 = "04_projA_turn2_main_request.json"
UA = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"

#: ``OCPC_FULL_TESTS=1``: the long runs at full size (longer windows, more rounds, every
#: variant). CI and `bash tests/run.sh` run them smaller, within the 45-minute budget of a cold
#: CI run on a 2-core machine; the full sizes are for a closing note.
FULL = os.environ.get("OCPC_FULL_TESTS") == "1"

#: Every test server's own flags, also of those `ocpc launch` starts in tests (after its `--`).
#: `--poll 0`: llama.cpp's worker threads sleep between graph runs instead of spinning (its
#: default polls at level 50). On a 2-core machine the spin takes the cores the harness (node),
#: ocpc and pytest need between a server's batches. Measured on test_e2e_claude_code.py +
#: test_ram_swaps.py, arms alternated A B B A: 236 and 262 s with `--poll 0`, 357 and 339 s with
#: the default (0.72x). It changes no cache behaviour; the benches keep llama-server's defaults
#: (they compare against plain llama-server as users run it).
#: `--fit off --no-warmup`: a tiny model's server answers `/health` in 0.97 s instead of 2.05, and a
#: start with its first 6.9k-token request takes 2.89 s instead of 4.26 (medians of 6 + 6 starts,
#: alternated, quiet machine; 2.4 s against 5.3 to `/health` on a loaded one). `--fit` loads the
#: model once more to size it for a device's memory (1.09 s in the server's log, ending "no
#: changes needed"), and the warm-up runs an empty batch whose state is cleared after. The rig
#: tests start a server in 95 places, most of them parametrized or restarted. Neither flag touches
#: a slot, a cache or a flag ocpc's fingerprint reads; the benches keep both (a cold arm's first
#: request is timed).
#: `OCPC_TEST_SERVER_THREADS=N` adds `-t N`: tests/run.sh runs the rig tests on two pytest workers
#: and the agents' end-to-end tests beside the benches, each with its servers on one thread, so two
#: servers share the two cores (with 2-thread servers, two pytest runs side by side on 2 cores were
#: slower than one after the other).
_THREADS = os.environ.get("OCPC_TEST_SERVER_THREADS")
TEST_SERVER_ARGS = ("--poll", "0", "--fit", "off", "--no-warmup", *(("-t", _THREADS) if _THREADS else ()))


def sized(full: int, smaller: int) -> int:
    """``full`` under ``OCPC_FULL_TESTS=1``, else ``smaller``."""
    return full if FULL else smaller


#: How long a test waits for an event it needs (a report, a process's exit, a line in a log, a
#: file): one generous suite-wide bound, never a guess of how long the event takes. A test polls
#: for the event and goes on as soon as it happens, so a quick machine pays nothing for it; a
#: loaded one (a compile beside the suite on two cores) only takes longer, where a fixed few
#: seconds is a guess it outruns (issue 36). A real product deadline a test checks ("the request
#: went on after its 1.5 s budget") is not one of these waits. ``OCPC_TEST_WAIT_S`` overrides it
#: (seconds).
SUITE_WAIT_S = float(os.environ.get("OCPC_TEST_WAIT_S") or 300)


def wait_until(check: Callable[[], T | None], *, what: str, within: float | None = None, every: float = 0.1) -> T:
    """Poll ``check()`` until it returns something truthy and return that; fail naming ``what``
    (and how long it waited) when it has not within ``within`` (default ``SUITE_WAIT_S``)."""
    bound = SUITE_WAIT_S if within is None else within
    started = time.monotonic()
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() - started >= bound:
            raise AssertionError(f"{what}: not within {bound:g} s")
        time.sleep(every)


def capture_bytes(name: str) -> bytes:
    return (CAPTURES / name).read_bytes()


def capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(capture_bytes(name))
    return data


def capture_of(relative: str) -> dict[str, Any]:
    """The body of a harness capture under tests/data (``pi-0.73.1/A1.json``)."""
    data: dict[str, Any] = json.loads((DATA / relative).read_text())["body_json"]
    return data


def chat(url: str, body: dict[str, Any], *, max_tokens: int = 4) -> Timings:
    """Send a chat request like OpenCode would (non-streaming here), return its timings."""
    sent = {**body, "max_tokens": max_tokens, "stream": False}
    sent.pop("stream_options", None)
    response = loopback.post(f"{url}/v1/chat/completions", json=sent, timeout=300)
    response.raise_for_status()
    return Timings.from_response(response.json())


def head_tokens(client: SlotClient, body: dict[str, Any], markers: tuple[str, ...] = ("<env>",)) -> list[int]:
    """The exact token prefix of ``body`` up to its first marker, as the product computes it."""
    parsed = parse_body(json.dumps(body).encode())
    head = extract_head(parsed, markers)
    assert isinstance(head, Head)
    return list(render_head(client, parsed, head).tokens)


def ocpc_cli(args: list[str], *, env: dict[str, str]) -> str:
    """`ocpc ARGS` as a user runs it (a real process, this checkout's package); its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "oc_prefix_cache", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"ocpc {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def install_harness(
    harness: str, *, proxy_url: str, server_url: str, env: dict[str, str], args: tuple[str, ...] = ()
) -> str:
    """`ocpc install --harness HARNESS` pointing the agent at the proxy at ``proxy_url`` (its
    port, as a user's OC_PREFIX_CACHE_PROXY_PORT) in front of ``server_url``; ``env`` names
    the agent's HOME (and its own variables). Its output, which must say the proxy it used."""
    said = ocpc_cli(
        ["install", "--harness", harness, *args],
        env={"OC_PREFIX_CACHE_PROXY_PORT": proxy_url.rsplit(":", 1)[1], "OC_PREFIX_CACHE_BASE_URL": server_url, **env},
    )
    assert f"proxy: {proxy_url} (OC_PREFIX_CACHE_PROXY_PORT=" in said, said
    print(said)
    return said


def uninstall_harness(harness: str, *, env: dict[str, str]) -> str:
    said = ocpc_cli(["uninstall", "--harness", harness], env=env)
    print(said)
    return said
