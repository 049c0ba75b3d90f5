"""Log lines: a string a client chose cannot start a line of its own."""

from __future__ import annotations

import logging

from oc_prefix_cache.logs import FORMAT, OneLine, one_line


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("ocpc.proxy", logging.INFO, __file__, 1, msg, args, None)


def test_a_session_id_with_a_newline_does_not_forge_a_log_line() -> None:
    session = "user_1_account__session_x\n2026-12-03 10:00:00,000 ERROR ocpc.proxy: forged\x1b[31m\u2028"
    line = OneLine(FORMAT).format(record("parked %s (slot %d): %s", session, 0, "ok"))
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert "session_x\\n2026-12-03 10:00:00,000 ERROR" in line and "\\x1b[31m\\u2028" in line


def test_a_traceback_keeps_its_lines_and_the_record_is_left_as_it_was() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        import sys

        rec = logging.LogRecord("ocpc.proxy", logging.ERROR, __file__, 1, "failed for %s", ("a\nb",), sys.exc_info())
    text = OneLine(FORMAT).format(rec)
    first, *rest = text.split("\n")
    assert first.endswith("failed for a\\nb") and rest and rest[0].startswith("Traceback")
    assert (rec.msg, rec.args) == ("failed for %s", ("a\nb",))  # other handlers format it again
    assert one_line("tab\there") == "tab\\there" and one_line("plain ünïcode") == "plain ünïcode"
