"""`ocpc install` / `uninstall` on OpenCode configs: reversible, idempotent, comment-safe."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oc_prefix_cache import install as install_module
from oc_prefix_cache.cli import app
from oc_prefix_cache.commands import doctor
from oc_prefix_cache.install import (
    InstallError,
    PluginCopy,
    install,
    jsonc,
    normalise_base_url,
    packaged_plugin,
    plan_edits,
    plugin_version,
    uninstall,
)
from oc_prefix_cache.install import plugin as plugin_module
from oc_prefix_cache.settings import Settings
from tests.helpers import ROOT

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
    return install(
        Settings.from_env(), config_path=config, base_url=URL, provider_id="llamacpp", model="local", **kwargs
    )


def test_fresh_config_is_created_and_uninstall_removes_it(isolated_home: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    said = run_install(config)
    data = json.loads(config.read_text())
    plugin_url = data["plugin"][0]
    assert plugin_url.startswith("file://") and plugin_url.endswith("/plugin/ocpc-plugin.js")
    assert Path(plugin_url[len("file://") :]).is_file()
    settings_file = Path(plugin_url[len("file://") :]).with_name("ocpc-plugin.json")
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
    assert config.read_text() == JSONC.replace('llamacpp/qwen"', 'llamacpp/qwen-big"')


def test_broken_config_is_refused_untouched(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text('{"plugin": [')
    with pytest.raises(InstallError, match=r"is not valid JSON .*line 1.*fix it .*did not touch it"):
        run_install(config)
    assert config.read_text() == '{"plugin": ['


def test_keep_title_and_small_model_leave_titles_alone() -> None:
    assert not [
        e
        for e in plan_edits({}, plugin_url="file:///p.js", base_url=URL, provider_id="x", model="m", keep_title=True)
        if e.key == "agent"
    ]
    assert not [
        e
        for e in plan_edits(
            {"small_model": "x/y"},
            plugin_url="file:///p.js",
            base_url=URL,
            provider_id="x",
            model="m",
            keep_title=False,
        )
        if e.key == "agent"
    ]


def test_provider_id_clash_is_an_error() -> None:
    config = {"provider": {"llamacpp": {"options": {"baseURL": "http://elsewhere:1/v1"}}}}
    with pytest.raises(InstallError, match="--provider-id"):
        plan_edits(config, plugin_url="file:///p.js", base_url=URL, provider_id="llamacpp", model="m", keep_title=True)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8080", "http://localhost:8080/v1", "http://127.0.0.1:8080/v1/", "HTTP://LOCALHOST:8080/"]
)
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


# --- install defects (issue 9, item 9) ---------------------------------------------------


def test_symlinked_config_is_edited_behind_the_link_keeping_its_mode(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "opencode.json"
    real.parent.mkdir()
    real.write_text('{"theme": "dark"}\n')
    real.chmod(0o644)
    link = tmp_path / "opencode" / "opencode.json"
    link.parent.mkdir()
    link.symlink_to(real)
    run_install(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert "ocpc-plugin.js" in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o644
    uninstall(Settings.from_env(), config_path=link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == '{"theme": "dark"}\n'
    assert stat.S_IMODE(real.stat().st_mode) == 0o644


def test_symlinked_config_edited_since_keeps_link_and_mode_on_uninstall(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "opencode.json"
    real.parent.mkdir()
    real.write_text('{\n  "theme": "dark"\n}\n')
    real.chmod(0o640)
    link = tmp_path / "opencode.json"
    link.symlink_to(real)
    run_install(link)
    real.write_text(real.read_text().replace('"dark"', '"light"'))
    said = uninstall(Settings.from_env(), config_path=link)
    assert any("later edits are kept" in line for line in said)
    assert link.is_symlink() and jsonc.loads(real.read_text()) == {"theme": "light"}
    assert stat.S_IMODE(real.stat().st_mode) == 0o640


def test_uninstall_after_the_config_was_deleted_writes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text('{"theme": "dark"}\n')
    run_install(config)
    config.unlink()
    said = uninstall(Settings.from_env(), config_path=config)
    assert not config.exists()
    assert any("is gone" in line for line in said), said
    with pytest.raises(InstallError, match="no record"):
        uninstall(Settings.from_env(), config_path=config)


FAKE_NPM = """#!/bin/sh
# What `npm install` leaves for @opencode-ai/plugin, without the registry.
set -e
mkdir -p node_modules/@opencode-ai/plugin node_modules/@opencode-ai/sdk node_modules/zod/lib node_modules/.bin
echo '{"name": "@opencode-ai/plugin"}' > node_modules/@opencode-ai/plugin/package.json
echo 'export {}' > node_modules/@opencode-ai/plugin/index.js
echo '{"name": "@opencode-ai/sdk"}' > node_modules/@opencode-ai/sdk/package.json
echo 'module.exports = 1' > node_modules/zod/lib/index.js
ln -sf ../zod/lib/index.js node_modules/.bin/zod
echo '{"lockfileVersion": 3}' > node_modules/.package-lock.json
echo '{"lockfileVersion": 3, "packages": {}}' > package-lock.json
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `npm` first on PATH that writes what the real one does, offline."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    npm = folder / "npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return npm


