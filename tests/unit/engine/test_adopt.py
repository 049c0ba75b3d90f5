"""Files made before identities were by content are found under their old names and adopted.

A user upgrading from ocpc 0.1.0 has parks filed under FORMAT 3's key and heads named by FORMAT
3's fingerprint. The engine looks there when nothing is under the new ones, and adopts what it
finds: the file gets its new name (a hard link, else a copy) and its index entry a copy under
the new key, while the old name and entry stay for the previous version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from oc_prefix_cache.disk.index import Entry, Index, Store
from oc_prefix_cache.disk.park_files import adopted_park_key, find_park, park_entry, park_key
from oc_prefix_cache.disk.slotfile import slot_filename
from oc_prefix_cache.engine import ondisk
from oc_prefix_cache.engine.capability import Capabilities, Capability
from oc_prefix_cache.engine.decision import FileState
from oc_prefix_cache.engine.ondisk import OnDisk
from oc_prefix_cache.engine.tracker import SlotTracker

OLD_ID, NEW_ID = "0123456789abcdef", "fedcba9876543210"
OLD_HEAD, NEW_HEAD = "1111111111111111", "2222222222222222"


def disk(tmp_path: Path) -> OnDisk:
    slots = tmp_path / "slots"
    slots.mkdir(exist_ok=True)
    store = Store(index_path=tmp_path / "index.json", lock_path=tmp_path / "index.lock")
    return OnDisk(slot_dir=slots, store=store, tracker=SlotTracker(lock_dir=tmp_path), server="http://s:1")


def saved(d: OnDisk, kind: str, key: str, entry: Entry, data: bytes = b"slot file bytes") -> Entry:
    (d.slot_dir / slot_filename(key, kind)).write_bytes(data)
    entry.file, entry.bytes, entry.kind = slot_filename(key, kind), len(data), kind
    d.store.update(lambda index: index.entries.__setitem__(key, entry))
    return entry


def head_entry() -> Entry:
    return Entry(
        file="",
        bytes=0,
        prefix_tokens=7,
        created=1,
        last_used=2,
        model="/m/model.gguf",
        server_build="b1|llama-server|5|7",
        harness="opencode/1.0",
        xxh64="abcd",
        head=OLD_HEAD,
    )


def test_a_legacy_named_head_is_adopted_and_its_old_name_stays(tmp_path: Path) -> None:
    d = disk(tmp_path)
    saved(d, "head", OLD_HEAD, head_entry())
    assert d.state("head", NEW_HEAD) is FileState.MISSING
    assert d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)
    assert d.state("head", NEW_HEAD) is FileState.PRESENT  # never proven: restored behind its gates
    old, new = d.slot_dir / slot_filename(OLD_HEAD), d.slot_dir / slot_filename(NEW_HEAD)
    assert os.path.samefile(old, new)  # a hard link: no second copy of the bytes
    index = d.store.load()
    assert index.entries[OLD_HEAD].file == old.name  # the previous version still finds its file
    adopted = index.entries[NEW_HEAD]
    assert (adopted.file, adopted.head, adopted.xxh64, adopted.prefix_tokens) == (new.name, NEW_HEAD, "abcd", 7)
    assert d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)  # again: already its name
    assert d.store.load().entries[NEW_HEAD] == adopted


def test_a_legacy_keyed_park_is_found_and_adopted_under_its_conversations_new_key(tmp_path: Path) -> None:
    d = disk(tmp_path)
    digests = ("a" * 16, "b" * 16, "c" * 16)
    old_key = park_key(identity=OLD_ID, conversation="ses_1")
    entry = park_entry(
        model="/m/model.gguf",
        build="b1",
        identity=OLD_ID,
        head=OLD_HEAD,
        session="",
        digests=digests[:2],
        conversation="ses_1",
    )
    entry.prefix_tokens = 900
    saved(d, "conv", old_key, entry)
    index = d.store.load()
    request = (*digests, "d" * 16)  # the conversation gone on
    assert find_park(index, identity=NEW_ID, session="", digests=request) is None
    park = find_park(index, identity=OLD_ID, session="", digests=request)
    assert park is not None and park.key == old_key
    new_key = adopted_park_key(identity=NEW_ID, conversation="ses_1", old=old_key)
    assert new_key == park_key(identity=NEW_ID, conversation="ses_1")  # its next park replaces it
    assert d.adopt("conv", old_key, new_key, identity=NEW_ID, head=NEW_HEAD)
    after = d.store.load()
    found = find_park(after, identity=NEW_ID, session="", digests=request)
    assert found is not None and found.key == new_key and found.n_tokens == 900 and found.head == NEW_HEAD
    assert after.entries[old_key].identity == OLD_ID  # the old entry stays for the previous version
    assert d.state("conv", new_key) is FileState.PRESENT


def test_a_park_without_a_conversations_name_keeps_a_key_of_its_own() -> None:
    one = adopted_park_key(identity=NEW_ID, conversation="", old=OLD_HEAD)
    assert one != adopted_park_key(identity=NEW_ID, conversation="", old=NEW_HEAD)


def test_a_new_name_taken_by_another_file_is_never_overwritten(tmp_path: Path) -> None:
    d = disk(tmp_path)
    saved(d, "head", OLD_HEAD, head_entry(), data=b"old")
    saved(d, "head", NEW_HEAD, head_entry(), data=b"new")
    assert not d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)
    assert (d.slot_dir / slot_filename(NEW_HEAD)).read_bytes() == b"new"


def test_nothing_to_adopt(tmp_path: Path) -> None:
    d = disk(tmp_path)
    assert not d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)
    assert d.state("head", NEW_HEAD) is FileState.MISSING


def test_without_hard_links_the_file_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = disk(tmp_path)
    saved(d, "head", OLD_HEAD, head_entry(), data=b"bytes")

    def no_links(src: object, dst: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(ondisk.os, "link", no_links)
    assert d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)
    new = d.slot_dir / slot_filename(NEW_HEAD)
    assert new.read_bytes() == b"bytes" and not os.path.samefile(new, d.slot_dir / slot_filename(OLD_HEAD))
    assert (new.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in d.slot_dir.iterdir()) == sorted([new.name, slot_filename(OLD_HEAD)])  # no temp


def test_an_index_with_adopted_entries_reads_as_before(tmp_path: Path) -> None:
    """No new field, no new kind: the previous version reads the index the new one wrote."""
    d = disk(tmp_path)
    saved(d, "head", OLD_HEAD, head_entry())
    d.adopt("head", OLD_HEAD, NEW_HEAD, identity="", head=NEW_HEAD)
    raw = json.loads(d.store.index_path.read_text())
    assert raw["version"] == 3 and set(raw["entries"][NEW_HEAD]) == set(raw["entries"][OLD_HEAD])
    assert Index.from_json(raw, source="test").entries[NEW_HEAD].file == slot_filename(NEW_HEAD)


def test_a_self_test_kept_under_the_legacy_key_is_taken_over(tmp_path: Path) -> None:
    kept = Capabilities(tmp_path / "capabilities.json")
    kept.put(
        Capability(
            key=OLD_ID,
            build="b1",
            model="/m/model.gguf",
            version=3,
            known_format=True,
            header_ok=True,
            restores_serve=True,
            reason="ok",
        )
    )
    later = Capabilities(tmp_path / "capabilities.json")
    found = later.adopt(NEW_ID, OLD_ID)
    assert found is not None and found.key == NEW_ID and found.usable
    assert Capabilities(tmp_path / "capabilities.json").get(NEW_ID) == found
    assert later.adopt("3333333333333333", "4444444444444444") is None
