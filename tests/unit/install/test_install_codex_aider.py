"""`ocpc install --harness codex|aider`: a TOML and a YAML config, with the round trips every
install keeps.

Install then uninstall gives the user's bytes back (also when ocpc created the file); a
setting of the user's that install replaces is said and put back; a file the user edited
since loses exactly ocpc's entries; a malformed file, or one ocpc cannot edit without
changing what the rest of it means, is refused with a clear error and left untouched.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.install import InstallError, aider, codex, uninstall
from oc_prefix_cache.settings import Settings

runner = CliRunner()
PROXY = "http://127.0.0.1:8766"


def settings() -> Settings:
    return Settings.from_env()


def codex_install(config: Path, *, provider_id: str = "ocpc", model: str | None = None) -> list[str]:
    return codex.install(settings(), config_path=config, provider_id=provider_id, model=model)


def aider_install(config: Path, *, model: str | None = None) -> list[str]:
    return aider.install(settings(), config_path=config, model=model)


@pytest.fixture(autouse=True)
def _agents_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CODEX_HOME", "OPENAI_API_BASE", "AIDER_MODEL", "AIDER_OPENAI_API_BASE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OC_PREFIX_CACHE_BASE_URL", "http://127.0.0.1:8080")  # no server discovery here


# --- Codex: config.toml ----------------------------------------------------------------------

CODEX = """# my Codex setup
model = "gpt-5-codex"  # the one I pay for
model_provider = "openai"
approval_policy = "on-request"

[profiles.fast]
model = "gpt-5-mini"

[model_providers.ollama]
name = "Ollama"
base_url = "http://localhost:11434/v1"

