"""Settings.from_env: defaults, overrides, and bad values refused with the variable's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.settings import ENV_VARS, Settings

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
NUMBERS = ("OC_PREFIX_CACHE_TTL_DAYS", "OC_PREFIX_CACHE_MAX_GB", "OC_PREFIX_CACHE_PARK_TTL_HOURS",
           "OC_PREFIX_CACHE_PARK_MAX_GB")


def test_settings_defaults_and_overrides(tmp_path: Path) -> None:
    s = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path)})
    assert s.slot_dir == tmp_path / "slots" and s.index_path == tmp_path / "index.json"
    assert (s.slot, s.ttl_days, s.keep_recent, s.markers) == (0, 30.0, 3, ("<env>",))
    s = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path), "OC_PREFIX_CACHE_SLOT_DIR": "/srv/slots",
                           "OC_PREFIX_CACHE_MAX_GB": "2.5", "OC_PREFIX_CACHE_MARKERS": "<env>, <dir>",
                           "OC_PREFIX_CACHE_BASE_URL": "http://h:1/"})
    assert s.slot_dir == Path("/srv/slots") and s.max_gb == 2.5 and s.markers == ("<env>", "<dir>")
    assert s.base_url == "http://h:1"


def test_disk_is_bounded_by_default() -> None:
    s = Settings.from_env({})
    assert (s.max_gb, s.park_ttl_hours, s.park_max_gb) == (20.0, 48.0, 10.0)


def test_park_settings_and_off_switches() -> None:
    s = Settings.from_env({"OC_PREFIX_CACHE_PARK_TTL_HOURS": "6.5", "OC_PREFIX_CACHE_PARK_MAX_GB": "0.5"})
    assert (s.park_ttl_hours, s.park_max_gb) == (6.5, 0.5)
    for off in ("off", "OFF", " none ", "0"):
        s = Settings.from_env({"OC_PREFIX_CACHE_MAX_GB": off, "OC_PREFIX_CACHE_PARK_MAX_GB": off})
        assert (s.max_gb, s.park_max_gb) == (None, None)
    assert Settings.from_env({"OC_PREFIX_CACHE_MAX_GB": ""}).max_gb == 20.0  # empty = unset
    assert Settings.from_env({}).park_ahead_s == 1.0
    assert Settings.from_env({"OC_PREFIX_CACHE_PARK_AHEAD_S": "off"}).park_ahead_s is None
    assert Settings.from_env({"OC_PREFIX_CACHE_PARK_AHEAD_S": "2.5"}).park_ahead_s == 2.5


@pytest.mark.parametrize(("name", "value", "needle"), [
    ("OC_PREFIX_CACHE_SLOT", "x", "whole number"), ("OC_PREFIX_CACHE_SLOT", "-1", ">= 0"),
    ("OC_PREFIX_CACHE_MAX_GB", "lots", "GB"), ("OC_PREFIX_CACHE_TTL_DAYS", "-3", "negative"),
    ("OC_PREFIX_CACHE_PARK_TTL_HOURS", "-1", "negative"), ("OC_PREFIX_CACHE_PARK_TTL_HOURS", "soon", "number"),
    ("OC_PREFIX_CACHE_PARK_MAX_GB", "-2", "positive"), ("OC_PREFIX_CACHE_PARK_MAX_GB", "big", "GB"),
    ("OC_PREFIX_CACHE_MARKERS", " , ", "empty"), ("OC_PREFIX_CACHE_DAEMON_HOST", "0.0.0.0", "loopback"),
])
def test_bad_settings_name_the_variable(name: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        Settings.from_env({name: value})
    assert name in str(info.value)


@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", " nan "])
def test_non_finite_numbers_are_refused_with_the_default(name: str, value: str) -> None:
    """TTL_DAYS=nan once made every age comparison false, so gc deleted a file used an hour ago."""
    with pytest.raises(ConfigError, match="finite") as info:
        Settings.from_env({name: value})
    message = str(info.value)
    default = ENV_VARS[name][0]
    assert name in message and f"default {default}" in message


def test_every_variable_is_documented_with_its_default() -> None:
    """docs/configuration.md's table mirrors ENV_VARS: same names, same defaults."""
    text = DOCS.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", text, flags=re.MULTILINE))
    assert set(ENV_VARS) <= set(rows)
    for name in NUMBERS + ("OC_PREFIX_CACHE_KEEP_RECENT",):
        assert rows[name].strip() == f"`{ENV_VARS[name][0]}`", name
