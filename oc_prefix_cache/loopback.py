"""The one place ocpc builds its HTTP clients for llama-server and for its own doors.

Every call ocpc makes to llama-server (the slot API, ``/props``, ``/models``, ``/health``)
and to its own daemon and proxy (``/v1/status``, ``/v1/park``, ``/ocpc/status``) goes
through a client made here, and each one is built with ``trust_env=False``: it ignores
``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` (any case), ``NO_PROXY`` and ``.netrc``.

Why: httpx honours those variables by default, and does not leave 127.0.0.1 out of them by
itself. Many workplaces set them. With them set, a default client sends ocpc's loopback
calls to that proxy: a whole ``/apply-template`` body, the user's prompt in it, left the
machine, every prepare failed open, ``ocpc launch``'s health wait never succeeded, router
detection and ``ocpc park`` failed (issue 36). An ``ALL_PROXY=socks5://...`` even made a
default client raise at construction (httpx wants ``socksio`` for it). The server ocpc
keeps warm is the one configured (``OC_PREFIX_CACHE_BASE_URL``, normally on this machine:
ocpc's slot files are on its disk), and it is reached directly whatever the proxy
variables say.

What still honours them: the rig's and the real model's downloads from PyPI
(``rig.download_from_pypi``), which go outward; they build their own client and never
come here. ``tests/unit/test_loopback.py`` fails when any other module of the package calls
``httpx.Client``, ``httpx.AsyncClient`` or a module-level ``httpx.get``/``post``/...

The agents are another matter: they honour these variables on their way to ocpc's proxy
and llama-server; ``ocpc doctor`` and ``ocpc install`` say when ``NO_PROXY`` does not cover
127.0.0.1 (``commands/proxy_env.py``).

Errors: this is where a loopback call's failures become ocpc's (errors.py), so no caller
catches a library's exception:

- every client made here maps at its transport edge, as httpx's own transport maps httpcore's
  (``map_httpcore_exceptions``): around ``handle_request`` and around the iteration of the
  answer's body. A timeout is ``ServerTimeout``; anything else that kept the answer from coming
  (refused, reset, closed mid-answer, a protocol error) ``ServerUnreachable``; each says which
  server, which URL, what happened and what to do.
- ``raise_for_status`` turns an error status into ``ServerHTTPError`` (with ``.status``).
- ``socket_errors``: the same for the slot client's kept-alive ``http.client`` GET.
- ``upstream_errors``: the proxy's h11 client's (``doors/upstream.py``) as ``UpstreamError``, and
  ``UpstreamStale`` for a kept-alive connection the server had closed (safe to send again).

``tests/unit/test_loopback_errors.py`` shows each on real sockets.
"""

from __future__ import annotations

import asyncio
import http.client
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import h11
import httpx

from oc_prefix_cache.errors import ServerHTTPError, ServerTimeout, ServerUnreachable, UpstreamError, UpstreamStale

DEFAULT_TIMEOUT = httpx.Timeout(5.0)

Timeout = float | httpx.Timeout

SERVER = "the server"  # who answers, in a message, where the caller does not say ("llama-server")

# what httpx.Client passes to the transport it builds when none is given (its _init_transport)
_TRANSPORT_OPTIONS = ("verify", "cert", "http1", "http2", "limits")


def client(
    base_url: str = "",
    *,
    timeout: Timeout = DEFAULT_TIMEOUT,
    transport: httpx.BaseTransport | None = None,
    what: str = SERVER,
    resend_stale: bool = False,
    **kwargs: Any,
) -> httpx.Client:
    """A client that never goes through a proxy from the environment and whose failures are
    ocpc's (see the module). ``what`` names the server in its messages (``"llama-server"``,
    ``"ocpc's daemon"``). A ``transport`` given (a test's, one with socket options) is wrapped,
    not replaced. ``resend_stale``: a request the server dropped before answering (a kept-alive
    connection it had just closed: a router closes its side after proxying) goes once more, on
    a fresh connection, when its body can be sent again."""
    options = {name: kwargs.pop(name) for name in _TRANSPORT_OPTIONS if name in kwargs}
    inner = transport if transport is not None else httpx.HTTPTransport(trust_env=False, **options)
    edge = _Edge(inner, what=what, resend_stale=resend_stale)
    headers = _identity(kwargs.pop("headers", None))
    return httpx.Client(base_url=base_url, timeout=timeout, transport=edge, trust_env=False, headers=headers, **kwargs)


def async_client(
    base_url: str = "",
    *,
    timeout: Timeout = DEFAULT_TIMEOUT,
    transport: httpx.AsyncBaseTransport | None = None,
    what: str = SERVER,
    resend_stale: bool = False,
    **kwargs: Any,
) -> httpx.AsyncClient:
    """The asyncio twin of ``client``."""
    options = {name: kwargs.pop(name) for name in _TRANSPORT_OPTIONS if name in kwargs}
    inner = transport if transport is not None else httpx.AsyncHTTPTransport(trust_env=False, **options)
    edge = _AsyncEdge(inner, what=what, resend_stale=resend_stale)
    kwargs["headers"] = _identity(kwargs.pop("headers", None))
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=edge, trust_env=False, **kwargs)


