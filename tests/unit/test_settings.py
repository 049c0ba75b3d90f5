"""Settings.from_env: defaults, overrides, and bad values refused with the variable's name."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from oc_prefix_cache.disk.gc import GB
from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.settings import ENV_VARS, Settings
from tests.helpers import ROOT

DOCS = ROOT / "docs" / "configuration.md"
NUMBERS = (
    "OC_PREFIX_CACHE_TTL_DAYS",
    "OC_PREFIX_CACHE_MAX_GB",
    "OC_PREFIX_CACHE_PARK_TTL_HOURS",
    "OC_PREFIX_CACHE_PARK_MAX_GB",
)


def test_settings_defaults_and_overrides(tmp_path: Path) -> None:
    s = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path)})
    assert s.slot_dir == tmp_path / "slots" and s.index_path == tmp_path / "index.json"
    assert (s.slot, s.ttl_days, s.keep_recent, s.markers) == (0, 30.0, 3, ("<env>",))
    s = Settings.from_env(
        {
            "OC_PREFIX_CACHE_HOME": str(tmp_path),
            "OC_PREFIX_CACHE_SLOT_DIR": "/srv/slots",
            "OC_PREFIX_CACHE_MAX_GB": "2.5",
            "OC_PREFIX_CACHE_MARKERS": "<env>, <dir>",
            "OC_PREFIX_CACHE_BASE_URL": "http://h:1/",
        }
    )
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


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("OC_PREFIX_CACHE_SLOT", "x", "whole number"),
        ("OC_PREFIX_CACHE_SLOT", "-1", ">= 0"),
        ("OC_PREFIX_CACHE_MAX_GB", "lots", "GB"),
        ("OC_PREFIX_CACHE_TTL_DAYS", "-3", "negative"),
        ("OC_PREFIX_CACHE_PARK_TTL_HOURS", "-1", "negative"),
        ("OC_PREFIX_CACHE_PARK_TTL_HOURS", "soon", "number"),
        ("OC_PREFIX_CACHE_PARK_MAX_GB", "-2", "positive"),
        ("OC_PREFIX_CACHE_PARK_MAX_GB", "big", "GB"),
        ("OC_PREFIX_CACHE_MARKERS", " , ", "empty"),
        ("OC_PREFIX_CACHE_DAEMON_HOST", "0.0.0.0", "loopback"),
    ],
)
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


PORTS = ("OC_PREFIX_CACHE_DAEMON_PORT", "OC_PREFIX_CACHE_PROXY_PORT")
WHOLE = ("OC_PREFIX_CACHE_SLOT", "OC_PREFIX_CACHE_KEEP_RECENT", "OC_PREFIX_CACHE_PARK_MIN_TOKENS")
EVERY_NUMBER = (*PORTS, *WHOLE, *NUMBERS, "OC_PREFIX_CACHE_PARK_AHEAD_S")


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("OC_PREFIX_CACHE_DAEMON_PORT", "70000", "1 to 65535"),
        ("OC_PREFIX_CACHE_PROXY_PORT", "65536", "1 to 65535"),
        ("OC_PREFIX_CACHE_DAEMON_PORT", "0", "1 to 65535"),
        ("OC_PREFIX_CACHE_PROXY_PORT", "-1", "1 to 65535"),
        ("OC_PREFIX_CACHE_DAEMON_PORT", "http", "not a TCP port"),
        ("OC_PREFIX_CACHE_SLOT", str(2**31), "too large"),
        ("OC_PREFIX_CACHE_MAX_GB", "1e300", "too large"),
        ("OC_PREFIX_CACHE_PARK_MAX_GB", "1e7", "too large"),
        ("OC_PREFIX_CACHE_TTL_DAYS", "1e9", "too large"),
        ("OC_PREFIX_CACHE_PARK_TTL_HOURS", "1e12", "too large"),
        ("OC_PREFIX_CACHE_PARK_AHEAD_S", "soon", "seconds"),
        ("OC_PREFIX_CACHE_PARK_AHEAD_S", "1e6", "too large"),
    ],
)
def test_numbers_out_of_range_are_refused_with_what_to_give(name: str, value: str, needle: str) -> None:
    """A daemon port of 70000 once passed here and crashed the bind with an OverflowError after
    `ocpc launch` had started llama-server; MAX_GB=1e300 overflowed gc's byte count to infinity."""
    with pytest.raises(ConfigError, match=needle) as info:
        Settings.from_env({name: value})
    assert name in str(info.value) and "default" in str(info.value)


raw_numbers = st.one_of(
    st.text(max_size=24),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats().map(repr),
    st.floats(allow_nan=False).map(lambda f: f"{f:g}"),
    st.sampled_from(
        [
            "0",
            "1",
            "65535",
            "65536",
            "70000",
            "2147483647",
            "2147483648",
            "off",
            "OFF",
            " none ",
            "nan",
            "inf",
            "-inf",
            "1e400",
            "-0",
            " 8 ",
            "1_000",
            "0x10",
            "1e-400",
            "9" * 5000,
            "٣",
        ]
    ),
)


@given(st.dictionaries(st.sampled_from(EVERY_NUMBER), raw_numbers, max_size=len(EVERY_NUMBER)))
@hyp_settings(max_examples=600)
def test_every_numeric_setting_is_in_range_or_a_config_error(env: dict[str, str]) -> None:
    """Whatever the numbers, from_env gives settings that every user of them can take (a port
    a socket binds, sizes gc can count in bytes, finite ages) or a ConfigError naming a
    variable it was given: never another exception, and never a value that fails later."""
    try:
        s = Settings.from_env(env)
    except ConfigError as exc:
        assert any(name in str(exc) for name in env), exc
        return
    assert all(1 <= port <= 65535 for port in (s.daemon_port, s.proxy_port))
    assert all(0 <= n <= 2**31 - 1 for n in (s.slot, s.keep_recent, s.park_min_tokens))
    assert all(math.isfinite(x) and x >= 0 for x in (s.ttl_days, s.park_ttl_hours))
    assert math.isfinite(s.ttl_days * 86400.0) and math.isfinite(s.park_ttl_hours * 3600.0)
    for size in (s.max_gb, s.park_max_gb):
        assert size is None or (0 < size and isinstance(round(size * GB), int))
    assert s.park_ahead_s is None or (math.isfinite(s.park_ahead_s) and s.park_ahead_s > 0)
