"""Logging for the long-running parts: one line per event, to stderr and a rotating file."""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(path: Path, *, verbose: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("ocpc")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    handlers: list[logging.Handler] = [
        logging.StreamHandler(),
        logging.handlers.RotatingFileHandler(path, maxBytes=5_000_000, backupCount=2),
    ]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
