"""The CLI's edges: exit codes, one-line errors, JSON on stdout."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from oc_prefix_cache import __version__
from oc_prefix_cache.cli import app

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip().startswith(f"ocpc {__version__}, plugin ")


def test_rig_info_json_names_the_server_source(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 9999 (test)' >&2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(fake))
    result = runner.invoke(app, ["rig", "info", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["server"] == {"path": str(fake), "source": "LLAMA_SERVER", "version": "9999 (test)"}


def test_explicit_server_bin_wins_over_llama_server(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    mine = tmp_path / "mine"
    mine.write_text("#!/bin/sh\necho 'version: 1 (mine)' >&2\n")
    mine.chmod(0o755)
    result = runner.invoke(app, ["rig", "info", "--json", "--server-bin", str(mine)])
    assert json.loads(result.stdout)["server"]["source"] == "--server-bin"


def test_bad_setting_is_one_line_and_exit_1(monkeypatch) -> None:
    monkeypatch.setenv("OC_PREFIX_CACHE_SLOT", "many")
    result = runner.invoke(app, ["daemon"])
    assert result.exit_code == 1
    assert "OC_PREFIX_CACHE_SLOT" in result.output
    assert "Traceback" not in result.output


def test_gc_dry_run_json_lists_and_keeps(isolated_home, tmp_path) -> None:
    from oc_prefix_cache.settings import Settings

    slots = Settings.from_env().slot_dir
    slots.mkdir(parents=True)
    orphan = slots / "oc-prefix-00000000000000bb.bin"
    orphan.write_bytes(b"x")
    (slots / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["gc", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dry_run"] is True and data["orphans"] == [orphan.name]
    assert data["ignored"] == ["notes.txt"]
    assert orphan.exists()


def test_gc_with_corrupt_index_refuses(isolated_home) -> None:
    from oc_prefix_cache.settings import Settings

    settings = Settings.from_env()
    settings.home.mkdir(parents=True, exist_ok=True)
    settings.index_path.write_text("{broken")
    result = runner.invoke(app, ["gc"])
    assert result.exit_code == 1
    assert "cleanup is off" in result.output
    assert settings.index_path.read_text() == "{broken"
