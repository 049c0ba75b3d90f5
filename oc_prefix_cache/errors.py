"""The one exception tree of ocpc.

Library errors become these at one edge each: httpx's and the h11 upstream client's in
``loopback.py`` (every loopback call; httpx's own transport mapper is the model), OSError and
JSON in the index (``disk/index.py``), the outward downloads in the rig. So a caller catches
an ocpc error by what it means, never a library's. Every message says what happened and what
to do.

    OcpcError
     ├── ConfigError              a setting or flag ocpc cannot use
     ├── RigError                 building or finding llama-server or the tiny models failed
     ├── ProcessError             a supervised process failed to start or exited early
     ├── ServerError              talking to llama-server failed
     │    ├── ServerUnreachable   refused, reset, or still loading
     │    ├── ServerTimeout       no answer within the call's bound
     │    ├── ServerHTTPError     an error status (.status)
     │    │    └── SlotSaveDisabled   no --slot-save-path (501)
     │    └── SlotRestoreFailed   a restore refused: wrong model, small context, bad file
     ├── UpstreamError            the proxy's exchange with the server broke (doors/upstream.py)
     │    └── UpstreamStale       a kept-alive connection the server had closed: send again
     ├── ClientGone               the agent went away before its request was read
     ├── SlotFileError            a slot file's header is unreadable
     ├── StoreError               the index could not be read or written
     │    └── IndexCorrupt        index.json is not an index: cleanup waits until it is fixed
     ├── LockTimeout              another process held a lock longer than we may wait
     ├── DeadlineExceeded         the request's budget ran out: the slot is left as it is
     ├── BadRequestBody           a body that is not a chat request ocpc can read
     ├── TranslationError         an Anthropic or Responses body that cannot become chat (also a ValueError)
     ├── GateFailed               evidence against a file: it is rebuilt (.probe, .unknown_version)
     ├── Contended                a probe failed, but another request touched the slot: nobody's fault
     ├── ParkTooBig               a park over the park cap: not written
     ├── StoodDown                learned mid-prepare: restores cannot serve on this server
     ├── DigestPending            a model file's content digest is being read: no prepare until it is known
     ├── InstallError             a harness's config cannot be changed (or put back) safely
     ├── FormatError              the config's text is not valid in its format (says where)
     └── JsoncError               not JSON, even allowing comments and trailing commas

The doors turn any of these into the request going on unprepared (a prepare never raises);
the CLI turns them into a message and exit code 1 (``cli.py``).
"""

from __future__ import annotations


class OcpcError(Exception):
    """Base of every error ocpc raises on purpose."""


class ConfigError(OcpcError):
    """A setting or flag has a value ocpc cannot use."""


class RigError(OcpcError):
    """Building or finding llama-server or the tiny models failed."""


class ProcessError(OcpcError):
    """A supervised process failed to start or exited early."""


# -- llama-server ------------------------------------------------------------------------------
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


# -- the proxy's own exchange ------------------------------------------------------------------
class UpstreamError(OcpcError):
    """The upstream server could not be reached, or broke the exchange."""


class UpstreamStale(UpstreamError):
    """A kept-alive connection that the server had closed: nothing was processed; send again."""


class ClientGone(OcpcError):
    """The client went away before its request was read."""


# -- on disk -----------------------------------------------------------------------------------
class SlotFileError(OcpcError):
    """A slot file's header is unreadable: truncated, not a slot file, or another version."""


class StoreError(OcpcError):
    """The index could not be read or written."""


class IndexCorrupt(StoreError):
    """index.json exists but is not a valid index; cleanup is disabled until it is fixed."""


class LockTimeout(OcpcError):
    """Another process held a lock for longer than we may wait."""


# -- a request ---------------------------------------------------------------------------------
class DeadlineExceeded(OcpcError):
    """The caller's budget for this prepare ran out; the slot is left as it is."""


class BadRequestBody(OcpcError):
    """A prepare body that is not a chat request we can read."""


class TranslationError(OcpcError, ValueError):
    """The body cannot be converted; the server would refuse it too (send it on unchanged)."""


# -- the engine's own verdicts -----------------------------------------------------------------
class GateFailed(OcpcError):
    """Evidence against the file itself: it must be rebuilt. ``probe``: the server did not
    reuse it on an untouched slot (the evidence that, repeated, is about the server)."""

    def __init__(self, message: str, *, probe: bool = False, unknown_version: int | None = None) -> None:
        super().__init__(message)
        self.probe = probe
        self.unknown_version = unknown_version  # the file's slot-file version, when this ocpc has not read it


class Contended(OcpcError):
    """The probe failed, but another request touched the slot meanwhile: not the file's fault."""


class ParkTooBig(OcpcError):
    """The park would not fit the park cap: not written (the slot is left as it is)."""


class StoodDown(OcpcError):
    """Learned part-way through a prepare: the request goes on unprepared."""


# -- installs ----------------------------------------------------------------------------------
class DigestPending(OcpcError):
    """A file behind the server's identity is still being digested (first sight of a large model):
    the request goes on unprepared, and a later one finds the digest (disk/content_digest.py)."""


class InstallError(OcpcError):
    """A harness's config cannot be changed (or put back) safely."""


class FormatError(OcpcError):
    """The text is not valid in the config's format (the message says where)."""


class JsoncError(OcpcError):
    """The config is not JSON, even allowing comments and trailing commas."""
