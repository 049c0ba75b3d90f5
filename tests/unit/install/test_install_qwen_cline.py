"""`ocpc install --harness qwen-code|cline`: two JSON configs that the agents rewrite themselves.

Qwen Code migrates a settings file without ``$version`` and re-formats what it touches; Cline
re-serialises its providers.json on every run, stamping a new ``updatedAt`` on the provider
it used. The rewrites here are the ones seen from the real binaries (0.24.4, 3.0.65): after
them, uninstall still takes out exactly ocpc's entries and puts the user's back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.install import InstallError, cline, jsonc, qwen_code, uninstall
from oc_prefix_cache.settings import Settings

runner = CliRunner()
PROXY = "http://127.0.0.1:8766"


def settings() -> Settings:
    return Settings.from_env()


@pytest.fixture(autouse=True)
def _agents_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CLINE_DIR", "CLINE_DATA_DIR", "CLINE_PROVIDER_SETTINGS_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OC_PREFIX_CACHE_BASE_URL", "http://127.0.0.1:8080")


# --- Qwen Code: ~/.qwen/settings.json -------------------------------------------------------

QWEN = """{
  // my Qwen Code settings
  "$version": 4,
  "ui": {"theme": "GitHub"},
  "modelProviders": {
    "openai": [
      {"id": "qwen3-coder-plus", "baseUrl": "https://dashscope.example/v1", "envKey": "DASHSCOPE_API_KEY"}
    ]
  },
  "security": {"auth": {"selectedType": "qwen-oauth"}},
  "model": {"name": "qwen3-coder-plus"}
}
"""


def test_qwen_fresh_settings_are_created_selected_and_removed(isolated_home: Path) -> None:
    config = isolated_home / ".qwen" / "settings.json"
    said = qwen_code.install(settings(), config_path=config, model="qwen")
    data = json.loads(config.read_text())
    assert data == {
        "$version": 4,
        "model": {"name": "qwen", "baseUrl": PROXY + "/v1"},
        "security": {"auth": {"selectedType": "openai"}},
        "env": {"OCPC_API_KEY": "ocpc-local"},
        "modelProviders": {
            "openai": [
                {
                    "id": "qwen",
                    "name": "qwen (llama-server through the ocpc proxy)",
                    "baseUrl": PROXY + "/v1",
                    "envKey": "OCPC_API_KEY",
                }
            ]
        },
    }
    assert any("ocpc proxy" in line for line in said), said
    assert qwen_code.install(settings(), config_path=config, model="qwen") == []
    uninstall(settings(), config_path=config, harness="qwen-code")
    assert not config.exists()


def test_qwen_existing_settings_say_what_they_replace_and_come_back_byte_for_byte(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(QWEN)
    said = qwen_code.install(settings(), config_path=config)
    data = jsonc.loads(config.read_text())
    assert [m["id"] for m in data["modelProviders"]["openai"]] == ["local", "qwen3-coder-plus"]  # first wins
    assert data["security"]["auth"]["selectedType"] == "openai" and data["model"]["name"] == "local"
    assert data["ui"] == {"theme": "GitHub"} and "// my Qwen Code settings" in config.read_text()
    replaced = [line for line in said if line.startswith("replaced your")]
    assert any("security.auth.selectedType: 'qwen-oauth'" in line for line in replaced), said
    assert any("model.name: 'qwen3-coder-plus'" in line for line in replaced), said
    assert "$version" not in json.dumps([line for line in said])  # an existing file keeps its own version
    uninstall(settings(), config_path=config, harness="qwen-code")
    assert config.read_text() == QWEN


def test_qwen_migrated_and_reformatted_by_qwen_code_loses_exactly_ocpcs_entries(tmp_path: Path) -> None:
    """Qwen Code 0.24.4 wrote `$version` into a file without it and re-formatted `model`, on
    its first run; uninstall then finds ocpc's entries by their path."""
    config = tmp_path / "settings.json"
    original = '{\n  "ui": {"theme": "GitHub"}\n}\n'
    config.write_text(original)
    qwen_code.install(settings(), config_path=config)
    data = jsonc.loads(config.read_text())
    data["$version"] = 4
    config.write_text(json.dumps(data, indent=2) + "\n")
    said = uninstall(settings(), config_path=config, harness="qwen-code")
    assert json.loads(config.read_text()) == {"ui": {"theme": "GitHub"}, "$version": 4}, said


