"""`ocpc install --harness claude-code|pi`: the same round trips as OpenCode's install.

Byte-identical uninstall, a symlinked config (edited behind the link, link and mode kept),
a config deleted since (uninstall writes nothing), a config the user edited since (exactly
ocpc's entries go), and one a tool re-serialised (ocpc's entries found by their path).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.install import InstallError, claude_code, install, jsonc, pi, uninstall
from oc_prefix_cache.settings import Settings

runner = CliRunner()
PROXY = "http://127.0.0.1:8766"

CLAUDE_SETTINGS = """{
  "model": "opus",
  "env": {
    "MY_TOOL_HOME": "/opt/tool"
  },
  "permissions": {"allow": ["Bash(ls:*)"]}
}
"""

PI_MODELS = """{
  // my local servers
  "providers": {
    "ollama": {
      "baseUrl": "http://localhost:11434/v1",
      "api": "openai-completions",
      "apiKey": "ollama",
      "models": [{ "id": "llama3.1:8b" }]
    }
  }
}
"""


def settings() -> Settings:
    return Settings.from_env()


def claude_install(config: Path, *, model: str | None = None) -> list[str]:
    return claude_code.install(settings(), config_path=config, model=model)


def pi_install(config: Path, *, provider_id: str = "ocpc", model: str = "qwen") -> list[str]:
    return pi.install(settings(), config_path=config, provider_id=provider_id, model=model)


def env_of(config: Path) -> dict[str, str]:
    env: dict[str, str] = jsonc.loads(config.read_text())["env"]
    return env


# --- Claude Code: the env block of its settings file ---------------------------------------


def test_claude_fresh_settings_are_created_and_uninstall_removes_them(isolated_home: Path) -> None:
    config = isolated_home / ".claude" / "settings.json"
    said = claude_install(config)
    assert env_of(config) == {
        "ANTHROPIC_BASE_URL": PROXY,
        "ANTHROPIC_AUTH_TOKEN": "ocpc-local",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_MODEL_CAPABILITIES": "-mid_conv_system,-per_turn_effort",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    assert any("ocpc proxy" in line for line in said), said
    # the output says what each entry does
    assert any(
        "CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system,-per_turn_effort: no system" in line for line in said
    ), said
    assert claude_install(config) == []  # idempotent
    assert any("removed" in line for line in uninstall(settings(), config_path=config, harness="claude-code"))
    assert not config.exists()


def test_claude_existing_settings_keep_every_key_and_come_back_byte_for_byte(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(CLAUDE_SETTINGS)
    claude_install(config, model="qwen3.5")
    data = jsonc.loads(config.read_text())
    assert data["model"] == "opus" and data["permissions"] == {"allow": ["Bash(ls:*)"]}
    assert data["env"]["MY_TOOL_HOME"] == "/opt/tool"
    assert data["env"]["ANTHROPIC_BASE_URL"] == PROXY and data["env"]["ANTHROPIC_MODEL"] == "qwen3.5"
    assert list(data["env"])[:2] == ["ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN"]  # ours first, in order
    uninstall(settings(), config_path=config, harness="claude-code")
    assert config.read_text() == CLAUDE_SETTINGS


def test_claude_keeps_the_users_token_and_says_when_it_replaces_a_value(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    original = json.dumps(
        {
            "env": {
                "ANTHROPIC_API_KEY": "sk-mine",
                "ANTHROPIC_BASE_URL": "http://10.0.0.5:8080",
                "CLAUDE_CODE_ATTRIBUTION_HEADER": "false",
            }
        },
        indent=2,
    )
    config.write_text(original)
    said = claude_install(config)
    env = env_of(config)
    assert "ANTHROPIC_AUTH_TOKEN" not in env and env["ANTHROPIC_API_KEY"] == "sk-mine"
    assert env["ANTHROPIC_BASE_URL"] == PROXY
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "false"  # the user's spelling already turns it off
    replaced = [line for line in said if line.startswith("replaced")]
    assert len(replaced) == 1 and "http://10.0.0.5:8080" in replaced[0] and "uninstall" in replaced[0], said
    uninstall(settings(), config_path=config, harness="claude-code")
    assert config.read_text() == original


@pytest.mark.parametrize(
    ("mine", "kept"),
    [
        ("-mid_conv_system,-per_turn_effort", True),
        ("opus*=effort;-per_turn_effort,-mid_conv_system", True),
        ("-mid_conv_system;-per_turn_effort,effort", True),
        ("-mid_conv_system", False),
        ("effort", False),
        ("-mid_conv_system,-per_turn_effort;local=mid_conv_system", False),
        ("local=-mid_conv_system,-per_turn_effort", False),
    ],
)
def test_claude_keeps_the_users_capabilities_and_turns_system_turns_off(tmp_path: Path, mine: str, kept: bool) -> None:
    """A capability list of the user's is kept: when it does not already turn both kinds of system
    entries off for every model, ``;-mid_conv_system,-per_turn_effort`` is appended (Claude Code reads later entries
    over earlier ones), and uninstall gives theirs back."""
    config = tmp_path / "settings.json"
    original = json.dumps({"env": {"CLAUDE_CODE_MODEL_CAPABILITIES": mine}}, indent=2)
    config.write_text(original)
    said = claude_install(config)
    value = env_of(config)["CLAUDE_CODE_MODEL_CAPABILITIES"]
    assert value == (mine if kept else f"{mine};-mid_conv_system,-per_turn_effort"), said
    assert claude_code.system_turns_off(value)
    uninstall(settings(), config_path=config, harness="claude-code")
    assert config.read_text() == original


def test_claude_edited_since_loses_exactly_ocpcs_entries(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": "http://10.0.0.5:8080"}, "model": "opus"}, indent=2))
    claude_install(config)
    edited = config.read_text().replace('"model": "opus"', '"model": "sonnet",\n  "theme": "dark"')
    edited = edited.replace('"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"', '"CLAUDE_CODE_ATTRIBUTION_HEADER": "1"')
    config.write_text(edited)
    said = uninstall(settings(), config_path=config, harness="claude-code")
    assert jsonc.loads(config.read_text()) == {
        "env": {
            "ANTHROPIC_BASE_URL": "http://10.0.0.5:8080",  # the user's value, put back
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "1",
        },  # changed by the user: theirs now, kept
        "model": "sonnet",
        "theme": "dark",
    }
    assert any("later edits are kept" in line for line in said), said
    assert any("kept env.CLAUDE_CODE_ATTRIBUTION_HEADER" in line for line in said), said


def test_claude_env_block_ocpc_created_keeps_the_users_additions(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text('{\n  "model": "opus"\n}\n')
    claude_install(config)
    text = config.read_text().replace('"env": {', '"env": {\n    "MY_VAR": "mine",')
    config.write_text(text)
    uninstall(settings(), config_path=config, harness="claude-code")
    assert jsonc.loads(config.read_text()) == {"env": {"MY_VAR": "mine"}, "model": "opus"}


@pytest.mark.parametrize("indent", ["\t", 4])
def test_claude_settings_reserialised_since_lose_ocpcs_entries(tmp_path: Path, indent: str | int) -> None:
    """Claude Code rewrites its settings.json when a setting changes in its UI: the snippets
    install wrote are then not there byte for byte, but the entries are, and must go."""
    config = tmp_path / "settings.json"
    config.write_text(CLAUDE_SETTINGS)
    claude_install(config)
    data = jsonc.loads(config.read_text())
    data["theme"] = "dark"
    config.write_text(json.dumps(data, indent=indent))
    said = uninstall(settings(), config_path=config, harness="claude-code")
    assert jsonc.loads(config.read_text()) == jsonc.loads(CLAUDE_SETTINGS) | {"theme": "dark"}, said


def test_claude_symlinked_settings_are_edited_behind_the_link(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "claude-settings.json"
    real.parent.mkdir()
    real.write_text(CLAUDE_SETTINGS)
    real.chmod(0o600)
    link = tmp_path / ".claude" / "settings.json"
    link.parent.mkdir()
    link.symlink_to(real)
    said = claude_install(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert env_of(real)["ANTHROPIC_BASE_URL"] == PROXY and stat.S_IMODE(real.stat().st_mode) == 0o600
    assert any(f"behind the link {link}" in line for line in said), said
    uninstall(settings(), config_path=link, harness="claude-code")
    assert link.is_symlink() and real.read_text() == CLAUDE_SETTINGS
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


def test_claude_symlinked_settings_edited_since_keep_link_and_mode(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "claude-settings.json"
    real.parent.mkdir()
    real.write_text(CLAUDE_SETTINGS)
    real.chmod(0o640)
    link = tmp_path / "settings.json"
    link.symlink_to(real)
    claude_install(link)
    real.write_text(real.read_text().replace('"opus"', '"sonnet"'))
    uninstall(settings(), config_path=link, harness="claude-code")
    assert link.is_symlink() and real.read_text() == CLAUDE_SETTINGS.replace('"opus"', '"sonnet"')
    assert stat.S_IMODE(real.stat().st_mode) == 0o640


def test_claude_settings_deleted_since_install_are_left_deleted(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(CLAUDE_SETTINGS)
    claude_install(config)
    config.unlink()
    said = uninstall(settings(), config_path=config, harness="claude-code")
    assert not config.exists() and any("is gone" in line for line in said), said
    with pytest.raises(InstallError, match="no record"):
        uninstall(settings(), config_path=config, harness="claude-code")


def test_claude_env_that_is_not_an_object_is_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text('{"env": ["A=1"]}')
    with pytest.raises(InstallError, match="'env' is not an object"):
        claude_install(config)
    assert config.read_text() == '{"env": ["A=1"]}'


# --- pi: a provider in models.json ---------------------------------------------------------


def test_pi_fresh_models_json_is_created_and_uninstall_removes_it(isolated_home: Path) -> None:
    config = isolated_home / ".pi" / "agent" / "models.json"
    said = pi_install(config)
    provider = json.loads(config.read_text())["providers"]["ocpc"]  # plain JSON, as pi reads it
    assert provider == {
        "baseUrl": PROXY + "/v1",
        "api": "openai-completions",
        "apiKey": "ocpc-local",
        "compat": {"sendSessionAffinityHeaders": True},
        "models": [{"id": "qwen"}],
    }
    assert any("pi --provider ocpc --model qwen" in line for line in said), said
    assert pi_install(config) == []  # idempotent
    uninstall(settings(), config_path=config, harness="pi")
    assert not config.exists()


def test_pi_existing_models_json_keeps_comments_and_comes_back_byte_for_byte(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(PI_MODELS)
    pi_install(config)
    text = config.read_text()
    assert "// my local servers" in text
    assert list(jsonc.loads(text)["providers"]) == ["ocpc", "ollama"]
    uninstall(settings(), config_path=config, harness="pi")
    assert config.read_text() == PI_MODELS


def test_pi_provider_id_that_points_elsewhere_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(PI_MODELS)
    with pytest.raises(InstallError, match="--provider-id"):
        pi_install(config, provider_id="ollama")
    assert config.read_text() == PI_MODELS


def test_pi_provider_at_the_proxy_is_completed_not_duplicated(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    original = json.dumps(
        {
            "providers": {
                "mine": {
                    "baseUrl": "http://localhost:8766/v1/",
                    "apiKey": "x",
                    "compat": {"sendSessionAffinityHeaders": False},
                    "models": [{"id": "big"}],
                }
            }
        },
        indent=2,
    )
    config.write_text(original)
    said = pi_install(config, provider_id="mine", model="small")
    provider = jsonc.loads(config.read_text())["providers"]["mine"]
    assert provider["compat"] == {"sendSessionAffinityHeaders": True}
    assert [m["id"] for m in provider["models"]] == ["small", "big"]
    assert any(line.startswith("replaced your compat.sendSessionAffinityHeaders") for line in said), said
    uninstall(settings(), config_path=config, harness="pi")
    assert config.read_text() == original


def test_pi_edited_since_loses_exactly_ocpcs_provider(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(PI_MODELS)
    pi_install(config)
    config.write_text(config.read_text().replace('"apiKey": "ollama"', '"apiKey": "OLLAMA_KEY"'))
    uninstall(settings(), config_path=config, harness="pi")
    assert config.read_text() == PI_MODELS.replace('"apiKey": "ollama"', '"apiKey": "OLLAMA_KEY"')


def test_pi_provider_the_user_extended_since_is_kept_and_said(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(PI_MODELS)
    pi_install(config)
    data = jsonc.loads(config.read_text())
    data["providers"]["ocpc"]["models"].append({"id": "another"})
    config.write_text(json.dumps(data, indent=2))
    said = uninstall(settings(), config_path=config, harness="pi")
    assert "ocpc" in jsonc.loads(config.read_text())["providers"]  # the user's model relies on it
    assert any("kept providers.ocpc: you changed it since install" in line for line in said), said


def test_pi_symlinked_models_json_is_edited_behind_the_link(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "models.json"
    real.parent.mkdir()
    real.write_text(PI_MODELS)
    real.chmod(0o600)
    link = tmp_path / "agent" / "models.json"
    link.parent.mkdir()
    link.symlink_to(real)
    pi_install(link)
    assert link.is_symlink() and "ocpc" in jsonc.loads(real.read_text())["providers"]
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    real.write_text(real.read_text().replace("llama3.1:8b", "llama3.2:3b"))
    uninstall(settings(), config_path=link, harness="pi")
    assert link.is_symlink() and real.read_text() == PI_MODELS.replace("llama3.1:8b", "llama3.2:3b")
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


def test_pi_models_json_deleted_since_install_is_left_deleted(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(PI_MODELS)
    pi_install(config)
    config.unlink()
    said = uninstall(settings(), config_path=config, harness="pi")
    assert not config.exists() and any("is gone" in line for line in said), said


# --- OpenCode: the same path-based fallback ------------------------------------------------


def test_opencode_config_reserialised_since_loses_ocpcs_entries(tmp_path: Path) -> None:
    """Before, a snippet not found byte for byte counted as removed by the user: a config
    re-serialised with another indent kept the plugin, the provider and the title switch."""
    config = tmp_path / "opencode.json"
    config.write_text('{\n  "theme": "dark",\n  "plugin": ["other"]\n}\n')
    install(settings(), config_path=config, base_url="http://127.0.0.1:8080", provider_id="llamacpp", model="m")
    config.write_text(json.dumps(json.loads(config.read_text()), indent="\t"))
    uninstall(settings(), config_path=config)
    assert json.loads(config.read_text()) == {"theme": "dark", "plugin": ["other"]}


# --- the command line ----------------------------------------------------------------------


def test_cli_claude_code_uses_claude_config_dir_and_round_trips(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "claude-config"
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(folder))
    monkeypatch.setenv("OC_PREFIX_CACHE_PROXY_PORT", "9777")
    result = runner.invoke(app, ["install", "--harness", "claude-code", "--model", "qwen"])
    assert result.exit_code == 0, result.output
    assert env_of(folder / "settings.json")["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9777"
    assert not (isolated_home / ".claude").exists()
    assert "nothing to change" in runner.invoke(app, ["install", "--harness", "claude-code", "--model", "qwen"]).output
    wrong = runner.invoke(app, ["uninstall", "--config", str(folder / "settings.json")])
    assert wrong.exit_code == 1 and "--harness claude-code" in wrong.output
    back = runner.invoke(app, ["uninstall", "--harness", "claude-code"])
    assert back.exit_code == 0 and not (folder / "settings.json").exists(), back.output


def test_cli_claude_code_project_edits_settings_local(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["install", "--harness", "claude-code", "--project"])
    assert result.exit_code == 0, result.output
    assert env_of(tmp_path / ".claude" / "settings.local.json")["ANTHROPIC_BASE_URL"] == PROXY
    refused = runner.invoke(app, ["install", "--harness", "claude-code", "--project", "--provider-id", "x"])
    assert refused.exit_code == 1 and "drop --provider-id" in refused.output
    assert runner.invoke(app, ["uninstall", "--harness", "claude-code", "--project"]).exit_code == 0
    assert not (tmp_path / ".claude" / "settings.local.json").exists()


def test_cli_pi_default_path_model_and_refusals(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = runner.invoke(app, ["install", "--harness", "pi", "--model", "qwen3.5-2b"])
    assert result.exit_code == 0, result.output
    models = isolated_home / ".pi" / "agent" / "models.json"
    assert json.loads(models.read_text())["providers"]["ocpc"]["models"] == [{"id": "qwen3.5-2b"}]
    assert runner.invoke(app, ["install", "--harness", "pi", "--project"]).exit_code == 1
    assert "OpenCode's" in runner.invoke(app, ["install", "--harness", "pi", "--keep-title"]).output
    assert runner.invoke(app, ["install", "--harness", "crush"]).exit_code != 0  # no config install for it
    assert runner.invoke(app, ["uninstall", "--harness", "pi"]).exit_code == 0 and not models.exists()
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(tmp_path / "agent"))
    assert runner.invoke(app, ["install", "--harness", "pi"]).exit_code == 0
    assert (tmp_path / "agent" / "models.json").is_file()


def test_records_from_before_harnesses_still_uninstall(isolated_home: Path, tmp_path: Path) -> None:
    """install.json written by an older ocpc: changes carry only offset and snippet, no harness."""
    config = tmp_path / "opencode.json"
    config.write_text('{\n  "theme": "dark"\n}\n')
    install(settings(), config_path=config, base_url="http://127.0.0.1:8080", provider_id="llamacpp", model="m")
    records_file = settings().home / "install.json"
    records = json.loads(records_file.read_text())
    record = records[str(config)]
    del record["harness"], record["proxy_url"]
    record["insertions"] = [{"offset": c["offset"], "snippet": c["snippet"]} for c in record["insertions"]]
    records_file.write_text(json.dumps(records))
    config.write_text(config.read_text().replace('"dark"', '"light"'))
    uninstall(settings(), config_path=config)
    assert config.read_text() == '{\n  "theme": "light"\n}\n'


def test_a_relative_config_path_is_recorded_absolute(tmp_path: Path, monkeypatch) -> None:
    """`ocpc install --config settings.json` in one folder, `ocpc uninstall --config
    $PWD/settings.json` (or from another folder): the record must name the file, not the
    words typed; before, the record was unfindable and ocpc's entries stayed in the config."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    original = tmp_path / "a" / "settings.json"
    original.write_text(CLAUDE_SETTINGS)
    monkeypatch.chdir(tmp_path / "a")
    assert claude_install(Path("settings.json"))
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(InstallError, match="no record"):
        uninstall(settings(), config_path=Path("settings.json"))  # b has no install: a's record is not its
    uninstall(settings(), config_path=original)
    assert original.read_text() == CLAUDE_SETTINGS


