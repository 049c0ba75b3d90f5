"""Logging for the long-running parts: one line per event, to stderr and a rotating file.

Messages carry strings a client chose (a session id from ``metadata.user_id``, a conversation
key, a model name, a path): a newline in one would start a forged line ("... ERROR ..."), so
every message is escaped to one line (``OneLine``). A traceback, which is ours, stays as it is.
The log files are 0600 in a 0700 folder (disk/privacy.py): they hold session ids and paths.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import re
from pathlib import Path

from oc_prefix_cache.files import private_dir, private_opener

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# C0 controls, DEL, C1 controls and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``, ``\\u2028``)."""
    return _CONTROL.sub(
        lambda m: _NAMED.get(
            m.group(), f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}"
        ),
        text,
    )


class OneLine(logging.Formatter):
    """A formatter whose message is always one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.msg, record.args
        record.msg, record.args = one_line(record.getMessage()), None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log whose every file (the first, and each after a rollover) is created 0600."""

    def _open(self) -> io.TextIOWrapper:
        stream = open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=private_opener)
        assert isinstance(stream, io.TextIOWrapper)  # a text mode ("a")
        return stream


def setup_logging(path: Path, *, verbose: bool = False) -> None:
    private_dir(path.parent)
    root = logging.getLogger("ocpc")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    handlers: list[logging.Handler] = [
        logging.StreamHandler(),
        PrivateRotatingFileHandler(path, maxBytes=5_000_000, backupCount=2),
    ]
    for handler in handlers:
        handler.setFormatter(OneLine(FORMAT))
        root.addHandler(handler)