def test_qwen_model_the_user_added_beside_ocpcs_is_kept_and_said(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(QWEN)
    qwen_code.install(settings(), config_path=config)
    data = jsonc.loads(config.read_text())
    data["model"]["name"] = "qwen3-coder-plus"  # the user switched back with /model
    config.write_text(json.dumps(data, indent=2))
    said = uninstall(settings(), config_path=config, harness="qwen-code")
    back = json.loads(config.read_text())
    assert back["model"] == {"name": "qwen3-coder-plus"} and back["security"]["auth"]["selectedType"] == "qwen-oauth"
    assert [m["id"] for m in back["modelProviders"]["openai"]] == ["qwen3-coder-plus"] and "env" not in back, said


def test_qwen_model_providers_not_a_list_and_malformed_settings_are_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    for original, error in (
        ('{"modelProviders": {"openai": {"id": "x"}}}', "not a list of models"),
        ('{"model": {"name": "x"},', "is not valid JSON"),
    ):
        config.write_text(original)
        with pytest.raises(InstallError, match=error):
            qwen_code.install(settings(), config_path=config)
        assert config.read_text() == original


# --- Cline: providers.json --------------------------------------------------------------------


def cline_rewrites(config: Path, *, stamp: str = "2031-01-01T00:00:00.000Z") -> None:
    """What Cline 3.0.65 does to the file on a run: `modes` added, the used provider's
    `updatedAt` refreshed, the whole re-serialised by JSON.stringify(_, null, 2)."""
    data: dict[str, Any] = jsonc.loads(config.read_text())
    ordered = {
        "version": data["version"],
        "lastUsedProvider": data.get("lastUsedProvider"),
        "modes": data.get("modes", {}),
        "providers": data["providers"],
    }
    used = ordered["providers"].get(ordered["lastUsedProvider"])
    if used is not None:
        used["updatedAt"] = stamp
    config.write_text(json.dumps({k: v for k, v in ordered.items() if v is not None}, indent=2))


ANTHROPIC = {
    "settings": {"provider": "anthropic", "apiKey": "sk-ant-secret", "model": "claude-sonnet-4"},
    "updatedAt": "2026-01-02T03:04:05.000Z",
    "tokenSource": "manual",
}


def test_cline_fresh_providers_json_has_clines_shape_and_goes_after_cline_rewrote_it(isolated_home: Path) -> None:
    config = isolated_home / ".cline" / "data" / "settings" / "providers.json"
    said = cline.install(settings(), config_path=config, model="qwen")
    data = json.loads(config.read_text())
    entry = data["providers"]["openai-compatible"]
    assert data["version"] == 1 and data["lastUsedProvider"] == "openai-compatible" and data["modes"] == {}
    assert entry["settings"] == {
        "provider": "openai-compatible",
        "apiKey": "ocpc-local",
        "model": "qwen",
        "baseUrl": PROXY + "/v1",
    }
    assert entry["tokenSource"] == "manual" and entry["updatedAt"].endswith("Z")  # as Cline's schema wants
    assert any("ocpc proxy" in line for line in said), said
    cline_rewrites(config)
    assert cline.install(settings(), config_path=config, model="qwen") == []  # still ours: nothing to do
    said = uninstall(settings(), config_path=config, harness="cline")
    assert not config.exists(), (said, config.read_text() if config.exists() else None)


def test_cline_users_provider_and_choice_are_replaced_said_and_put_back(tmp_path: Path) -> None:
    config = tmp_path / "providers.json"
    original = json.dumps(
        {
            "version": 1,
            "lastUsedProvider": "anthropic",
            "modes": {},
            "providers": {
                "anthropic": ANTHROPIC,
                "openai-compatible": {
                    "settings": {
                        "provider": "openai-compatible",
                        "apiKey": "sk-ollama",
                        "model": "llama3",
                        "baseUrl": "http://localhost:11434/v1",
                    },
                    "updatedAt": "2026-01-02T03:04:05.000Z",
                    "tokenSource": "manual",
                },
            },
        },
        indent=2,
    )
    config.write_text(original)
    said = cline.install(settings(), config_path=config)
    replaced = [line for line in said if line.startswith("replaced your")]
    assert len(replaced) == 2 and "model 'llama3' at http://localhost:11434/v1" in replaced[0], said
    assert "'anthropic'" in replaced[1] and not any("sk-ollama" in line for line in said), said
    uninstall(settings(), config_path=config, harness="cline")
    assert config.read_text() == original


def test_cline_rewritten_by_cline_since_gets_the_users_entries_back(tmp_path: Path) -> None:
    config = tmp_path / "providers.json"
    original = {"version": 1, "lastUsedProvider": "anthropic", "modes": {}, "providers": {"anthropic": ANTHROPIC}}
    config.write_text(json.dumps(original, indent=2))
    cline.install(settings(), config_path=config)
    cline_rewrites(config)
    said = uninstall(settings(), config_path=config, harness="cline")
    assert json.loads(config.read_text()) == original, said


def test_cline_provider_the_user_repointed_since_is_kept_and_said(tmp_path: Path) -> None:
    config = tmp_path / "providers.json"
    cline.install(settings(), config_path=config)
    data = json.loads(config.read_text())
    data["providers"]["openai-compatible"]["settings"]["baseUrl"] = "http://10.0.0.5:8080/v1"
    config.write_text(json.dumps(data, indent=2))
    said = uninstall(settings(), config_path=config, harness="cline")
    assert json.loads(config.read_text())["providers"]["openai-compatible"]["settings"]["baseUrl"].startswith(
        "http://10."
    )
    assert any("kept providers.openai-compatible: you changed it since install" in line for line in said), said


def test_cline_unknown_version_and_malformed_files_are_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "providers.json"
    for original, error in (('{"version": 2, "providers": {}}', "version 2"), ('{"version": 1,', "is not valid JSON")):
        config.write_text(original)
        with pytest.raises(InstallError, match=error):
            cline.install(settings(), config_path=config)
        assert config.read_text() == original


def test_cli_cline_follows_clines_own_variables(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLINE_DIR", str(tmp_path / "cline-dir"))
    result = runner.invoke(app, ["install", "--harness", "cline", "--model", "qwen"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cline-dir" / "data" / "settings" / "providers.json").is_file()
    monkeypatch.setenv("CLINE_DATA_DIR", str(tmp_path / "data-dir"))
    assert runner.invoke(app, ["install", "--harness", "cline", "--dry-run"]).exit_code == 0
    assert not (tmp_path / "data-dir").exists()  # a dry run writes nothing
    assert runner.invoke(app, ["install", "--harness", "cline", "--project"]).exit_code == 1
    monkeypatch.delenv("CLINE_DATA_DIR")
    assert runner.invoke(app, ["uninstall", "--harness", "cline"]).exit_code == 0
    assert not (tmp_path / "cline-dir" / "data" / "settings" / "providers.json").exists()