def test_the_new_config_has_the_users_mode_before_it_takes_the_old_ones_place(tmp_path: Path, monkeypatch) -> None:
    """A crash between the rename and a chmod after it left a 0644 config 0600 (root's, under
    sudo): the mode is set on the temp file, before the rename."""
    config = tmp_path / "settings.json"
    config.write_text(CLAUDE_SETTINGS)
    config.chmod(0o644)
    modes: list[int] = []
    real = os.replace

    def spy(src: Any, dst: Any) -> None:
        modes.append(stat.S_IMODE(os.stat(src).st_mode))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert claude_install(config)
    assert modes and modes[0] == 0o644
    assert stat.S_IMODE(config.stat().st_mode) == 0o644


# --- Kilo Code CLI: a provider in kilo.json ----------------------------------------------------

KILO = """{
  // my Kilo setup
  "$schema": "https://app.kilo.ai/config.json",
  "model": "anthropic/claude-sonnet",
  "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "http://localhost:11434/v1"}}}
}
"""


def kilo_install(config: Path, *, provider_id: str = "ocpc", model: str = "qwen") -> list[str]:
    from oc_prefix_cache.install import kilo_code

    return kilo_code.install(settings(), config_path=config, provider_id=provider_id, model=model)


def test_kilo_fresh_config_gets_the_provider_and_the_default_model_and_uninstall_removes_it(
    isolated_home: Path,
) -> None:
    config = isolated_home / "config" / "kilo" / "kilo.json"
    result = runner.invoke(app, ["install", "--harness", "kilo-code", "--model", "qwen"])
    assert result.exit_code == 0, result.output
    data = json.loads(config.read_text())
    assert data["provider"]["ocpc"]["options"]["baseURL"] == PROXY + "/v1" and data["model"] == "ocpc/qwen"
    assert kilo_install(config) == []  # idempotent
    uninstall(settings(), config_path=config, harness="kilo-code")
    assert not config.exists()


