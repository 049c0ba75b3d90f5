"""The fingerprint sees every server setting that changes KV contents, and nothing else.

A slot file holds tokens and KV state, no configuration: a head saved under one RoPE base,
LoRA scale or control vector restores "successfully" under another. These tests pin the
allow-list (``KV_FLAGS``), its spellings, the settings that reach llama-server outside its
command line (LLAMA_ARG_* variables, config.ini), and the adapters changed at runtime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.head import Head, extract_head, parse_body, request_sets_adapters
from oc_prefix_cache.disk.content_digest import ContentDigests, file_content_digest
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import KV_FLAGS, FingerprintInputs, adapter_settings, fingerprint, kv_settings
from oc_prefix_cache.llama.server_info import flag_value, gather_identity, identity_from_props, server_argv
from oc_prefix_cache.rig.build import Rig
from tests.helpers import PROJ_A, SUITE_WAIT_S, capture_bytes

PROPS: dict[str, Any] = {
    "model_path": "/m/model.gguf",
    "build_info": "b0-unknown",
    "chat_template": "t",
    "total_slots": 1,
    "default_generation_settings": {"n_ctx": 16384},
}
BASE = ["llama-server", "-m", "/m/model.gguf", "--port", "8080", "-c", "16384"]
#: The content digests the engine's view passes (disk/content_digest.py), in a folder of their own.
DIGESTS = ContentDigests(Path(tempfile.mkdtemp(prefix="ocpc-digests-")) / "digests.json")


def head() -> Head:
    result = extract_head(parse_body(capture_bytes(PROJ_A)), ("<env>",))
    assert isinstance(result, Head)
    return result


def fp_of(argv: list[str] | None, *, lora: tuple[str, ...] = ()) -> str:
    from dataclasses import replace

    server = replace(identity_from_props(PROPS, binary=None, argv=argv, digests=DIGESTS), lora=lora)
    return fingerprint(FingerprintInputs(server=server, harness="opencode/1.18.33", head=head(), rendered_head="<r>"))


# -- the allow-list ------------------------------------------------------------------------


def test_flags_outside_the_allow_list_leave_the_fingerprint_alone() -> None:
    plain = fp_of(BASE)
    moved = BASE[:3] + [
        "--port",
        "9000",
        "-t",
        "2",
        "--host",
        "0.0.0.0",
        "-np",
        "4",
        "--metrics",
        "-lv",
        "4",
        "--log-file",
        "/tmp/x.log",
        "-ngl",
        "99",
        "--cache-ram",
        "0",
        "-c",
        "16384",
    ]
    assert fp_of(moved) == plain


def test_a_listed_flag_moves_the_fingerprint() -> None:
    assert fp_of(BASE + ["--rope-freq-base", "500000"]) != fp_of(BASE)


SAMPLES = {
    "switch": [],
    "number": ["2.5"],
    "choice": ["on"],
    "text": ["q8_0"],
    "pair": ["1", "2"],
    "files": ["/nonexistent/a.gguf"],
    "scaled_files": ["/nonexistent/a.gguf:0.5"],
}


@pytest.mark.parametrize("flag", KV_FLAGS, ids=lambda f: f.canonical)
def test_every_listed_flag_moves_the_fingerprint_in_every_spelling(flag) -> None:
    value = ["tokenizer.ggml.add_bos_token=bool:false"] if flag.canonical == "--override-kv" else SAMPLES[flag.kind]
    fps = {fp_of(BASE + [name, *value]) for name in flag.names}
    if flag.nargs == 1:
        fps.add(fp_of(BASE + [f"{flag.canonical}={value[0]}"]))
        fps.add(fp_of(BASE + [flag.canonical.replace("-", "_").replace("__", "--", 1), *value]))
    assert len(fps) == 1, f"{flag.canonical}: its spellings give different fingerprints"
    assert fps != {fp_of(BASE)}, f"{flag.canonical} does not move the fingerprint"


def test_spellings_and_defaults_normalise() -> None:
    assert kv_settings(["s", "-ctk", "q8_0", "-fa", "true", "--rope-freq-base", "1e4"]) == kv_settings(
        ["s", "--cache-type-k=q8_0", "--flash-attn", "on", "--rope_freq_base", "10000"]
    )
    assert kv_settings(["s", "-ctk", "f16", "-fa", "auto"]) == ()  # the build's defaults, given explicitly
    assert kv_settings(["s", "-ctk", "q8_0", "-ctk", "q4_0"]) == ("--cache-type-k=q4_0",)  # the last one wins
    assert kv_settings(["s", "--yarn-ext-factor", "-1"]) == ("--yarn-ext-factor=-1.0",)  # a negative value


def test_repeated_adapters_all_count() -> None:
    assert len(kv_settings(["s", "--override-kv", "a=int:1", "--override-kv", "b=int:2"])) == 2
    assert kv_settings(["s", "--lora", "/x/a.gguf", "--lora", "/x/b.gguf"]) != kv_settings(["s", "--lora", "/x/b.gguf"])


def test_a_changed_adapter_file_moves_the_fingerprint_and_a_copy_elsewhere_does_not(tmp_path: Path) -> None:
    """A flag's file counts by its content (FORMAT 4): a retrained adapter under the same name is
    another adapter; the same adapter at another path, or touched, is the same."""
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"one")
    before = fp_of(BASE + ["--lora", str(adapter)])
    os.utime(adapter, ns=(1, 1))
    assert fp_of(BASE + ["--lora", str(adapter)]) == before  # touched: the same bytes
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(adapter, copy)
    assert fp_of(BASE + ["--lora", str(copy)]) == before
    assert fp_of(BASE + ["--control-vector-scaled", f"{adapter}:0.5"]) == fp_of(
        BASE + ["--control-vector-scaled", f"{copy}:0.5"]
    )
    adapter.write_bytes(b"two")  # the same size, other bytes
    assert fp_of(BASE + ["--lora", str(adapter)]) != before
    assert kv_settings(BASE + ["--lora", str(copy)], digests=DIGESTS) == (f"--lora=xxh3:{file_content_digest(copy)}",)


def test_an_invisible_command_line_never_matches_a_visible_one() -> None:
    assert fp_of(None) != fp_of(BASE)


def test_flag_value_takes_the_last_occurrence_like_the_server() -> None:
    argv = ["s", "--checkpoint-min-step", "8192", "-cms", "1024"]
    assert flag_value(argv, ("--checkpoint-min-step", "-cms")) == "1024"


# -- adapters changed at runtime or per request --------------------------------------------


def test_only_active_adapters_count_and_their_scale_matters() -> None:
    at = [{"id": 0, "path": "/nonexistent/a.gguf", "scale": 1.0}, {"id": 1, "path": "/x/b.gguf", "scale": 0.0}]
    assert len(adapter_settings(at)) == 1
    assert adapter_settings([{**at[0], "scale": 0.5}]) != adapter_settings(at[:1])
    assert fp_of(BASE, lora=adapter_settings(at)) != fp_of(BASE)


def test_request_sets_adapters() -> None:
    assert request_sets_adapters({"messages": [], "lora": [{"id": 0, "scale": 0.5}]})
    assert not request_sets_adapters({"messages": []})
    assert not request_sets_adapters({"lora": []})
    assert not request_sets_adapters({"lora": None})


# -- settings that reach the server outside its argv ---------------------------------------


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator:
    """A stand-in process with a chosen environment and working directory (stopped by PID)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            cwd=tmp_path,
            env={"PATH": os.environ.get("PATH", ""), **env},
        )
        started.append(proc)
        deadline = time.monotonic() + SUITE_WAIT_S
        while not Path(f"/proc/{proc.pid}/environ").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # just after exec the kernel shows an empty environment for a moment
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_llama_arg_variables_and_config_ini_join_and_argv_wins(fake_server, tmp_path: Path) -> None:
    config = tmp_path / "xdg" / "llama.cpp" / "config.ini"
    config.parent.mkdir(parents=True)
    config.write_text("[*]\nyarn-orig-ctx = 4096\nport = 1234\n[other-model]\nrope-freq-base = 1\n")
    pid = fake_server(
        {
            "LLAMA_ARG_ROPE_FREQ_BASE": "500000",
            "LLAMA_ARG_CACHE_TYPE_K": "q8_0",
            "LLAMA_ARG_THREADS": "3",
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        }
    )
    argv = server_argv("http://127.0.0.1:8080", runtime={"argv": [*BASE, "-ctk", "q4_0"], "pid": pid})
    assert argv is not None
    assert kv_settings(argv) == ("--cache-type-k=q4_0", "--rope-freq-base=500000.0", "--yarn-orig-ctx=4096.0")


