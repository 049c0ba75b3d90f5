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
come here. ``tests/test_loopback.py`` fails when any other module of the package calls
``httpx.Client``, ``httpx.AsyncClient`` or a module-level ``httpx.get``/``post``/...

The agents are another matter: they honour these variables on their way to ocpc's proxy
and llama-server; ``ocpc doctor`` and ``ocpc install`` say when ``NO_PROXY`` does not cover
127.0.0.1 (``commands/proxy_env.py``).

``map_errors`` is where an httpx failure becomes one of ocpc's errors (errors.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from oc_prefix_cache.errors import ServerTimeout, ServerUnreachable

DEFAULT_TIMEOUT = httpx.Timeout(5.0)

Timeout = float | httpx.Timeout


def client(
    base_url: str = "",
    *,
    timeout: Timeout = DEFAULT_TIMEOUT,
    transport: httpx.BaseTransport | None = None,
    **kwargs: Any,
) -> httpx.Client:
    """A client that never goes through a proxy from the environment (see the module)."""
    return httpx.Client(base_url=base_url, timeout=timeout, transport=transport, trust_env=False, **kwargs)


def async_client(
    base_url: str = "",
    *,
    timeout: Timeout = DEFAULT_TIMEOUT,
    transport: httpx.AsyncBaseTransport | None = None,
    **kwargs: Any,
) -> httpx.AsyncClient:
    """The asyncio twin of ``client``."""
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport, trust_env=False, **kwargs)


def request(method: str, url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **kwargs: Any) -> httpx.Response:
    """One request on a client of its own (what ``httpx.request`` does, minus the proxies);
    ``kwargs`` are ``httpx.Client.request``'s (``json``, ``content``, ``params``, ``headers``)."""
    with client(timeout=timeout) as http:
        return http.request(method, url, **kwargs)


def get(url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **kwargs: Any) -> httpx.Response:
    return request("GET", url, timeout=timeout, **kwargs)


def post(url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **kwargs: Any) -> httpx.Response:
    return request("POST", url, timeout=timeout, **kwargs)


@contextmanager
def stream(method: str, url: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **kwargs: Any) -> Iterator[httpx.Response]:
    """A streamed response (what ``httpx.stream`` does, minus the proxies)."""
    with client(timeout=timeout) as http, http.stream(method, url, **kwargs) as response:
        yield response


@contextmanager
def map_errors(url: str, *, timeout: float, what: str = "llama-server") -> Iterator[None]:
    """httpx's failures inside the block as ocpc's: a timeout is ``ServerTimeout``, anything
    else that kept the answer from coming (refused, reset, a protocol error) ``ServerUnreachable``."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ServerTimeout(f"{url} did not answer within {timeout:g} s") from exc
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"cannot reach {what} at {url}: {exc}") from exc