[mcp_servers.docs]
command = "npx"
args = ["-y", "docs-mcp"]
"""


def test_codex_fresh_config_is_created_selected_and_removed(isolated_home: Path) -> None:
    config = isolated_home / ".codex" / "config.toml"
    said = codex_install(config)
    data = tomllib.loads(config.read_text())
    assert data == {
        "model_provider": "ocpc",
        "model": "local",
        "model_providers": {
            "ocpc": {
                "name": "ocpc (llama-server through the ocpc proxy)",
                "base_url": PROXY + "/v1",
                "wire_api": "responses",
            }
        },
    }
    assert any("codex" in line and "ocpc proxy" in line for line in said), said
    assert codex_install(config) == []  # idempotent
    assert any("removed" in line for line in uninstall(settings(), config_path=config, harness="codex"))
    assert not config.exists()


def test_codex_existing_config_keeps_its_text_and_comes_back_byte_for_byte(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CODEX)
    said = codex_install(config)
    text = config.read_text()
    data = tomllib.loads(text)
    assert data["model_provider"] == "ocpc" and data["model"] == "gpt-5-codex"  # the user's model is kept...
    assert any("kept your model = 'gpt-5-codex'" in line and "--model" in line for line in said), said  # ...and said
    replaced = [line for line in said if line.startswith("replaced your model_provider = 'openai'")]
    assert replaced and "uninstall" in replaced[0], said
    assert set(data["model_providers"]) == {"ollama", "ocpc"} and data["mcp_servers"]["docs"]["args"] == [
        "-y",
        "docs-mcp",
    ]
    assert "# my Codex setup" in text and "# the one I pay for" in text
    assert text.startswith(CODEX.split("[profiles.fast]")[0].replace('"openai"', '"ocpc"'))  # in place, nothing moved
    uninstall(settings(), config_path=config, harness="codex")
    assert config.read_text() == CODEX


def test_codex_model_is_replaced_when_asked_and_put_back(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CODEX)
    said = codex_install(config, model="qwen3.5")
    assert tomllib.loads(config.read_text())["model"] == "qwen3.5"
    assert any(line.startswith("replaced your model = 'gpt-5-codex'") for line in said), said
    assert '"qwen3.5"  # the one I pay for' in config.read_text()  # the user's comment stays on its line
    uninstall(settings(), config_path=config, harness="codex")
    assert config.read_text() == CODEX


def test_codex_edited_since_loses_exactly_ocpcs_entries(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CODEX)
    codex_install(config, model="qwen3.5")
    config.write_text(config.read_text().replace('approval_policy = "on-request"', 'approval_policy = "never"'))
    said = uninstall(settings(), config_path=config, harness="codex")
    assert config.read_text() == CODEX.replace('"on-request"', '"never"')
    assert any("later edits are kept" in line for line in said), said


def test_codex_value_the_user_changed_since_is_kept_and_said(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CODEX)
    codex_install(config)
    config.write_text(config.read_text().replace('model_provider = "ocpc"', 'model_provider = "ollama"'))
    said = uninstall(settings(), config_path=config, harness="codex")
    data = tomllib.loads(config.read_text())
    assert data["model_provider"] == "ollama" and "ocpc" not in data["model_providers"]
    assert any("kept model_provider: you changed it since install" in line for line in said), said


def test_codex_provider_id_pointing_elsewhere_is_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CODEX)
    with pytest.raises(InstallError, match="'ollama' exists and points at http://localhost:11434/v1.*--provider-id"):
        codex_install(config, provider_id="ollama")
    assert config.read_text() == CODEX


def test_codex_malformed_config_is_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('model = "o3"\n[model_providers.x\nname = "x"\n')
    with pytest.raises(InstallError, match=r"is not valid TOML \(.*line 2.*\); fix it .*did not touch it"):
        codex_install(config)
    assert config.read_text() == 'model = "o3"\n[model_providers.x\nname = "x"\n'
    assert not (Settings.from_env().home / "install.json").exists()


def test_codex_dotted_keys_tomlkit_would_misplace_are_refused_untouched(tmp_path: Path) -> None:
    """tomlkit nests a table added beside dotted keys wrongly (the top-level keys end up in
    it): the check against tomllib catches that, and nothing is written."""
    config = tmp_path / "config.toml"
    original = 'model_providers.ollama.name = "Ollama"\nmodel_providers.ollama.base_url = "http://x/v1"\n'
    config.write_text(original)
    with pytest.raises(InstallError, match="without changing what the rest of it means.*by hand.*model_provider"):
        codex_install(config)
    assert config.read_text() == original


def test_codex_inline_providers_get_an_inline_entry(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    original = 'model_providers = { ollama = { name = "O", base_url = "http://x/v1" } }\n'
    config.write_text(original)
    codex_install(config)
    data = tomllib.loads(config.read_text())
    assert data["model_providers"]["ocpc"]["wire_api"] == "responses" and data["model_provider"] == "ocpc"
    uninstall(settings(), config_path=config, harness="codex")
    assert config.read_text() == original


def test_codex_an_active_profile_with_its_own_provider_is_said(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('profile = "work"\n\n[profiles.work]\nmodel_provider = "azure"\n')
    said = codex_install(config)
    assert any("profile 'work' sets model_provider = 'azure'" in line for line in said), said


def test_cli_codex_uses_codex_home_dry_run_and_json(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex-home"))
    monkeypatch.setenv("OC_PREFIX_CACHE_PROXY_PORT", "9777")
    config = tmp_path / "codex-home" / "config.toml"
    dry = runner.invoke(app, ["install", "--harness", "codex", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "proxy: http://127.0.0.1:9777 (OC_PREFIX_CACHE_PROXY_PORT=9777)" in dry.output
    assert '+base_url = "http://127.0.0.1:9777/v1"' in dry.output and "wrote nothing" in dry.output
    assert not config.exists() and not (Settings.from_env().home / "install.json").exists()
    done = runner.invoke(app, ["install", "--harness", "codex", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["config"] == str(config) and report["proxy_url"] == "http://127.0.0.1:9777"
    assert report["changed"] and not report["dry_run"] and report["diff"].startswith("--- /dev/null")
    assert tomllib.loads(config.read_text())["model_providers"]["ocpc"]["base_url"] == "http://127.0.0.1:9777/v1"
    assert runner.invoke(app, ["install", "--harness", "codex", "--project"]).exit_code == 1
    assert runner.invoke(app, ["uninstall", "--harness", "codex"]).exit_code == 0 and not config.exists()


# --- Aider: .aider.conf.yml -------------------------------------------------------------------

SAMPLE = """##########################################################
# Sample .aider.conf.yml
# Place in your home dir, or at the root of your git repo.
##########################################################

## Specify the model to use for the main chat
#model: xxx

## Specify the OpenAI API key
#openai-api-key: xxx
"""

MINE = """# my aider settings
model: sonnet   # the default I use
dark-mode: true
read:
  - CONVENTIONS.md