def test_relative_adapter_paths_are_read_where_the_server_runs(fake_server, tmp_path: Path) -> None:
    (tmp_path / "adapter.gguf").write_bytes(b"lora")
    pid = fake_server({})
    argv = server_argv("http://127.0.0.1:8080", runtime={"argv": [*BASE, "--lora", "adapter.gguf"], "pid": pid})
    assert argv is not None
    assert kv_settings(argv)[0].startswith(f"--lora={tmp_path / 'adapter.gguf'}|4|")  # as status shows it
    assert kv_settings(argv, digests=DIGESTS) == (f"--lora=xxh3:{file_content_digest(tmp_path / 'adapter.gguf')}",)


# -- a real adapter on the real server -----------------------------------------------------

# The tiny qwen3's attention weights (test-llama-archs: 2 layers, n_embd 256, 4 heads of 64,
# 1 KV head), as (n_in, n_out). Reading them from the model with gguf-py takes ~9 s (its
# 151,936-token vocabulary); the server checks every shape when it loads the adapter.
TINY_QWEN3_ATTENTION = {"attn_q": (256, 256), "attn_k": (256, 64), "attn_v": (256, 64)}


def make_lora(rig: Rig, dest: Path, *, arch: str = "qwen3", layers: int = 2, rank: int = 4) -> Path:
    """A tiny LoRA GGUF (general.type=adapter, adapter.type=lora) for the tiny qwen3 model."""
    tree = str(rig.source_tree / "gguf-py")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    import gguf
    import numpy as np

    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(dest), arch=arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for layer in range(layers):
        for name, (n_in, n_out) in TINY_QWEN3_ATTENTION.items():
            # ggml order: lora_a is [n_in, rank], lora_b is [rank, n_out] (numpy shapes reversed)
            tensor = f"blk.{layer}.{name}.weight"
            writer.add_tensor(f"{tensor}.lora_a", rng.normal(0, 0.05, (rank, n_in)).astype(np.float32))
            writer.add_tensor(f"{tensor}.lora_b", rng.normal(0, 0.05, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.mark.rig
def test_changing_an_adapters_scale_at_runtime_moves_the_fingerprint(llama_server, rig, tmp_path) -> None:
    adapter = make_lora(rig, tmp_path / "tiny-lora.gguf")
    server = llama_server("qwen3", ctx_size=4096, extra_args=("--lora", str(adapter)))
    loaded = loopback.get(f"{server.url}/lora-adapters", timeout=5).json()
    assert [(a["id"], Path(a["path"]).name, a["scale"]) for a in loaded] == [(0, "tiny-lora.gguf", 1.0)]

    argv = server_argv(server.url)  # found by its port among the local processes
    assert argv is not None and "--lora" in argv

    def current() -> str:
        with SlotClient(server.url) as client:
            identity = gather_identity(client, binary=None, argv=argv, digests=DIGESTS)
        assert identity.kv_flags and identity.kv_flags[0] == f"--lora=xxh3:{file_content_digest(adapter)}"
        assert identity.lora and identity.lora[0].startswith("0=xxh3:")
        return fingerprint(
            FingerprintInputs(server=identity, harness="opencode/1.18.33", head=head(), rendered_head="<rendered>")
        )

    full = current()
    loopback.post(f"{server.url}/lora-adapters", json=[{"id": 0, "scale": 0.5}], timeout=5).raise_for_status()
    half = current()
    assert half != full
    loopback.post(f"{server.url}/lora-adapters", json=[{"id": 0, "scale": 1.0}], timeout=5).raise_for_status()
    assert current() == full
