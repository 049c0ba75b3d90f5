"""``python -m oc_prefix_cache.commands.smg_entry TOKEN_FILE -- SMG_ARGS``: smg with its API key
read from a file (commands/gateway.py says why: never a secret on a command line)."""

from __future__ import annotations

import sys
from pathlib import Path

from oc_prefix_cache.doors.token import read


def with_key(args: list[str], token: str) -> list[str]:
    """smg's arguments with its API key, as one argument: a token may begin with "-", which
    argparse would take for an option of its own ("--api-key: expected one argument")."""
    return [*args, f"--api-key={token}"]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        sys.exit("usage: python -m oc_prefix_cache.commands.smg_entry TOKEN_FILE -- SMG_ARGS")
    token = read(Path(argv[0]))
    from smg.cli import main as smg_main  # type: ignore[import-untyped]  # the gateway extra

    smg_main(with_key(argv[2:], token))


if __name__ == "__main__":
    main(sys.argv[1:])