def _npm_install(isolated_home: Path) -> Path:
    """A config folder holding a user's own package, then `ocpc install` with the SDK pre-install."""
    folder = isolated_home / "config" / "opencode"
    (folder / "node_modules" / "left-pad").mkdir(parents=True)
    (folder / "node_modules" / "left-pad" / "index.js").write_text("the user's own\n")
    config = folder / "opencode.json"
    said = run_install(config, opencode_version="1.18.33")
    assert any("pre-installed @opencode-ai/plugin" in line for line in said), said
    assert (folder / "node_modules" / "@opencode-ai" / "plugin" / "index.js").is_file()
    return config


def test_uninstall_removes_the_npm_files_install_created(isolated_home: Path, fake_npm: Path) -> None:
    config = _npm_install(isolated_home)
    folder = config.parent
    said = uninstall(Settings.from_env(), config_path=config)
    for gone in (
        "package.json",
        "package-lock.json",
        "node_modules/@opencode-ai",
        "node_modules/zod",
        "node_modules/.bin",
        "node_modules/.package-lock.json",
    ):
        assert not os.path.lexists(folder / gone), (gone, said)
    assert (folder / "node_modules" / "left-pad" / "index.js").read_text() == "the user's own\n"
    assert any("npm files" in line for line in said), said


def test_uninstall_keeps_npm_files_changed_since_install(isolated_home: Path, fake_npm: Path) -> None:
    config = _npm_install(isolated_home)
    folder = config.parent
    (folder / "node_modules" / "zod" / "lib" / "index.js").write_text("patched by the user\n")
    said = uninstall(Settings.from_env(), config_path=config)
    assert (folder / "node_modules" / "zod" / "lib" / "index.js").read_text() == "patched by the user\n"
    assert any("kept node_modules/zod" in line and "changed since install" in line for line in said), said
    assert not (folder / "node_modules" / "@opencode-ai").exists()
    assert not (folder / "package.json").exists()


def test_uninstall_keeps_all_npm_files_when_npm_ran_again(isolated_home: Path, fake_npm: Path) -> None:
    config = _npm_install(isolated_home)
    folder = config.parent
    lock = folder / "package-lock.json"
    lock.write_text(lock.read_text().replace("{}", '{"node_modules/zod": {}}'))
    said = uninstall(Settings.from_env(), config_path=config)
    assert (folder / "node_modules" / "@opencode-ai" / "plugin" / "index.js").is_file()
    assert (folder / "package.json").is_file() and lock.is_file()
    assert any("package-lock.json changed since install" in line for line in said), said


def test_npm_files_that_were_there_before_are_never_recorded(isolated_home: Path, fake_npm: Path) -> None:
    config = _npm_install(isolated_home)
    record = json.loads((isolated_home.parent / "ocpc" / "install.json").read_text())[str(config)]
    paths = {entry["path"]: entry for entry in record["npm_created"]}
    assert "node_modules/left-pad" not in paths and "node_modules" not in paths
    assert paths["node_modules/@opencode-ai/plugin"]["sha256"] and paths["package.json"]["sha256"]


# --- the plugin this ocpc installs, and the installed copy (issue 12, item 1) -------------

REPO_PLUGIN = ROOT / "plugin-js" / "ocpc-plugin.js"


def _plugin(version: str | None) -> bytes:
    mark = f'const OCPC_PLUGIN_VERSION = "{version}";\n' if version else ""
    return f"// ocpc plugin\n{mark}export const OcPrefixCache = async () => ({{}});\n".encode()