"""


def test_aider_fresh_config_is_created_and_removed(isolated_home: Path) -> None:
    config = isolated_home / ".aider.conf.yml"
    said = aider_install(config)
    assert yaml.safe_load(config.read_text()) == {
        "model": "openai/local",
        "openai-api-base": PROXY + "/v1",
        "openai-api-key": "ocpc-local",
    }
    assert any("ocpc proxy" in line for line in said), said
    assert aider_install(config) == []
    uninstall(settings(), config_path=config, harness="aider")
    assert not config.exists()


def test_aider_sample_file_of_comments_keeps_every_line_and_comes_back(tmp_path: Path) -> None:
    """Aider's sample config is all comments: YAML reads it as nothing, and a round-trip loader
    would write the comments away; the entries are added after them instead."""
    config = tmp_path / ".aider.conf.yml"
    config.write_text(SAMPLE)
    aider_install(config, model="qwen")
    text = config.read_text()
    assert text.startswith(SAMPLE) and yaml.safe_load(text)["model"] == "openai/qwen"
    uninstall(settings(), config_path=config, harness="aider")
    assert config.read_text() == SAMPLE


def test_aider_users_model_is_replaced_in_place_said_and_put_back(tmp_path: Path) -> None:
    config = tmp_path / ".aider.conf.yml"
    config.write_text(MINE)
    said = aider_install(config)
    text = config.read_text()
    assert "model: openai/local   # the default I use\n" in text  # in its own span: the comment stays
    assert yaml.safe_load(text)["read"] == ["CONVENTIONS.md"]
    assert any(line.startswith("replaced your model: 'sonnet' with 'openai/local'") for line in said), said
    uninstall(settings(), config_path=config, harness="aider")
    assert config.read_text() == MINE


def test_aider_edited_since_loses_exactly_ocpcs_lines(tmp_path: Path) -> None:
    config = tmp_path / ".aider.conf.yml"
    config.write_text(MINE)
    aider_install(config)
    config.write_text(config.read_text().replace("dark-mode: true", "dark-mode: false\nauto-commits: false"))
    said = uninstall(settings(), config_path=config, harness="aider")
    assert config.read_text() == MINE.replace("dark-mode: true", "dark-mode: false\nauto-commits: false")
    assert any("later edits are kept" in line for line in said), said


def test_aider_an_entry_the_user_changed_since_is_kept_and_said(tmp_path: Path) -> None:
    config = tmp_path / ".aider.conf.yml"
    config.write_text(MINE)
    aider_install(config)
    config.write_text(
        config.read_text().replace(
            "openai-api-base: http://127.0.0.1:8766/v1", "openai-api-base: http://127.0.0.1:9999/v1"
        )
    )
    said = uninstall(settings(), config_path=config, harness="aider")
    data = yaml.safe_load(config.read_text())
    assert data["model"] == "sonnet" and data["openai-api-base"] == "http://127.0.0.1:9999/v1"
    assert "openai-api-key" not in data
    assert any("kept openai-api-base" in line for line in said), said


def test_aider_users_own_key_is_kept(tmp_path: Path) -> None:
    config = tmp_path / ".aider.conf.yml"
    config.write_text("openai-api-key: sk-mine\n")
    aider_install(config)
    assert yaml.safe_load(config.read_text())["openai-api-key"] == "sk-mine"


@pytest.mark.parametrize(
    "original, error",
    [
        ("model: [unclosed\n", r"is not valid YAML \(.*line 1"),
        ("{model: sonnet}\n", "not a block mapping"),
        ("- model\n- sonnet\n", "is a YAML list, not a mapping"),
        ("model:\n  name: x\n", "'model' is not a single value"),
    ],
)
def test_aider_configs_it_cannot_edit_are_refused_untouched(tmp_path: Path, original: str, error: str) -> None:
    config = tmp_path / ".aider.conf.yml"
    config.write_text(original)
    with pytest.raises(InstallError, match=error):
        aider_install(config)
    assert config.read_text() == original
    assert not (Settings.from_env().home / "install.json").exists()


def test_aider_plain_scalars_only_when_yaml_reads_them_back() -> None:
    assert aider.plan_edits({}, proxy_url=PROXY, model="yes")[0].value == "openai/yes"
    from oc_prefix_cache.install.yaml_format import scalar

    assert scalar("openai/local") == "openai/local" and scalar("yes") == '"yes"' and scalar("a #b") == '"a #b"'
    assert scalar("http://127.0.0.1:8766/v1") == "http://127.0.0.1:8766/v1"


def test_cli_aider_project_and_the_environment_that_wins(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_BASE", "http://elsewhere/v1")
    result = runner.invoke(app, ["install", "--harness", "aider", "--project", "--model", "qwen"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / ".aider.conf.yml").read_text())["model"] == "openai/qwen"
    assert "your environment sets OPENAI_API_BASE" in result.output
    refused = runner.invoke(app, ["install", "--harness", "aider", "--provider-id", "x"])
    assert refused.exit_code == 1 and "drop --provider-id" in refused.output
    assert runner.invoke(app, ["uninstall", "--harness", "aider", "--project"]).exit_code == 0
    assert not (tmp_path / ".aider.conf.yml").exists()
