"""The rig's cache key: a native build (-march=native) is for the CPU and compiler it was made
with, so a build from another CPU flavour (a cache copied between machines, an old versioned
folder) is never used; it could die with SIGILL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.errors import RigError
from oc_prefix_cache.rig.build import (
    SDIST_NAME,
    SDIST_VERSION,
    MachineKey,
    cpu_features,
    find_server,
    machine_key,
    rig_for,
)
from oc_prefix_cache.settings import Settings

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
"""
GCC = ("cc (Debian 12.2.0-14) 12.2.0", "c++ (Debian 12.2.0-14) 12.2.0")


def key(cpuinfo: str, compilers: tuple[str, ...] = GCC, arch: str = "x86_64") -> MachineKey:
    source, features = cpu_features(cpuinfo)
    return MachineKey(arch=arch, cpu_source=source, cpu_features=features, compilers=compilers)


def test_the_key_reads_x86_flags_and_arm_features() -> None:
    assert cpu_features(X86) == ("/proc/cpuinfo flags", ("avx2 avx512_vnni avx512f fpu sse2",))
    source, features = cpu_features(ARM)  # big.LITTLE: cores that differ give a line each
    assert source == "/proc/cpuinfo Features" and len(features) == 2
    assert cpu_features("")[0] == "platform.processor()"


def test_another_cpu_flavour_or_compiler_gives_another_folder() -> None:
    here = key(X86)
    assert here.name.startswith(f"{SDIST_NAME}-{SDIST_VERSION}-x86_64-") and here == key(X86)
    amx = key(X86.replace("avx512_vnni", "avx512_vnni amx_tile amx_int8"))
    assert len({here.name, amx.name, key(X86, ("cc 13.1", "c++ 13.1")).name, key(ARM, arch="aarch64").name}) == 4
    assert here.to_json()["cpu_flags"] == 5 and "SIGILL" in str(here.to_json()["why"])


def fake_build(root: Path) -> None:
    (root / "bin").mkdir(parents=True)
    for name in ("llama-server", "test-llama-archs"):
        (root / "bin" / name).write_text("#!/bin/sh\necho 'version: 1 (other cpu)' >&2\n")
        (root / "bin" / name).chmod(0o755)
    (root / "build-info.json").write_text("{}")


def test_a_build_from_another_cpu_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the rig was keyed by the sdist version alone: a cache made on an AMX machine and
    restored on one without AMX (or the reverse) ran there, and could die with SIGILL."""
    here = machine_key()  # (cached: conftest computes it before any test changes PATH)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no llama-server on PATH
    settings = Settings.from_env(
        {"OC_PREFIX_CACHE_RIG_DIR": str(tmp_path / "rig"), "OC_PREFIX_CACHE_HOME": str(tmp_path)}
    )
    other = MachineKey(
        arch=here.arch,
        cpu_source=here.cpu_source,
        cpu_features=(*here.cpu_features, "amx_tile"),
        compilers=here.compilers,
    )
    fake_build(settings.rig_dir / f"{SDIST_NAME}-{SDIST_VERSION}")  # the old layout: which CPU made it is unknown
    fake_build(rig_for(settings, other).root)
    assert rig_for(settings, other).is_built() and not rig_for(settings).is_built()
    with pytest.raises(RigError, match="no llama-server found"):
        find_server(settings)
    fake_build(rig_for(settings).root)  # this machine's own build is found
    assert find_server(settings).path == rig_for(settings).server


def test_rig_info_says_the_key_and_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OC_PREFIX_CACHE_RIG_DIR", str(tmp_path / "rig"))
    result = CliRunner().invoke(app, ["rig", "info", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rig_key"]["key"] == machine_key().name and data["rig_dir"].endswith(machine_key().name)
    assert "-march=native" in data["rig_key"]["why"] and data["rig_key"]["compilers"]
    shown = CliRunner().invoke(app, ["rig", "info"], env={"COLUMNS": "300"})
    assert "key:" in shown.output and "why:" in shown.output and "SIGILL" in shown.output, shown.output