@pytest.fixture
def package_plugin(monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    """Make this ocpc's own plugin a given version (the real one may not carry a mark yet)."""

    def use(version: str | None) -> None:
        copy = PluginCopy("test", _plugin(version))
        monkeypatch.setattr(plugin_module, "packaged_plugin", lambda: copy)  # what install and doctor call
        monkeypatch.setattr(install_module, "packaged_plugin", lambda: copy)  # what `ocpc --version` imports

    return use


def test_from_a_checkout_the_plugin_is_plugin_js_itself() -> None:
    plugin = packaged_plugin()
    assert plugin.data == REPO_PLUGIN.read_bytes()
    assert plugin.version == plugin_version(REPO_PLUGIN.read_bytes())


def test_plugin_version_is_read_from_its_mark_and_may_be_absent() -> None:
    assert plugin_version(_plugin("1.4.2")) == "1.4.2"
    assert plugin_version(_plugin(None)) is None


def test_version_prints_the_package_and_the_plugin_it_installs(package_plugin) -> None:
    from oc_prefix_cache import __version__

    package_plugin("0.3.0")
    assert runner.invoke(app, ["--version"]).stdout.strip() == f"ocpc {__version__}, plugin 0.3.0"
    package_plugin(None)
    assert runner.invoke(app, ["--version"]).stdout.strip() == f"ocpc {__version__}, plugin (no version mark)"


def _installed_then(isolated_home: Path, installed: bytes | None) -> Path:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    run_install(config)
    copy = Path(jsonc.loads(config.read_text())["plugin"][0][len("file://") :])
    if installed is None:
        copy.unlink()
    else:
        copy.write_bytes(installed)
    return config


def test_doctor_says_when_the_installed_plugin_is_older(isolated_home: Path, package_plugin) -> None:
    package_plugin("0.3.0")
    config = _installed_then(isolated_home, _plugin("0.2.9"))
    check = doctor._opencode(Settings.from_env(), config)
    assert check.status == "warn" and "0.2.9, older than this ocpc's 0.3.0" in check.detail, check
    assert check.fix and "ocpc install" in check.fix
    run_install(config)
    assert doctor._opencode(Settings.from_env(), config).status == "ok"


def test_doctor_says_when_the_installed_plugin_differs_without_versions(isolated_home: Path, package_plugin) -> None:
    package_plugin(None)
    config = _installed_then(isolated_home, _plugin(None) + b"// an old build\n")
    check = doctor._opencode(Settings.from_env(), config)
    assert check.status == "warn" and "differs from this ocpc's copy" in check.detail, check


def test_doctor_fails_when_the_installed_plugin_is_gone(isolated_home: Path, package_plugin) -> None:
    package_plugin("0.3.0")
    config = _installed_then(isolated_home, None)
    check = doctor._opencode(Settings.from_env(), config)
    assert check.status == "fail" and "is missing" in check.detail and "ocpc install" in (check.fix or ""), check


def test_doctor_checks_the_plugin_file_the_config_names(isolated_home: Path, tmp_path: Path, package_plugin) -> None:
    package_plugin("0.3.0")
    config = _installed_then(isolated_home, _plugin("0.3.0"))
    elsewhere = tmp_path / "other home" / "ocpc-plugin.js"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(_plugin("0.1.0"))
    url = jsonc.loads(config.read_text())["plugin"][0]
    config.write_text(config.read_text().replace(url, elsewhere.as_uri()))
    check = doctor._opencode(Settings.from_env(), config)
    assert check.status == "warn" and str(elsewhere) in check.detail and "0.1.0" in check.detail, check


def test_npm_files_are_recorded_even_when_the_config_needed_no_edit(isolated_home: Path, fake_npm: Path) -> None:
    config = isolated_home / "config" / "opencode" / "opencode.json"
    run_install(config)  # no npm yet: opencode unknown
    (isolated_home.parent / "ocpc" / "install.json").unlink()  # as if wired by hand: no record
    text = config.read_text()
    assert any("pre-installed" in line for line in run_install(config, opencode_version="1.18.33"))
    said = uninstall(Settings.from_env(), config_path=config)
    assert config.read_text() == text  # the config was never ours to change
    assert not (config.parent / "node_modules").exists() and not (config.parent / "package.json").exists()
    assert any("npm files" in line for line in said), said


def test_dry_run_writes_nothing_and_shows_the_diff(isolated_home: Path, tmp_path: Path) -> None:
    """`ocpc install --dry-run`: no plugin copy, no config, no backup, no record, no npm run;
    the lines and the unified diff of what install would write."""
    config = tmp_path / "opencode.json"
    config.write_text('{\n  "theme": "dark"\n}\n')
    result = runner.invoke(
        app, ["install", "--config", str(config), "--dry-run", "--opencode-version", "1.18.33", "--base-url", URL]
    )
    assert result.exit_code == 0, result.output
    assert (
        "would have copied the plugin" in result.output
        and "would pre-install @opencode-ai/plugin@1.18.33" in result.output
    )
    assert '+  "plugin": [' in result.output and "wrote nothing" in result.output
    assert config.read_text() == '{\n  "theme": "dark"\n}\n' and sorted(p.name for p in tmp_path.iterdir()) == [
        "home",
        "opencode.json",
    ]
    assert not Settings.from_env().home.exists() or not any(Settings.from_env().home.iterdir())
