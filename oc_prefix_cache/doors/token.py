"""The deployment's shared token: what a box's network door asks of every request.

A box whose door listens beyond loopback (``ocpc launch --listen``) answers only requests that
carry ``Authorization: Bearer <token>``. The same token is the gateway's API key: ``ocpc gateway``'s
front sends it, smg checks it (its ``--api-key``) and forwards the caller's ``Authorization`` to the
box (a caller's header wins over a worker's key in smg), so one secret guards both hops. The agent's
own ``Authorization`` never gets that far: the front replaces it (agents on a local llama-server
send a placeholder), and the box strips the token before its request reaches llama-server.

Where it lives: one file, 0600 in a 0700 folder (``OC_PREFIX_CACHE_TOKEN_FILE``, default
``$OC_PREFIX_CACHE_HOME/token``), never on a command line (``ps`` shows every user the arguments
of every process). A file readable by others is refused, not used.

Rotation: ``ocpc token --rotate`` keeps the old token as ``<file>.previous`` and writes a new one;
a box accepts both, re-reading the files when they change (a stat per request), so the gateway and
the boxes can take the new file in any order; ``ocpc token --retire`` deletes the previous one.

In transit: plain HTTP. The token authenticates, it does not encrypt: a box's door is for a
network the user trusts (a LAN of their own, a WireGuard or Tailscale tunnel), docs/scale.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.files import write_private

log = logging.getLogger("ocpc.token")

TOKEN_BYTES = 32  # 256 bits, url-safe base64: 43 characters


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + ".previous")


def create(path: Path) -> tuple[str, bool]:
    """The token in ``path``, written first when there is none: (token, made now)."""
    if path.exists():
        return read(path), False
    token = secrets.token_urlsafe(TOKEN_BYTES)
    write_private(path, (token + "\n").encode())
    return token, True


def rotate(path: Path) -> str:
    """A new token; the current one stays accepted as the previous one until ``retire``."""
    if path.exists():
        write_private(previous_path(path), (read(path) + "\n").encode())
    token = secrets.token_urlsafe(TOKEN_BYTES)
    write_private(path, (token + "\n").encode())
    return token


def retire(path: Path) -> bool:
    """Forget the previous token (after every box and the gateway have the new file)."""
    try:
        previous_path(path).unlink()
    except FileNotFoundError:
        return False
    return True


def read(path: Path) -> str:
    """The token in ``path``; ``ConfigError`` saying what to do when it is missing, open to other
    users, or empty."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no token file at {path}: run `ocpc token` to make one, and copy the same file to every box "
            "and to the gateway's machine (OC_PREFIX_CACHE_TOKEN_FILE names it)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the token file {path} is readable by other users: `chmod 600 {path}` (and rotate it)")
    if len(text) < 16 or any(c.isspace() for c in text):
        raise ConfigError(
            f"the token file {path} holds no usable token (16+ characters, no spaces): `ocpc token --rotate`"
        )
    return text


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header (lower-cased names), else None."""
    value = headers.get("authorization", "")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class TokenFile:
    """The tokens a box accepts now: the file's, and the previous one during a rotation.

    Re-read when either file's size or mtime changes, so a rotation needs no restart; a file that
    becomes unreadable (or open to others) leaves no token accepted: every request is refused
    until it is fixed, never let through."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None
        self._tokens: frozenset[str] = frozenset()
        self._current = read(path)  # a box does not start with a door nobody can pass

    def accepted(self) -> frozenset[str]:
        seen = (_stamp(self.path), _stamp(previous_path(self.path)))
        with self._lock:
            if seen != self._seen:
                self._tokens, self._seen = self._load(), seen
            return self._tokens

    def current(self) -> str:
        """The token to send (the gateway's front): the file's own, re-read when it changes; the
        last good one while the file cannot be read (it is logged; the boxes then say why not)."""
        self.accepted()
        with self._lock:
            return self._current

    def _load(self) -> frozenset[str]:
        tokens = set()
        previous = previous_path(self.path)
        for path in (self.path, previous) if previous.exists() else (self.path,):
            try:
                token = read(path)
            except ConfigError as exc:
                log.warning("%s", exc)
                continue
            tokens.add(token)
            if path == self.path:
                self._current = token
        return frozenset(tokens)


def _stamp(path: Path) -> tuple[int, ...] | None:
    """What changes when the file is rewritten, replaced or re-permissioned (a chmod moves ctime)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode
