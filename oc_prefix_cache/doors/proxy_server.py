"""Running the proxy: uvicorn on a loopback socket bound here, and a Engine for a proxy
that runs on its own (``ocpc launch`` shares the daemon's)."""

from __future__ import annotations

import logging
import socket
import threading
import time

from oc_prefix_cache import __version__
from oc_prefix_cache.doors.front import Front
from oc_prefix_cache.doors.proxy import Proxy
from oc_prefix_cache.doors.router import RouterProxy, is_router
from oc_prefix_cache.engine.wiring import engine_for_url
from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.settings import LOOPBACK_HOSTS, Settings

log = logging.getLogger("ocpc.proxy")


def build_proxy(settings: Settings, *, server_url: str) -> Proxy | RouterProxy:
    """The proxy for ``server_url``: a ``Proxy``, or in front of a llama-server router, a
    ``RouterProxy`` with one Proxy and Engine per model (doors/router.py)."""
    if is_router(server_url):
        log.info("%s is a llama-server router: one Engine per model", server_url)
        return RouterProxy(
            settings=settings,
            server_url=server_url,
            make=lambda model: Proxy(
                settings=settings, engine=engine_for_url(settings, server_url=server_url, model=model)
            ),
        )
    return Proxy(settings=settings, engine=engine_for_url(settings, server_url=server_url))


class ProxyServer:
    """uvicorn serving a ``Proxy`` on a socket bound here (so a port in use is a clear error)."""

    def __init__(
        self,
        proxy: Proxy | RouterProxy | Front,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        watch: bool = False,
    ) -> None:
        """``watch``: run the engine's between-requests watch (restarts, usage written to the index)
        every second, as the daemon does; for a proxy that runs without the daemon's."""
        import uvicorn

        network = isinstance(proxy, Proxy) and proxy.network is not None
        if host not in LOOPBACK_HOSTS and not network:  # a network door asks for the token (doors/token.py)
            raise ConfigError(f"--host {host!r}: the proxy listens on loopback only ({sorted(LOOPBACK_HOSTS)})")
        port = proxy.settings.proxy_port if port is None else port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio then sets TCP_NODELAY on each connection (else Nagle holds back
        # the last small write of an answer for a delayed ACK, ~40 ms)
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as exc:
            self.socket.close()
            raise ConfigError(
                f"the proxy cannot listen on {host}:{port}: {exc.strerror or exc}; "
                "stop what uses it or pick another --port (OC_PREFIX_CACHE_PROXY_PORT)"
            ) from exc
        self.socket.listen(512)
        bound = self.socket.getsockname()[1]
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        if not network:  # a network door has no web UI of its own: no origin is its own
            proxy.own_origins = proxy.own_origins | {self.url, f"http://localhost:{bound}"}
        self.proxy = proxy
        config = uvicorn.Config(
            proxy,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=3,
            server_header=False,
            date_header=False,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watcher = (
            threading.Thread(target=self._watch, args=(proxy,), name="ocpc-proxy-watch", daemon=True)
            if watch and not isinstance(proxy, Front)
            else None
        )

    def _watch(self, proxy: Proxy | RouterProxy) -> None:
        while not self._stopping.wait(1.0):
            try:
                proxy.engine.watch()
            except Exception:  # the watcher must outlive any surprise
                log.exception("the engine's watch failed; trying again")

    def serve_forever(self) -> None:
        log.info("ocpc proxy %s on %s for llama-server %s", __version__, self.url, self.proxy.server)
        if self._watcher is not None and not self._watcher.is_alive():
            self._watcher.start()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopping.set()
            self.proxy.close()
            if self._watcher is not None and not isinstance(self.proxy, Front):
                self.proxy.engine.flush_usage()

    def start(self) -> None:
        """Serve in a background thread (``ocpc launch``, tests); returns once it accepts."""
        self._thread = threading.Thread(target=self.serve_forever, name="ocpc-proxy", daemon=True)
        self._thread.start()
        for _ in range(200):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.01)
        if not self._server.started:
            raise ConfigError(f"the proxy on {self.url} did not start; see the log")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.socket.close()