def test_kilo_existing_config_keeps_its_model_and_comments_and_comes_back_byte_for_byte(tmp_path: Path) -> None:
    config = tmp_path / "kilo.json"
    config.write_text(KILO)
    said = kilo_install(config)
    data = jsonc.loads(config.read_text())
    assert data["model"] == "anthropic/claude-sonnet" and set(data["provider"]) == {"ocpc", "ollama"}
    assert "// my Kilo setup" in config.read_text() and not any("default model" in line for line in said)
    with pytest.raises(InstallError, match="--provider-id"):
        kilo_install(config, provider_id="ollama")
    uninstall(settings(), config_path=config, harness="kilo-code")
    assert config.read_text() == KILO


def test_a_snippet_found_elsewhere_leaves_no_trailing_comma(tmp_path: Path) -> None:
    """install put the env block into an empty settings object (a snippet with no comma of
    its own); Claude Code re-serialised the file with a key before it. Cutting that snippet
    where it now is left `"theme": "dark",}`: JSONC, but JSON.parse (Claude Code, Cline, pi)
    refuses it. Such a snippet is taken out by its path instead."""
    config = tmp_path / "settings.json"
    config.write_text("{}\n")
    claude_install(config)
    data = jsonc.loads(config.read_text())
    config.write_text(json.dumps({"theme": "dark"} | data, indent=2))
    uninstall(settings(), config_path=config, harness="claude-code")
    assert json.loads(config.read_text()) == {"theme": "dark"}  # strict JSON, as Claude Code reads it
