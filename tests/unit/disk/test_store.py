"""index.json, slot-file headers, gates: the small pieces with their own rules (settings: test_settings.py)."""

from __future__ import annotations

import json
import struct
import tempfile
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from oc_prefix_cache.disk.index import KINDS, Entry, Index, Store, UsageLog
from oc_prefix_cache.disk.slotfile import fingerprint_of, read_header, slot_filename
from oc_prefix_cache.engine.gates import build_number, has_checkpoint_files, header_gate, probe_gate, served_from_head
from oc_prefix_cache.errors import IndexCorrupt, SlotFileError


def make_store(tmp_path: Path) -> Store:
    return Store(index_path=tmp_path / "index.json", lock_path=tmp_path / "index.lock")


def entry(fp: str, used: int = 1) -> Entry:
    return Entry(
        file=f"oc-prefix-{fp}.bin",
        bytes=10,
        prefix_tokens=5,
        created=1,
        last_used=used,
        model="m",
        server_build="b",
        harness="h",
    )


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


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"version": 0, "entries": {}}',
        '{"version": "2", "entries": {}}',
        '{"version": 2, "entries": {}, "current_seen": []}',
        '{"version": 1, "entries": []}',
        '{"version": 1, "entries": {"x": {"file": "../etc/passwd"}}}',
        '{"version": 1, "entries": {"x": {"file": "evil.bin", "bytes": 1, "prefix_tokens": 1,'
        ' "created": 1, "last_used": 1, "model": "", "server_build": "", "harness": ""}}}',
        '{"version": 1, "entries": {"x": {"file": null, "bytes": 1, "prefix_tokens": 1,'
        ' "created": 1, "last_used": 1, "model": "", "server_build": "", "harness": ""}}}',
        '{"version": 1, "entries": {"x": {"file": "oc-prefix-0123456789abcdef.bin", "bytes": "1",'
        ' "prefix_tokens": 1, "created": 1, "last_used": 1, "model": "", "server_build": "",'
        ' "harness": ""}}}',
        '{"version": 1, "entries": {"x": 7}}',
    ],
)
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
    newer = {
        "version": 4,
        "rollout": {"a": 1},
        "entries": {
            fp: {**{k: v for k, v in entry(fp).to_json().items() if k != "chain"}, "tier": "ssd", "chunks": [1, 2]}
        },
        "current": {"http://x#slot0": fp},
    }
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
    index = Index(
        entries={f"{i:016x}": entry(f"{i:016x}") for i in range(5)},
        current={**{f"http://a:1#slot{i}": f"{i:016x}" for i in range(4)}, "http://b:2#slot3": f"{4:016x}"},
    )
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
    threads = [
        threading.Thread(target=store.update, args=(lambda index, fp=fp: index.entries.__setitem__(fp, entry(fp)),))
        for fp in fps
    ]
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
    for name in (
        "oc-prefix-0123456789ABCDEF.bin",
        "oc-prefix-0123.bin",
        "other.bin",
        "oc-prefix-0123456789abcdef.bin.part",
    ):
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


# --- entries of kinds this ocpc does not know (a newer version's, read after a downgrade) ---

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
unknown_kinds = st.text(max_size=12).filter(lambda k: k not in KINDS)


@st.composite
def foreign_entries(draw: st.DrawFn) -> dict[str, Any]:
    """An entry of an unknown kind: any fields (a file or not, any types), its kind anywhere."""
    fields = draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k != "kind"), json_values, max_size=6))
    if draw(st.booleans()):
        fields["file"] = draw(
            st.sampled_from(
                [f"oc-conv-{'e' * 16}.bin", f"oc-prefix-{'d' * 16}.bin", "oc-tier-0123.bin", "../elsewhere", ""]
            )
            | st.text(max_size=20)
        )
    items = list(fields.items())
    items.insert(draw(st.integers(0, len(items))), ("kind", draw(unknown_kinds)))
    return dict(items)


FP = "0123456789abcdef"


@given(
    st.dictionaries(st.text(max_size=20).filter(lambda k: k != FP), foreign_entries(), min_size=1, max_size=4),
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k not in {f.name for f in fields(Entry)}), json_values, max_size=2
    ),
)
@hyp_settings(max_examples=200, deadline=None)
def test_entries_of_unknown_kinds_round_trip_byte_for_byte_and_are_never_used(
    foreign: dict[str, dict[str, Any]], unknown_fields: dict[str, Any]
) -> None:
    """A newer ocpc adds a kind; after a downgrade its entries made the whole index corrupt
    (parks unreadable, gc off). Now they are kept exactly as written, byte for byte, through
    every save, and never used: no code sees them in ``entries``."""
    ours = {**unknown_fields, **entry(FP).to_json()}  # a known entry with fields of a newer version
    data = {
        "version": 4,
        "entries": dict(sorted({**foreign, FP: ours}.items())),
        "current": {"http://x#slot0": FP},
        "current_seen": {},
    }
    text = json.dumps(data, indent=1) + "\n"  # as an ocpc writes it
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "index.json").write_text(text, encoding="utf-8")
        store = make_store(path)
        index = store.load()
        assert set(index.entries) == {FP} and index.foreign == foreign
        store.update(lambda ix: None)
        assert (path / "index.json").read_text(encoding="utf-8") == text  # byte for byte
        store.update(lambda ix: setattr(ix.entries[FP], "last_used", 99))
        after = json.loads((path / "index.json").read_text(encoding="utf-8"))["entries"]
        assert after[FP]["last_used"] == 99
        for key, raw in foreign.items():
            assert json.dumps(after[key], indent=1) == json.dumps(raw, indent=1)


def test_an_unknown_kind_is_kept_but_a_known_kind_with_a_wrong_name_is_still_corrupt(tmp_path: Path) -> None:
    fp = "0123456789abcdef"
    bad = {**entry(fp).to_json(), "file": "evil.bin"}  # a head that names no head file
    (tmp_path / "index.json").write_text(json.dumps({"version": 3, "entries": {fp: bad}}))
    with pytest.raises(IndexCorrupt):
        make_store(tmp_path).load()
    newer = {**bad, "kind": "tier2"}
    (tmp_path / "index.json").write_text(json.dumps({"version": 3, "entries": {fp: newer}}))
    index = make_store(tmp_path).load()
    assert index.entries == {} and index.foreign == {fp: newer}
    assert index.foreign_files() == frozenset({"evil.bin"})
    index.entries[fp] = entry(fp)  # ours under the same key wins; its file is then not foreign
    assert index.to_json()["entries"][fp]["kind"] == "head" and index.foreign_files() == frozenset()
