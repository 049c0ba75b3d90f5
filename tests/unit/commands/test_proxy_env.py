"""`ocpc doctor` and `ocpc install` say when the agents would follow a proxy variable past ocpc
(issue 36, defect 3): ocpc ignores HTTP_PROXY & co. for its own calls (loopback.py), the agents
do not, and only a NO_PROXY that lists 127.0.0.1 keeps their requests, prompts included, on this
machine. No server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands.doctor import proxy_env_check
from oc_prefix_cache.commands.proxy_env import covers, loopback_hosts, proxy_gap
from oc_prefix_cache.settings import Settings
from tests.proxy_stub import NO_PROXY_VARS, PROXY_VARS

URLS = ["http://127.0.0.1:4001", "http://127.0.0.1:4000", "http://127.0.0.1:8080"]


@pytest.mark.parametrize(
    ("value", "covered"),
    [
        ("127.0.0.1", True),
        ("localhost,127.0.0.1", True),
        ("  localhost , 127.0.0.1 ", True),
        ("localhost 127.0.0.1", True),  # undici and Bun also split on spaces
        ("*", True),
        ("localhost", False),  # the name: clients compare the URL's host as written
        ("127.0.0.0/8", False),  # a CIDR: reqwest and requests honour it, httpx and undici do not
        ("127.*", False),
        (".0.0.1", False),  # a suffix: httpx takes it, requests and reqwest do not
        ("127.0.0.1:4000", False),  # one port only
        ("", False),
    ],
)
def test_what_covers_127_0_0_1_for_every_agent(value: str, covered: bool) -> None:
    assert covers(value, "127.0.0.1") is covered


def test_a_name_is_covered_by_itself_and_by_its_domain() -> None:
    assert covers("localhost", "localhost") and covers(".example.com", "ocpc.example.com")
    assert covers("example.com", "ocpc.example.com") and not covers("ample.com", "ocpc.example.com")


def test_only_this_machines_hosts_are_ocpcs_to_check() -> None:
    assert loopback_hosts([*URLS, "http://localhost:9", "http://gpu-box:8080", "http://[::1]:1"]) == (
        "127.0.0.1",
        "localhost",
        "::1",
    )


def test_no_proxy_variable_no_gap_and_a_covering_no_proxy_none_either() -> None:
    assert proxy_gap({}, URLS) is None
    assert proxy_gap({"NO_PROXY": "localhost"}, URLS) is None  # nothing to bypass
    for name in PROXY_VARS:
        assert proxy_gap({name: "http://proxy:3128", "NO_PROXY": "127.0.0.1,localhost"}, URLS) is None
        assert proxy_gap({name: "http://proxy:3128", "no_proxy": "*"}, URLS) is None


@pytest.mark.parametrize("name", PROXY_VARS)
def test_any_proxy_variable_without_no_proxy_is_a_gap_with_the_fix(name: str) -> None:
    gap = proxy_gap({name: "http://user:secret@proxy:3128"}, URLS)
    assert gap is not None and gap.proxies == (name,) and gap.hosts == ("127.0.0.1",)
    assert gap.value == "127.0.0.1,localhost"
    assert gap.fix.startswith("export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost")
    said = gap.detail("pi", "ocpc's proxy")
    assert "NO_PROXY is not set" in said and "prompts included" in said and "secret" not in said
    assert gap.https_only is (name.lower() == "https_proxy")


def test_each_spelling_set_must_cover_it_since_agents_read_different_ones() -> None:
    """undici (pi) reads no_proxy first, reqwest (Codex) NO_PROXY first: both must list it."""
    gap = proxy_gap({"HTTP_PROXY": "http://proxy:3128", "NO_PROXY": "127.0.0.1", "no_proxy": "localhost,.corp"}, URLS)
    assert gap is not None and gap.lacking == ("no_proxy",)
    assert gap.value == "127.0.0.1,localhost,.corp"  # what is there is kept, what is missing added
    assert "no_proxy='localhost,.corp' does not list 127.0.0.1" in gap.detail("Codex CLI", "ocpc")


def test_the_near_misses_say_why_they_do_not_count() -> None:
    gap = proxy_gap({"http_proxy": "http://proxy:3128", "NO_PROXY": "localhost,127.0.0.0/8,10.*"}, URLS)
    assert gap is not None
    said = gap.detail("an agent", "ocpc")
    assert "localhost does not cover 127.0.0.1" in said
    assert "127.0.0.0/8 is a CIDR range" in said and "undici" in said
    assert gap.value == "localhost,127.0.0.0/8,10.*,127.0.0.1"
    assert gap.fix.startswith("export NO_PROXY='localhost,127.0.0.0/8,10.*,127.0.0.1' ")  # quoted for the shell


def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*PROXY_VARS, *NO_PROXY_VARS):
        monkeypatch.delenv(name, raising=False)


def test_doctor_check_ok_without_proxy_variables_and_with_a_covering_no_proxy() -> None:
    settings = Settings.from_env()
    assert proxy_env_check(settings, {}).status == "ok"
    check = proxy_env_check(settings, {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "127.0.0.1"})
    assert check.status == "ok" and "HTTPS_PROXY" in check.detail


def test_install_warns_and_doctor_fails_naming_the_installed_agent(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clean(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "localhost")
    config = isolated_home / "claude-settings.json"
    result = CliRunner().invoke(app, ["install", "--harness", "claude-code", "--config", str(config)])
    assert result.exit_code == 0, result.output
    settings = Settings.from_env()
    assert json.loads(config.read_text())["env"]["ANTHROPIC_BASE_URL"] == settings.proxy_url
    warning = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "Claude Code would send the requests meant for ocpc's proxy" in warning[0], (
        result.output
    )
    assert "NO_PROXY='localhost' does not list 127.0.0.1" in warning[0]
    assert "set: export NO_PROXY=localhost,127.0.0.1 no_proxy=localhost,127.0.0.1" in result.output

    check = proxy_env_check(settings, os.environ)
    assert check.status == "fail" and "Claude Code (installed here)" in check.detail, check
    assert check.fix.startswith("export NO_PROXY=localhost,127.0.0.1")

    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert proxy_env_check(settings, os.environ).status == "ok"
    quiet = CliRunner().invoke(app, ["install", "--harness", "claude-code", "--config", str(config)])
    assert quiet.exit_code == 0 and "warning: " not in quiet.output, quiet.output


def test_without_an_installed_agent_or_with_https_proxy_only_it_is_a_warning(isolated_home: Path) -> None:
    settings = Settings.from_env()
    check = proxy_env_check(settings, {"ALL_PROXY": "socks5://proxy:1080"})
    assert check.status == "warn" and "an agent would send" in check.detail
    https = proxy_env_check(settings, {"HTTPS_PROXY": "http://proxy:3128"})
    assert https.status == "warn" and "through HTTPS_PROXY too" in https.detail