def request(
    method: str, url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, what: str = SERVER, **kwargs: Any
) -> httpx.Response:
    """One request on a client of its own (what ``httpx.request`` does, minus the proxies);
    ``kwargs`` are ``httpx.Client.request``'s (``json``, ``content``, ``params``, ``headers``)."""
    with client(timeout=timeout, what=what) as http:
        return http.request(method, url, **kwargs)


def get(url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, what: str = SERVER, **kwargs: Any) -> httpx.Response:
    return request("GET", url, timeout=timeout, what=what, **kwargs)


def post(url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, what: str = SERVER, **kwargs: Any) -> httpx.Response:
    return request("POST", url, timeout=timeout, what=what, **kwargs)


@contextmanager
def stream(
    method: str, url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, what: str = SERVER, **kwargs: Any
) -> Iterator[httpx.Response]:
    """A streamed response (what ``httpx.stream`` does, minus the proxies)."""
    with client(timeout=timeout, what=what) as http, http.stream(method, url, **kwargs) as response:
        yield response


def _identity(headers: Any) -> httpx.Headers:
    """The client's headers, asking for answers as they are (``Accept-Encoding: identity``): a
    compressed body is decoded above the transport, where the error mapper cannot see a bad one;
    on loopback compression buys nothing (llama-server and ocpc's doors send none anyway)."""
    merged = httpx.Headers({"Accept-Encoding": "identity"})
    merged.update(httpx.Headers(headers) if headers is not None else {})
    return merged


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """``response`` when its status is not an error; else ``ServerHTTPError`` (``.status``) naming
    the call, the status and the server's own words (llama-server's and ocpc's doors'
    ``{"error": {"message": ...}}``, else the body's start). What ``response.raise_for_status()``
    does, as ocpc's error."""
    if response.is_success:
        return response
    sent = response.request
    raise ServerHTTPError(
        f"{sent.method} {sent.url} -> HTTP {response.status_code}: {error_text(response)}",
        status=response.status_code,
    )


def error_text(response: httpx.Response) -> str:
    """An error answer's message: ``error.message`` (or ``error``) of a JSON body, else its start."""
    try:
        response.read()  # a streamed answer's body, for the message (a read one: at once)
    except httpx.StreamError:
        return ""
    try:
        data = response.json()
    except ValueError:
        return response.text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error) if isinstance(error, str) else response.text[:300]


# -- httpx's failures at the transport edge ------------------------------------------------------
class _Edge(httpx.BaseTransport):
    """A transport that maps the one inside it (httpx's ``map_httpcore_exceptions`` one level up):
    around ``handle_request`` and around the iteration of the answer's body."""

    def __init__(self, inner: httpx.BaseTransport, *, what: str, resend_stale: bool) -> None:
        self._inner = inner
        self._what = what
        self._resend_stale = resend_stale

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with _mapped(request, self._what, answer=False):
            try:
                response = self._inner.handle_request(request)
            except httpx.RemoteProtocolError:
                if not (self._resend_stale and isinstance(request.stream, httpx.ByteStream)):
                    raise
                response = self._inner.handle_request(request)  # the broken connection left the pool
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _Body(response.stream, request, self._what)
        return response

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _Edge:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, request: httpx.Request, what: str) -> None:
        self._inner, self._request, self._what = inner, request, what

    def __iter__(self) -> Iterator[bytes]:
        with _mapped(self._request, self._what, answer=True):
            yield from self._inner

    def close(self) -> None:
        with _mapped(self._request, self._what, answer=True):
            self._inner.close()


class _AsyncEdge(httpx.AsyncBaseTransport):
    """``_Edge``'s asyncio twin."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, what: str, resend_stale: bool) -> None:
        self._inner = inner
        self._what = what
        self._resend_stale = resend_stale

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with _mapped(request, self._what, answer=False):
            try:
                response = await self._inner.handle_async_request(request)
            except httpx.RemoteProtocolError:
                if not (self._resend_stale and isinstance(request.stream, httpx.ByteStream)):
                    raise
                response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _AsyncBody(response.stream, request, self._what)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _AsyncEdge:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._inner.__aexit__(*exc)


class _AsyncBody(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, request: httpx.Request, what: str) -> None:
        self._inner, self._request, self._what = inner, request, what

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped(self._request, self._what, answer=True):
            async for part in self._inner:
                yield part

    async def aclose(self) -> None:
        with _mapped(self._request, self._what, answer=True):
            await self._inner.aclose()


@contextmanager
def _mapped(request: httpx.Request, what: str, *, answer: bool) -> Iterator[None]:
    """httpx's failures inside the block as ocpc's: a timeout is ``ServerTimeout``, anything else
    that kept the answer from coming (refused, reset, closed, a protocol error) ``ServerUnreachable``.
    ``answer``: the block reads the answer's body (its headers came)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ServerTimeout(_timed_out(exc, request, what, answer=answer)) from exc
    except httpx.TransportError as exc:
        raise ServerUnreachable(_broke(exc, request, what, answer=answer)) from exc


