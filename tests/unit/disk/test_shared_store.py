"""The shared store (disk/shared_store.py): what one box publishes, another brings, whole or not at all.

The class of promises: two boxes never write one file (each its own folder); a file is never
visible half-written (a reader sees none, or all of it); a file whose bytes do not match its entry
is never brought; only files named like ours are ever removed; a box whose folder cannot be read
costs its files and nothing else; a brought file is not published again by the box that brought it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.disk.index import Entry, Index
from oc_prefix_cache.disk.shared_store import FROM_BOX, SharedStore, box_id
from oc_prefix_cache.disk.slotfile import file_digest, slot_filename


def saved(slot_dir: Path, key: str, kind: str, data: bytes, **fields: object) -> Entry:
    slot_dir.mkdir(parents=True, exist_ok=True)
    path = slot_dir / slot_filename(key, kind)
    path.write_bytes(data)
    return Entry(
        file=path.name,
        bytes=len(data),
        prefix_tokens=len(data),
        created=1,
        last_used=int(fields.pop("last_used", 1)),  # type: ignore[call-overload]
        model="m",
        server_build="b",
        harness="h",
        xxh64=file_digest(path),
        kind=kind,
        **fields,  # type: ignore[arg-type]
    )


def boxes(tmp_path: Path) -> tuple[SharedStore, SharedStore]:
    root = tmp_path / "store"
    return (
        SharedStore(root, box="box-a", slot_dir=tmp_path / "a" / "slots"),
        SharedStore(root, box="box-b", slot_dir=tmp_path / "b" / "slots"),
    )


def test_a_head_and_a_park_published_by_one_box_are_brought_whole_by_another(tmp_path: Path) -> None:
    a, b = boxes(tmp_path)
    index = Index()
    index.entries["1" * 16] = saved(a.slot_dir, "1" * 16, "head", b"head bytes" * 100)
    index.entries["2" * 16] = saved(a.slot_dir, "2" * 16, "conv", b"park bytes" * 100, identity="id", session="s1")
    assert a.publish(index).copied == 2
    assert a.publish(index).copied == 0  # unchanged: nothing copied again
    found = {f.key: f for f in b.others()}
    assert set(found) == {"1" * 16, "2" * 16} and not a.others()  # a box does not bring its own
    entry = b.bring(found["2" * 16])
    assert entry is not None and entry.extra[FROM_BOX] == "box-a"
    brought = b.slot_dir / entry.file
    assert brought.read_bytes() == b"park bytes" * 100
    assert brought.stat().st_mode & 0o777 == 0o600
    # published by the box that brought it? no: its own box publishes it
    mine = Index(entries={"2" * 16: entry})
    b.publish(mine)
    assert not (b.own / entry.file).exists()
    assert json.loads((b.own / "index.json").read_text())["entries"] == {}


def test_a_file_whose_bytes_do_not_match_its_entry_is_never_brought(tmp_path: Path) -> None:
    a, b = boxes(tmp_path)
    index = Index(entries={"3" * 16: saved(a.slot_dir, "3" * 16, "head", b"x" * 1000)})
    a.publish(index)
    (a.own / index.entries["3" * 16].file).write_bytes(b"y" * 1000)  # torn, or replaced under its entry
    (item,) = b.others()
    assert b.bring(item) is None
    assert not any(b.slot_dir.iterdir()) if b.slot_dir.exists() else True  # nothing left behind


def test_a_file_being_replaced_locally_waits_for_the_next_round(tmp_path: Path) -> None:
    a, _ = boxes(tmp_path)
    entry = saved(a.slot_dir, "4" * 16, "conv", b"old" * 100)
    (a.slot_dir / entry.file).write_bytes(b"new, its entry not yet written" * 10)
    assert a.publish(Index(entries={"4" * 16: entry})).copied == 0
    assert not (a.own / entry.file).exists()


def test_publishing_removes_only_files_named_like_ours(tmp_path: Path) -> None:
    a, _ = boxes(tmp_path)
    index = Index(entries={"5" * 16: saved(a.slot_dir, "5" * 16, "head", b"h" * 10)})
    a.publish(index)
    (a.own / "notes.txt").write_text("the user's")
    a.publish(Index())  # the head was deleted here (gc): it leaves the store, the user's file stays
    assert sorted(p.name for p in a.own.iterdir()) == ["index.json", "notes.txt"]


def test_a_box_whose_index_cannot_be_read_costs_its_files_only(tmp_path: Path) -> None:
    a, b = boxes(tmp_path)
    a.publish(Index(entries={"6" * 16: saved(a.slot_dir, "6" * 16, "head", b"h" * 10)}))
    broken = tmp_path / "store" / "box-c"
    broken.mkdir()
    (broken / "index.json").write_text("{not json")
    assert [f.box for f in b.others()] == ["box-a"]


def test_the_newest_use_of_a_key_wins_across_boxes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    stores = [SharedStore(root, box=f"box-{i}", slot_dir=tmp_path / str(i)) for i in range(3)]
    for i, store in enumerate(stores[:2]):
        store.publish(
            Index(entries={"7" * 16: saved(store.slot_dir, "7" * 16, "conv", bytes([i]) * 50, last_used=10 + i)})
        )
    merged = stores[2].as_index(stores[2].others())
    assert merged.entries["7" * 16].last_used == 11


def test_a_reader_never_sees_a_published_file_half_written(tmp_path: Path) -> None:
    """A reader polls the store while a writer publishes ever new versions of one file: every file
    it can open under its final name is whole (one of the versions, byte for byte)."""
    a, b = boxes(tmp_path)
    versions = {bytes([v]) * 300_000 for v in range(8)}
    stop = threading.Event()
    seen: list[bytes] = []

    def read() -> None:
        while not stop.is_set():
            for item in b.others():
                try:
                    seen.append(item.path.read_bytes())
                except FileNotFoundError:
                    pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for data in sorted(versions):
            a.publish(Index(entries={"8" * 16: saved(a.slot_dir, "8" * 16, "conv", data)}))
    finally:
        stop.set()
        reader.join()
    assert all(data in versions for data in seen)


@given(
    names=st.lists(
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True), min_size=2, max_size=5, unique=True
    )
)
@settings(max_examples=30, deadline=None)
def test_two_boxes_never_write_one_file(names: list[str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        written: dict[str, set[str]] = {}
        for name in names:
            store = SharedStore(root, box=name, slot_dir=Path(tmp) / name)
            store.publish(Index(entries={"9" * 16: saved(store.slot_dir, "9" * 16, "head", name.encode())}))
            written[name] = {str(p) for p in store.own.rglob("*")}
        paths = [p for files in written.values() for p in files]
        assert len(paths) == len(set(paths))


def test_a_box_keeps_its_name_and_two_homes_get_two(tmp_path: Path) -> None:
    one = box_id(tmp_path / "one")
    assert box_id(tmp_path / "one") == one != box_id(tmp_path / "two")
    assert os.stat(tmp_path / "one" / "box-id").st_mode & 0o777 == 0o600
