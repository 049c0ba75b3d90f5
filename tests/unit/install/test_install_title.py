"""`ocpc install` and OpenCode's title request (issue 19, item 4).

The title request costs a new session more than a few percent of its first turn (measured in
the real TUI: bench/title_bench.py, docs/performance.md), so install turns it off, says why with
the numbers, and lets the user keep it: `--keep-title` at install, and `--keep-title` again
after an install that turned it off. Whatever the choice, uninstall gives the user's config back
byte for byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands import doctor
from oc_prefix_cache.install import install, jsonc, uninstall
from oc_prefix_cache.install.opencode import TITLE_BACK, TITLE_KEPT, TITLE_OFF
from oc_prefix_cache.settings import Settings

URL = "http://127.0.0.1:8080"
runner = CliRunner()

# A config with an agent block of the user's: install puts the switch inside it.
WITH_AGENTS = """{
  // my agents
  "agent": {
    "build": { "model": "llamacpp/qwen" }, /* the big one */
  },
  "theme": "dark",
}
"""


def run_install(config: Path, *, keep_title: bool = False) -> list[str]:
    return install(
        Settings.from_env(),
        config_path=config,
        base_url=URL,
        provider_id="llamacpp",
        model="local",
        keep_title=keep_title,
    )


def title_of(config: Path) -> object:
    agent = jsonc.loads(config.read_text()).get("agent")
    return agent.get("title") if isinstance(agent, dict) else None


def test_install_turns_titles_off_and_says_why_with_the_numbers(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    said = run_install(config)
    assert title_of(config) == {"disable": True}
    assert TITLE_OFF in said
    # what a user needs to decide: the measured cost, against the first answer, and how to keep titles
    assert re.search(r"\d+% of the first answer", TITLE_OFF) and "--keep-title" in TITLE_OFF, TITLE_OFF


def test_keep_title_leaves_the_config_without_the_switch_and_round_trips(tmp_path: Path) -> None:
    config = tmp_path / "opencode.jsonc"
    config.write_text(WITH_AGENTS)
    said = run_install(config, keep_title=True)
    assert title_of(config) is None and TITLE_OFF not in said and TITLE_BACK not in said
    uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == WITH_AGENTS


def test_keep_title_after_a_default_install_takes_the_switch_out(tmp_path: Path) -> None:
    """Before, `ocpc install --keep-title` after a default install said "nothing to change"
    and titles stayed off: the user could not change their mind without uninstalling."""
    config = tmp_path / "opencode.jsonc"
    config.write_text(WITH_AGENTS)
    run_install(config)
    assert title_of(config) == {"disable": True}
    said = run_install(config, keep_title=True)
    assert title_of(config) is None and said[0] == TITLE_BACK, said
    assert jsonc.loads(config.read_text())["agent"] == {"build": {"model": "llamacpp/qwen"}}
    assert "/* the big one */" in config.read_text()
    assert run_install(config, keep_title=True) == []  # idempotent
    uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == WITH_AGENTS


def test_keep_title_after_a_default_install_on_a_fresh_config(isolated_home: Path) -> None:
    """The switch as a whole ``agent`` member (no agent block of the user's); uninstall then
    removes the file ocpc created."""
    config = isolated_home / "config" / "opencode" / "opencode.json"
    run_install(config)
    run_install(config, keep_title=True)
    assert "agent" not in json.loads(config.read_text())
    run_install(config)  # and off again: the default puts it back
    assert title_of(config) == {"disable": True}
    uninstall(Settings.from_env(), config_path=config)
    assert not config.exists()


def test_keep_title_keeps_a_switch_the_user_changed_since(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text('{\n  "theme": "dark"\n}\n')
    run_install(config)
    config.write_text(config.read_text().replace('"disable": true', '"disable": true,\n      "prompt": "short"'))
    said = run_install(config, keep_title=True)
    assert title_of(config) == {"disable": True, "prompt": "short"}
    assert any("you changed it since install" in line for line in said) and TITLE_BACK not in said, said
    uninstall(Settings.from_env(), config_path=config)
    assert jsonc.loads(config.read_text())["agent"]["title"]["prompt"] == "short"


def test_keep_title_after_user_edits_elsewhere_keeps_them_on_uninstall(tmp_path: Path) -> None:
    config = tmp_path / "opencode.jsonc"
    config.write_text(WITH_AGENTS)
    run_install(config)
    config.write_text(config.read_text().replace('"theme": "dark"', '"theme": "light"'))
    run_install(config, keep_title=True)
    uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == WITH_AGENTS.replace('"theme": "dark"', '"theme": "light"')


def test_cli_says_what_titles_cost_either_way_and_uninstall_restores(isolated_home: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('{"theme": "dark"}\n')
    off = runner.invoke(app, ["install", "--base-url", URL])
    assert off.exit_code == 0 and TITLE_OFF in off.output, off.output
    kept = runner.invoke(app, ["install", "--base-url", URL, "--keep-title"])
    assert kept.exit_code == 0 and TITLE_BACK in kept.output and TITLE_KEPT in kept.output, kept.output
    assert "--keep-title" in runner.invoke(app, ["install", "--help"]).output
    assert runner.invoke(app, ["uninstall"]).exit_code == 0
    assert config.read_text() == '{"theme": "dark"}\n'


def test_doctor_on_one_slot_says_what_a_kept_title_costs_and_how_to_turn_it_off(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    run_install(config, keep_title=True)
    kept = doctor._slots(1, config)
    assert kept.status == "warn" and "waits for it" in kept.detail and "--keep-title" in kept.fix, kept
    assert doctor._slots(2, config).status == "ok"
    run_install(config)
    assert doctor._slots(1, config) == doctor.Check("slots", "ok", "1 slot(s); title request disabled")
