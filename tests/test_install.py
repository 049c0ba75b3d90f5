"""`ocpc install` / `uninstall` on OpenCode configs: reversible, idempotent, comment-safe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oc_prefix_cache import jsonc
from oc_prefix_cache.cli import app
from oc_prefix_cache.install import (
    InstallError,
    install,
    normalise_base_url,
    plan_edits,
    uninstall,
)
from oc_prefix_cache.settings import Settings

URL = "http://127.0.0.1:8080"
runner = CliRunner()

JSONC = """// my OpenCode config
{
  /* the model I use */
  "model": "llamacpp/qwen",
  "provider": {
    "llamacpp": {
      "npm": "@ai-sdk/openai-compatible",
      "options": { "baseURL": "http://localhost:8080/v1/" }, // trailing slash on purpose
      "models": { "qwen": {} },
    },
  },
  "plugin": ["some-other-plugin"],
}
"""


def run_install(config: Path, **kwargs) -> list[str]:
    return install(Settings.from_env(), config_path=config, base_url=URL, provider_id="llamacpp",
                   model="local", **kwargs)


def test_fresh_config_is_created_and_uninstall_removes_it(isolated_home: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    said = run_install(config)
    data = json.loads(config.read_text())
    plugin_url = data["plugin"][0]
    assert plugin_url.startswith("file://") and plugin_url.endswith("/plugin/ocpc-plugin.js")
    assert Path(plugin_url[len("file://"):]).is_file()
    settings_file = Path(plugin_url[len("file://"):]).with_name("ocpc-plugin.json")
    assert json.loads(settings_file.read_text())["baseURL"] == URL
    assert data["provider"]["llamacpp"]["options"]["baseURL"] == URL + "/v1"
    assert data["agent"] == {"title": {"disable": True}}
    assert any("title" in line for line in said)
    assert run_install(config) == []  # idempotent: nothing to change the second time
    uninstall(Settings.from_env(), config_path=config)
    assert not config.exists()


def test_jsonc_keeps_comments_and_matching_provider_and_restores_byte_exact(tmp_path: Path) -> None:
    config = tmp_path / "opencode.jsonc"
    config.write_text(JSONC)
    said = run_install(config)
    text = config.read_text()
    assert "// trailing slash on purpose" in text and "/* the model I use */" in text
    data = jsonc.loads(text)
    assert data["plugin"][1] == "some-other-plugin" and data["plugin"][0].endswith("ocpc-plugin.js")
    assert list(data["provider"]) == ["llamacpp"]  # the user's provider matched: none added
    assert not any("provider" in line for line in said)
    uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == JSONC


def test_user_edits_after_install_survive_uninstall(tmp_path: Path) -> None:
    config = tmp_path / "opencode.jsonc"
    config.write_text(JSONC)
    run_install(config)
    edited = config.read_text().replace('"model": "llamacpp/qwen"', '"model": "llamacpp/qwen-big"')
    config.write_text(edited)
    uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == JSONC.replace("llamacpp/qwen\"", "llamacpp/qwen-big\"")


def test_broken_config_is_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text('{"plugin": [')
    with pytest.raises(jsonc.JsoncError):
        run_install(config)
    assert config.read_text() == '{"plugin": ['


def test_keep_title_and_small_model_leave_titles_alone() -> None:
    assert not [e for e in plan_edits({}, plugin_url="file:///p.js", base_url=URL, provider_id="x", model="m",
                                      keep_title=True) if e.key == "agent"]
    assert not [e for e in plan_edits({"small_model": "x/y"}, plugin_url="file:///p.js", base_url=URL,
                                      provider_id="x", model="m", keep_title=False) if e.key == "agent"]


def test_provider_id_clash_is_an_error() -> None:
    config = {"provider": {"llamacpp": {"options": {"baseURL": "http://elsewhere:1/v1"}}}}
    with pytest.raises(InstallError, match="--provider-id"):
        plan_edits(config, plugin_url="file:///p.js", base_url=URL, provider_id="llamacpp", model="m",
                   keep_title=True)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://localhost:8080/v1", "http://127.0.0.1:8080/v1/",
                                 "HTTP://LOCALHOST:8080/"])
def test_base_urls_normalise_to_one(url: str) -> None:
    assert normalise_base_url(url) == URL


def test_cli_install_prints_changes_and_uninstall_restores(isolated_home: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('{"theme": "dark"}\n')
    first = runner.invoke(app, ["install", "--base-url", URL])
    assert first.exit_code == 0, first.output
    assert "added the plugin" in first.output
    second = runner.invoke(app, ["install", "--base-url", URL])
    assert "nothing to change" in second.output
    back = runner.invoke(app, ["uninstall"])
    assert back.exit_code == 0 and "restored" in back.output
    assert config.read_text() == '{"theme": "dark"}\n'
    again = runner.invoke(app, ["uninstall"])
    assert again.exit_code == 1 and "no record" in again.output


def test_uninstall_refuses_rather_than_write_invalid_json(isolated_home: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    run_install(config)
    text = config.read_text()
    edited = text.rstrip().rstrip("}") + ',\n  "theme": "dark"\n}\n'
    config.write_text(edited)
    with pytest.raises(InstallError, match="restore it by hand"):
        uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == edited  # untouched


def test_reinstall_after_user_edits_keeps_them_on_uninstall(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text('{\n  "theme": "dark"\n}\n')
    run_install(config)
    data = jsonc.loads(config.read_text())
    edited = config.read_text().replace('"theme": "dark"', '"theme": "dark",\n  "model": "llamacpp/big"')
    edited = edited.replace('"agent": {\n    "title": {\n      "disable": true\n    }\n  },', "")
    config.write_text(edited)
    assert "agent" not in jsonc.loads(edited) and data["agent"]
    run_install(config)  # puts agent.title back
    uninstall(Settings.from_env(), config_path=config)
    final = jsonc.loads(config.read_text())
    assert final == {"theme": "dark", "model": "llamacpp/big"}


def test_only_the_host_localhost_is_rewritten() -> None:
    assert normalise_base_url("http://mylocalhost.example:8080/v1") == "http://mylocalhost.example:8080"
