"""The verdict of an agent's end-to-end run: what the rows of its sessions must say, one way for
every agent (tests/e2e/test_e2e_*.py).

A row is one request the proxy finished (``ProxyProcess.four_sessions`` in test_e2e_claude_code.py:
its session, the adapter that took it, its path, the prepare's action, the head's tokens, and the
server's own ``cache_n`` and ``prompt_n``). A session's first request after the first is served
from the head: restored or hit, the server reusing at least 90% of the head. A new session in a
project already seen processes only what is new: at most 2% of the first session's prompt unless
the agent's test says how much. Nothing fails open.

``judge_sessions`` is the whole verdict of the four-session pattern; ``show``, ``warmed``,
``from_the_head`` and ``no_fail_open`` are its parts, for the tests whose sessions go their own way
(Claude Code's five sessions, OpenCode's daemon and plugin reports).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]

#: The four sessions of ``ProxyProcess.four_sessions``, in the order they run.
SESSIONS = ("A1", "A2", "B1", "A3 after restart")
#: The sessions in a project the agent has run in before: they process only what is new.
SEEN_PROJECT = ("A2", "A3 after restart")
#: A request served from the head reuses at least this share of it (the server's ``cache_n``).
HEAD_SHARE = 0.9
#: A new session in a project already seen processes at most this share of the first session's prompt.
NEW_SHARE = 0.02


def every_row(row: Row) -> bool:
    return True


def show(rows: Sequence[Row]) -> None:
    """The rows, one JSON line each, in the test's output (pytest shows it when a test fails)."""
    print("\n" + "\n".join(json.dumps(row) for row in rows))


def warmed(row: Row) -> None:
    """The first request of a head: it warms it."""
    assert row["action"] == "warmed", row


def from_the_head(row: Row, report: Row | None = None) -> None:
    """Restored or hit, and the server reused at least 90% of the head: from ``row`` itself, or from
    ``report`` where the cache counts come apart from the prepare (the OpenCode plugin's report)."""
    assert row["action"] in ("hit", "restored"), row
    if report is None:
        assert row["cache_n"] >= HEAD_SHARE * row["prefix_tokens"], row
    else:
        assert report["cache_n"] >= HEAD_SHARE * row["prefix_tokens"], (row, report)


def no_fail_open(counters: dict[str, Any], *, served: int | None = None) -> None:
    """No request failed open; with ``served``, exactly that many reports said the request was served."""
    if served is not None:
        assert counters.get("report:served", 0) == served, (served, counters)
    assert not any(k.startswith("fail_open") for k in counters), counters


def first_turns(rows: Sequence[Row], sessions: Sequence[str], turn: Callable[[Row], bool] = every_row) -> list[Row]:
    """Each session's first turn (its first row that ``turn`` keeps), in the order of ``sessions``."""
    firsts: dict[str, Row] = {}
    for row in rows:
        if turn(row):
            firsts.setdefault(row["session"], row)
    missing = [session for session in sessions if session not in firsts]
    assert not missing, (f"no turn in {missing}", rows)
    return [firsts[session] for session in sessions]


def judge_sessions(
    rows: Sequence[Row],
    counters: dict[str, Any],
    *,
    adapter: str,
    path: str | None = None,
    path_prefix: str | None = None,
    turn: Callable[[Row], bool] = every_row,
    sessions: Sequence[str] = SESSIONS,
    warmed_in: Sequence[str] = ("A1",),
    bounded: Sequence[str] = SEEN_PROJECT,
    at_most: float | None = None,
    served: int | None = None,
) -> list[Row]:
    """The verdict of an agent's sessions through the proxy; returns each session's first turn.

    ``turn`` keeps the rows that are the agent's turns (default: every row; Kilo's title requests
    have no head, Qwen Code's memory extraction follows its turn): the first turns, the tokens
    processed and the adapter are judged on those. ``warmed_in``: the sessions whose first turn
    warms a head (one per project where the head names the project); every other session's first
    turn is served from the head. ``bounded``: the sessions that process at most ``at_most``
    prompt tokens (default: 2% of the first session's prompt). ``served``: the count of requests
    the reports said were served. Every row's path is ``path``, or starts with ``path_prefix``; the
    adapter is judged last, so that a proxy without it still shows the numbers above.
    """
    show(rows)
    firsts = first_turns(rows, sessions, turn)
    for session, row in zip(sessions, firsts, strict=True):
        if session in warmed_in:
            warmed(row)
        else:
            from_the_head(row)
    turns = [row for row in rows if turn(row)]
    first_prompt = sum(r["cache_n"] + r["prompt_n"] for r in turns if r["session"] == sessions[0])
    bound = NEW_SHARE * first_prompt if at_most is None else at_most
    for session in bounded:
        processed = sum(r["prompt_n"] for r in turns if r["session"] == session)
        print(
            f"{session}: processed {processed} of the first session's {first_prompt} prompt tokens "
            f"({processed / max(first_prompt, 1):.1%}; at most {bound:g})"
        )
        assert processed <= bound, (session, processed, bound, first_prompt, rows)
    no_fail_open(counters, served=served)
    if path is not None:
        assert all(row["path"] == path for row in rows), rows
    if path_prefix is not None:
        assert all(row["path"].startswith(path_prefix) for row in rows), rows
    assert all(row["adapter"] == adapter for row in turns), rows
    return firsts
