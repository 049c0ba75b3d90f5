"""The one exception tree of ocpc.

Library errors (httpx, OSError, json) are translated into these at a single boundary
(the slot client, the store, the rig), so callers catch ``OcpcError`` and nothing else.
Every message says what happened and what to do.
"""

from __future__ import annotations


class OcpcError(Exception):
    """Base of every error ocpc raises on purpose."""


class ConfigError(OcpcError):
    """A setting or flag has a value ocpc cannot use."""


class RigError(OcpcError):
    """Building or finding llama-server or the tiny models failed."""


class ServerError(OcpcError):
    """Talking to llama-server failed."""


class ServerUnreachable(ServerError):
    """Connection refused, reset, or the server is still loading."""


class ServerTimeout(ServerError):
    """The server did not answer within the call's bound."""


class ServerHTTPError(ServerError):
    """The server answered with an error status."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class SlotSaveDisabled(ServerHTTPError):
    """llama-server runs without --slot-save-path (HTTP 501)."""


class SlotRestoreFailed(ServerError):
    """A restore was refused: wrong model, too small context, missing or corrupt file."""


class SlotFileError(OcpcError):
    """A slot file's header is unreadable: truncated, not a slot file, or another version."""


class StoreError(OcpcError):
    """The index could not be read or written."""


class IndexCorrupt(StoreError):
    """index.json exists but is not a valid index; cleanup is disabled until it is fixed."""


class BadRequestBody(OcpcError):
    """A prepare body that is not a chat request we can read."""


class LockTimeout(OcpcError):
    """Another process held a lock for longer than we may wait."""


class DeadlineExceeded(OcpcError):
    """The caller's budget for this prepare ran out; the slot is left as it is."""


class ProcessError(OcpcError):
    """A supervised process failed to start or exited early."""
