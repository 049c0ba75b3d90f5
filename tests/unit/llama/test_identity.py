"""A slot file's identity holds exactly what changes its meaning, wherever the files lie (FORMAT 4).

The server's identity (``server_key``) and a head's fingerprint name the model and the server
binary by their content: a copy of either at another path, with another mtime, keeps every park
and head; one changed byte of the model, another build, a KV flag, another context size or
template is another identity. ocpc's own version is not in it. The keys of FORMAT 3 (paths,
mtimes, ocpc 0.1.0) are still computed, exactly as that version did, to find its files.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oc_prefix_cache.chat.head import Head
from oc_prefix_cache.disk.content_digest import ContentDigests
from oc_prefix_cache.llama.families import CacheFacts, Family
from oc_prefix_cache.llama.fingerprint import (
    FileIdentity,
    FingerprintInputs,
    ServerIdentity,
    fingerprint,
    legacy_fingerprint,
    legacy_server_key,
    server_key,
)
from oc_prefix_cache.llama.server_info import identity_from_props

HEAD = Head(tools_json="[]", system_head="sys", marker="M", model="local-model", n_tools=0)


def props(model: Path, **changes: Any) -> dict[str, Any]:
    return {
        "model_path": str(model),
        "build_info": "b11434-abc",
        "chat_template": "{{ messages }}",
        "total_slots": 1,
        "default_generation_settings": {"n_ctx": 16384},
    } | changes


def machine(root: Path, model_bytes: bytes = b"not a gguf: weights " * 1000) -> tuple[Path, Path]:
    """A model file and a server binary under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    model, binary = root / "models" / "qwen.gguf", root / "bin" / "llama-server"
    model.parent.mkdir(exist_ok=True)
    binary.parent.mkdir(exist_ok=True)
    model.write_bytes(model_bytes)
    binary.write_bytes(b"\x7fELF a llama-server build")
    return model, binary


def identity(
    model: Path, binary: Path | None, digests: ContentDigests, argv: list[str] | None = None, **changes: Any
) -> ServerIdentity:
    argv = ["llama-server", "-m", str(model)] if argv is None else argv
    return identity_from_props(props(model, **changes), binary=binary, argv=argv, digests=digests)


def keys(server: ServerIdentity, *, ocpc: str = "0.2.0") -> tuple[str, str]:
    return server_key(server), fingerprint(
        FingerprintInputs(server=server, harness="opencode/1.18.33", head=HEAD, rendered_head="<r>", ocpc_version=ocpc)
    )


def test_a_copy_of_the_model_and_the_binary_elsewhere_keeps_the_identity(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "home" / "digests.json")
    model, binary = machine(tmp_path / "a")
    here = identity(model, binary, digests)
    other_model, other_binary = tmp_path / "b" / "weights" / "renamed.gguf", tmp_path / "b" / "server"
    other_model.parent.mkdir(parents=True)
    shutil.copyfile(model, other_model)  # another path, another mtime
    shutil.copyfile(binary, other_binary)
    os.utime(other_model, ns=(10**18, 10**18))
    there = identity(other_model, other_binary, digests)
    assert there.model_files != here.model_files and there.build != here.build  # FORMAT 3 saw them apart
    assert keys(there) == keys(here)
    assert legacy_server_key(there) != legacy_server_key(here)


def test_one_byte_of_the_model_another_build_a_kv_flag_n_ctx_or_template_is_another_identity(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "digests.json")
    model, binary = machine(tmp_path / "a")
    base = keys(identity(model, binary, digests))
    changed_model, _ = machine(tmp_path / "b", model_bytes=b"not a gguf: weights " * 999 + b"not a gguf: weightz ")
    assert keys(identity(changed_model, binary, digests))[0] != base[0]
    assert keys(identity(model, binary, digests, build_info="b11500-def")) != base
    assert keys(identity(model, binary, digests, argv=["llama-server", "-ctk", "q8_0"])) != base
    assert keys(identity(model, binary, digests, default_generation_settings={"n_ctx": 8192})) != base
    assert keys(identity(model, binary, digests, chat_template="{{ other }}")) != base
    rebuilt = tmp_path / "rebuilt-server"
    rebuilt.write_bytes(b"\x7fELF another llama-server build")
    assert keys(identity(model, rebuilt, digests)) != base  # b0-unknown builds differ by their binary alone


def test_ocpcs_version_is_not_identity(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "digests.json")
    model, binary = machine(tmp_path / "a")
    server = identity(model, binary, digests)
    assert keys(server, ocpc="0.1.0") == keys(server, ocpc="9.9.9")


def test_without_the_binary_the_build_is_build_info_alone(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "digests.json")
    model, binary = machine(tmp_path / "a")
    assert identity(model, None, digests).build_id == "b11434-abc"
    assert identity(model, binary, digests).build_id.startswith("b11434-abc|xxh3:")
    assert identity(model, tmp_path / "gone", digests).build_id == "b11434-abc"