def _timed_out(exc: httpx.TimeoutException, request: httpx.Request, what: str, *, answer: bool) -> str:
    bounds: dict[str, float | None] = request.extensions.get("timeout") or {}
    at = f"{what} at {request.url}"
    if isinstance(exc, httpx.ConnectTimeout):
        return f"{at} did not accept a connection within {_s(bounds.get('connect'))}: is it running, or overloaded?"
    if isinstance(exc, httpx.WriteTimeout):
        return f"{at} did not take the request within {_s(bounds.get('write'))}: is it overloaded?"
    if isinstance(exc, httpx.PoolTimeout):
        return f"no free connection to {at} within {_s(bounds.get('pool'))}: too many calls at once"
    if answer:
        return f"{at} did not answer within {_s(bounds.get('read'))} (its answer stopped part-way): is it hung?"
    return f"{at} did not answer within {_s(bounds.get('read'))}: is it busy or hung?"


def _broke(exc: httpx.TransportError, request: httpx.Request, what: str, *, answer: bool) -> str:
    if answer:
        return f"the answer of {what} at {request.url} broke off: {_reason(exc)}: did it stop or restart?"
    if isinstance(exc, httpx.UnsupportedProtocol):
        return f"cannot reach {what} at {request.url}: {_reason(exc)}: is the URL right?"
    return f"cannot reach {what} at {request.url}: {_reason(exc)}: {_hint(exc)}"


def _s(seconds: float | None) -> str:
    return f"{seconds:g} s" if seconds is not None else "its bound"


def _reason(exc: BaseException) -> str:
    """What broke, in the OS's words where it said (``connection refused``), else the library's."""
    seen: BaseException | None = exc
    for _ in range(8):  # exc, httpx's, httpcore's, the socket's
        if seen is None:
            break
        if isinstance(seen, OSError) and (seen.errno or seen.strerror):
            # the errno's own words: asyncio's strerror is "Connect call failed (host, port)"
            return _lowered(os.strerror(seen.errno) if seen.errno else str(seen.strerror))
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().rstrip(".")
    return _lowered(text) if text else type(exc).__name__


def _hint(exc: BaseException) -> str:
    refused = isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)) or isinstance(
        exc.__cause__, ConnectionRefusedError
    )
    return "is it running?" if refused else "did it stop or restart?"


def _lowered(text: str) -> str:
    return text if text[:2].isupper() else text[:1].lower() + text[1:]


# -- the slot client's kept-alive http.client GET (llama/client.py) -------------------------------
@contextmanager
def socket_errors(url: str, *, timeout: float, what: str = SERVER) -> Iterator[None]:
    """``http.client``'s and the socket's failures inside the block as the clients' above."""
    try:
        yield
    except TimeoutError as exc:
        raise ServerTimeout(f"{what} at {url} did not answer within {timeout:g} s: is it busy or hung?") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise ServerUnreachable(f"cannot reach {what} at {url}: {_reason(exc)}: {_hint(exc)}") from exc


# -- the proxy's h11 client (doors/upstream.py) ---------------------------------------------------
Stage = Literal["connect", "exchange", "answer"]

_BROKEN = (ConnectionError, asyncio.IncompleteReadError, h11.RemoteProtocolError)


@contextmanager
def upstream_errors(host: str, port: int, stage: Stage, *, reused: bool = False) -> Iterator[None]:
    """The h11 upstream client's failures inside the block as ``UpstreamError``, by ``stage``:

    - ``connect``: any OSError (refused, unreachable, the connect's own bound running out);
    - ``exchange`` (sending a request, reading its answer's head): a broken connection (reset,
      closed, cut short, or the client's own ``UpstreamError``) on a connection that was kept
      alive (``reused``) is ``UpstreamStale``: the server had closed it, nothing was processed,
      the request can go again; not when h11 found the answer malformed (that one did answer).
      On a fresh connection it is ``UpstreamError``;
    - ``answer`` (its body): a broken connection is ``UpstreamError`` (the answer broke off).

    Anything else (a cancellation, a bug) goes through unchanged."""
    try:
        yield
    except Exception as exc:
        mapped = _upstream_error(exc, f"{host}:{port}", stage, reused=reused)
        if mapped is None:
            raise
        raise mapped from exc


def _upstream_error(exc: Exception, where: str, stage: Stage, *, reused: bool) -> UpstreamError | None:
    if stage == "connect":
        if not isinstance(exc, OSError):
            return None
        why = exc.strerror or str(exc) or ("timed out" if isinstance(exc, TimeoutError) else type(exc).__name__)
        return UpstreamError(f"cannot connect to {where}: {why}")
    broken = isinstance(exc, _BROKEN)
    if stage == "answer":
        return UpstreamError(f"the answer broke off: {type(exc).__name__}: {exc}") if broken else None
    if not (broken or isinstance(exc, UpstreamError)) or isinstance(exc, UpstreamStale):
        return None
    if reused and not isinstance(exc, h11.RemoteProtocolError):
        return UpstreamStale(f"a kept-alive connection to {where} was closed")
    return None if isinstance(exc, UpstreamError) else UpstreamError(f"{type(exc).__name__}: {exc}")
