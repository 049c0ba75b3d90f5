"""Test isolation and the real llama-server rig.

Every test runs with HOME, XDG dirs and OC_PREFIX_CACHE_HOME in its own temp folder, so
no test can write ocpc state or OpenCode config under the real home. Only the rig's build
cache is shared (resolved once, before isolation), so the server is built once.

Rig tests never skip: if the server cannot be built, they fail loudly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from oc_prefix_cache.launch import family_flags
from oc_prefix_cache.llama_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.process import stop_on_sigterm
from oc_prefix_cache.realmodels import REAL_MODELS, ensure_real_model
from oc_prefix_cache.rig import Rig, ensure_rig
from oc_prefix_cache.server_info import model_family
from oc_prefix_cache.settings import Settings
from oc_prefix_cache.tinymodels import SPECS, ensure_model

from .helpers import TEST_SERVER_ARGS

# Resolved at import, from the real environment: the one path tests share with the home.
RIG_DIR = Settings.from_env().rig_dir


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped by SIGTERM (CI's or `timeout`'s) still runs every fixture's teardown, so
    the servers its tests started are stopped by PID (tests/test_signals.py)."""
    stop_on_sigterm()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    for sub in ("config", "data", "cache", "state"):
        (home / sub).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for var, sub in (("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data"),
                     ("XDG_CACHE_HOME", "cache"), ("XDG_STATE_HOME", "state")):
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
    return ensure_rig(_rig_settings())


@pytest.fixture(scope="session")
def models(rig: Rig) -> dict[str, Path]:
    """The tiny models (hybrid, transformer, and their twins) and the real Gemma 3 (SWA)."""
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

    def start(model: str = "qwen35", *, slot_dir: Path | None | str = "default",
              ctx_size: int = 16384, parallel: int = 1, extra_args: tuple[str, ...] = ()) -> LlamaServer:
        slots = tmp_path / "ocpc" / "slots" if slot_dir == "default" else slot_dir
        needs = REAL_MODELS[model].server_args if model in REAL_MODELS else ()  # what this machine needs
        config = ServerConfig(
            binary=rig.server, model=models[model], port=free_port(),
            slot_dir=Path(slots) if slots is not None else None,
            ctx_size=ctx_size, parallel=parallel, extra_args=(*needs, *TEST_SERVER_ARGS, *extra_args),
        )
        server = LlamaServer(config=config, log_path=tmp_path / f"llama-server-{len(started)}.log")
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