def test_every_shard_of_a_split_model_counts(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "digests.json")
    first = tmp_path / "m-00001-of-00002.gguf"
    first.write_bytes(b"one")
    assert identity(first, None, digests).model_digest == ""  # a shard missing: no identity, no files
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(b"two")
    whole = identity(first, None, digests).model_digest
    assert len(whole.split(",")) == 2
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(b"twO")
    assert identity(first, None, digests).model_digest != whole


def test_a_model_not_readable_here_has_no_identity(tmp_path: Path) -> None:
    """ocpc keeps no files for it (engine/prepare.py refuses: run the daemon on the server's machine)."""
    digests = ContentDigests(tmp_path / "digests.json")
    assert identity(tmp_path / "nowhere.gguf", None, digests).model_digest == ""
    model, _ = machine(tmp_path / "a")
    assert identity_from_props(props(model), binary=None, argv=None).model_digest == ""  # no digests: doctor's


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    model_path=st.text(alphabet="abcdefghij/_-.", min_size=1, max_size=30),
    mtime=st.integers(min_value=0, max_value=2**62),
    size=st.integers(min_value=0, max_value=2**40),
    binary_name=st.text(alphabet="abcdefghij-_", min_size=1, max_size=20),
    total_slots=st.integers(min_value=1, max_value=64),
    ocpc=st.text(max_size=10),
)
def test_where_a_file_lies_never_moves_the_keys(
    model_path: str, mtime: int, size: int, binary_name: str, total_slots: int, ocpc: str
) -> None:
    """The non-identity fields (labels, FORMAT 3's inputs) and ocpc's version never move the keys."""
    base = ServerIdentity(
        model_digest="00112233445566778899aabbccddeeff",
        build_id="b1|xxh3:ffeeddccbbaa99887766554433221100",
        chat_template_digest="t",
        n_ctx=4096,
        total_slots=2,
        kv_types="f16/f16",
        cache=CacheFacts(Family.UNKNOWN),
        kv_flags=(),
    )
    moved = replace(
        base,
        model_path=model_path,
        model_files=(FileIdentity(Path(model_path).name or "m", size, mtime),),
        build=f"b1|{binary_name}|{size}|{mtime}",
        total_slots=total_slots,
        legacy_kv_flags=(f"--lora={model_path}|{size}|{mtime}",),
    )
    assert keys(moved, ocpc=ocpc) == keys(base)


# -- FORMAT 3, to find the files made before -----------------------------------------------

#: A server as ocpc 0.1.0 (dd2e077) saw it, and the keys that version computed for it (run then).
OLD = ServerIdentity(
    model_digest="",
    build_id="",
    model_path="/m/model.gguf",
    model_files=(FileIdentity("model.gguf", 100, 1),),
    build="b1|llama-server|5|7",
    chat_template_digest="abc",
    n_ctx=4096,
    total_slots=2,
    kv_types="f16/f16",
    cache=CacheFacts(Family.UNKNOWN),
    kv_flags=("--cache-type-k=q8_0", "--lora=xxh3:00"),
    lora=("0=xxh3:00:0.5",),
    legacy_kv_flags=("--cache-type-k=q8_0", "--lora=/x/a.gguf|4|9"),
    legacy_lora=("0=/x/a.gguf|4|9:0.5",),
)


def test_the_legacy_keys_are_the_previous_versions_own() -> None:
    assert legacy_server_key(OLD) == "3440448a46782e0c"
    inputs = FingerprintInputs(server=OLD, harness="opencode/1.0", head=HEAD, rendered_head="<r>")
    assert legacy_fingerprint(inputs) == "47ed25ce8afc95af"
    assert legacy_fingerprint(replace(inputs, ocpc_version="0.2.0")) == "47ed25ce8afc95af"  # always 0.1.0's


def test_the_legacy_keys_of_a_gathered_identity_are_what_the_previous_version_gathered(tmp_path: Path) -> None:
    """The old fields are filled as that version filled them: path, shard stat, binary stat, flag files."""
    digests = ContentDigests(tmp_path / "digests.json")
    model, binary = machine(tmp_path / "a")
    lora = tmp_path / "a.gguf"
    lora.write_bytes(b"adapter")
    argv = ["llama-server", "-m", str(model), "--lora", str(lora)]
    server = identity(model, binary, digests, argv=argv)
    stat, bstat, lstat = model.stat(), binary.stat(), lora.stat()
    assert server.model_path == str(model)
    assert server.model_files == (FileIdentity(model.name, stat.st_size, stat.st_mtime_ns),)
    assert server.build == f"b11434-abc|llama-server|{bstat.st_size}|{bstat.st_mtime_ns}"
    assert server.legacy_kv_flags == (f"--lora={lora}|{lstat.st_size}|{lstat.st_mtime_ns}",)
    assert server.kv_flags is not None and server.kv_flags[0].startswith("--lora=xxh3:")
