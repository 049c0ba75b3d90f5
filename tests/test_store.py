"""index.json, slot-file headers, gates: the small pieces with their own rules (settings: test_settings.py)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest

from oc_prefix_cache.errors import IndexCorrupt, SlotFileError
from oc_prefix_cache.gates import (
    build_number,
    has_checkpoint_files,
    header_gate,
    probe_gate,
    served_from_head,
)
from oc_prefix_cache.slotfile import fingerprint_of, read_header, slot_filename
from oc_prefix_cache.store import Entry, Index, Store, UsageLog


def make_store(tmp_path: Path) -> Store:
    return Store(index_path=tmp_path / "index.json", lock_path=tmp_path / "index.lock")


def entry(fp: str, used: int = 1) -> Entry:
    return Entry(file=f"oc-prefix-{fp}.bin", bytes=10, prefix_tokens=5, created=1, last_used=used,
                 model="m", server_build="b", harness="h")


def test_missing_index_is_empty_and_a_round_trip_keeps_everything(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert store.load() == Index()
    fp = "0123456789abcdef"

    def change(index: Index) -> None:
        index.entries[fp] = entry(fp)
        index.current["http://x#slot0"] = fp

    store.update(change)
    data = json.loads((tmp_path / "index.json").read_text())
    assert data["version"] == 3 and data["current"] == {"http://x#slot0": fp}
    assert store.load().entries[fp] == entry(fp)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index-")] == []


@pytest.mark.parametrize("text", ["{", "[]", '{"version": 0, "entries": {}}', '{"version": "2", "entries": {}}',
                                  '{"version": 2, "entries": {}, "current_seen": []}', '{"version": 1, "entries": []}',
                                  '{"version": 1, "entries": {"x": {"file": "../etc/passwd"}}}',
                                  '{"version": 1, "entries": {"x": {"file": "evil.bin", "bytes": 1, "prefix_tokens": 1,'
                                  ' "created": 1, "last_used": 1, "model": "", "server_build": "", "harness": ""}}}',
                                  '{"version": 1, "entries": {"x": {"file": null, "bytes": 1, "prefix_tokens": 1,'
                                  ' "created": 1, "last_used": 1, "model": "", "server_build": "", "harness": ""}}}',
                                  '{"version": 1, "entries": {"x": {"file": "oc-prefix-0123456789abcdef.bin", "bytes": "1",'
                                  ' "prefix_tokens": 1, "created": 1, "last_used": 1, "model": "", "server_build": "",'
                                  ' "harness": ""}}}',
                                  '{"version": 1, "entries": {"x": 7}}'])
def test_corrupt_index_is_refused_and_left_as_it_was(tmp_path: Path, text: str) -> None:
    (tmp_path / "index.json").write_text(text)
    store = make_store(tmp_path)
    with pytest.raises(IndexCorrupt):
        store.load()
    with pytest.raises(IndexCorrupt):
        store.update(lambda index: None)
    assert (tmp_path / "index.json").read_text() == text


def test_an_index_of_another_ocpc_version_reads_and_keeps_what_it_does_not_know(tmp_path: Path) -> None:
    """A newer ocpc's fields (in an entry, at the top) are not corruption: read what we know, write
    the rest back as it was, and never lower the version number. Before, any unknown field made the
    whole index corrupt: the parks were lost and gc was off."""
    fp = "0123456789abcdef"
    newer = {"version": 4, "rollout": {"a": 1},
             "entries": {fp: {**{k: v for k, v in entry(fp).to_json().items() if k != "chain"},
                              "tier": "ssd", "chunks": [1, 2]}},
             "current": {"http://x#slot0": fp}}
    (tmp_path / "index.json").write_text(json.dumps(newer))
    store = make_store(tmp_path)
    index = store.load()
    assert index.entries[fp].file == f"oc-prefix-{fp}.bin" and index.entries[fp].chain == []
    store.update(lambda ix: setattr(ix.entries[fp], "last_used", 99))
    data = json.loads((tmp_path / "index.json").read_text())
    assert data["version"] == 4 and data["rollout"] == {"a": 1}
    assert data["entries"][fp]["tier"] == "ssd" and data["entries"][fp]["chunks"] == [1, 2]
    assert data["entries"][fp]["last_used"] == 99 and data["current"] == {"http://x#slot0": fp}


def test_a_running_ocpc_dates_its_slots_and_drops_the_ones_its_server_no_longer_has(tmp_path: Path) -> None:
    """-np 4 -> -np 1: the keys of slots 1-3 pinned their heads for ever; now the daemon that sees
    the server with one slot drops them, and dates the one it has (another server's keys stay)."""
    store = make_store(tmp_path)
    index = Index(entries={f"{i:016x}": entry(f"{i:016x}") for i in range(5)},
                  current={**{f"http://a:1#slot{i}": f"{i:016x}" for i in range(4)}, "http://b:2#slot3": f"{4:016x}"})
    store.save(index)
    usage = UsageLog(store)
    usage.alive("http://a:1", 1)
    assert usage.due()
    usage.flush()
    after = store.load()
    assert after.current == {"http://a:1#slot0": f"{0:016x}", "http://b:2#slot3": f"{4:016x}"}
    assert set(after.current_seen) == {"http://a:1#slot0"} and not usage.due()


def test_concurrent_updates_lose_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    fps = [f"{i:016x}" for i in range(20)]
    threads = [threading.Thread(target=store.update, args=(lambda index, fp=fp: index.entries.__setitem__(fp, entry(fp)),))
               for fp in fps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(store.load().entries) == fps


def write_slot_file(path: Path, tokens: list[int], *, packed: bool = True, state: bytes = b"S" * 64) -> None:
    values = [-1, 1, len(tokens), *tokens, 0] if packed else tokens
    path.write_bytes(struct.pack("<III", 0x67677371, 4, len(values)) + struct.pack(f"<{len(values)}i", *values) + state)


def test_slot_file_header_reads_both_packings(tmp_path: Path) -> None:
    for packed in (True, False):
        path = tmp_path / f"f{packed}.bin"
        write_slot_file(path, [5, 6, 7], packed=packed)
        header = read_header(path)
        assert header.tokens == (5, 6, 7) and header.state_bytes == 64


@pytest.mark.parametrize("damage", [b"", b"xx", b"GGUF" + b"\x00" * 20])
def test_unreadable_slot_files_raise(tmp_path: Path, damage: bytes) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(damage)
    with pytest.raises(SlotFileError):
        read_header(path)


def test_truncated_token_list_raises(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_slot_file(path, list(range(100)))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SlotFileError, match="truncated"):
        read_header(path)


def test_slot_file_names() -> None:
    assert slot_filename("0123456789abcdef") == "oc-prefix-0123456789abcdef.bin"
    assert fingerprint_of("oc-prefix-0123456789abcdef.bin") == "0123456789abcdef"
    for name in ("oc-prefix-0123456789ABCDEF.bin", "oc-prefix-0123.bin", "other.bin", "oc-prefix-0123456789abcdef.bin.part"):
        assert fingerprint_of(name) is None
    with pytest.raises(ValueError):
        slot_filename("../../etc")


def test_gates() -> None:
    assert header_gate([1, 2, 3], [1, 2, 3]).ok
    assert "token 1" in header_gate([1, 9, 3], [1, 2, 3]).reason
    assert not header_gate([1, 2], [1, 2, 3]).ok
    assert probe_gate(cache_n=90, head_tokens=100).ok and not probe_gate(cache_n=89, head_tokens=100).ok
    assert served_from_head(cache_n=7145, prefix_tokens=7145) and not served_from_head(cache_n=0, prefix_tokens=7145)
    assert build_number("b11434-abc") == 11434 and build_number("b0-unknown") is None
    assert has_checkpoint_files("b11500") and not has_checkpoint_files("b0-unknown")
