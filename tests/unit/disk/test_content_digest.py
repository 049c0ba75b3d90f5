"""Content digests are computed once per file (path, size, mtime) and kept across processes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.disk import content_digest
from oc_prefix_cache.disk.content_digest import CHUNK, ContentDigests, file_content_digest, shared


def test_a_digest_is_xxh3_128_of_the_bytes_and_kept_in_a_private_file(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    digests = ContentDigests(tmp_path / "home" / "digests.json")
    assert digests.digest(model) == xxhash.xxh3_128_hexdigest(b"weights")
    assert digests.digest(str(model)) == xxhash.xxh3_128_hexdigest(b"weights")
    assert digests.computed == 1  # the second ask was answered from memory
    assert (digests.path.stat().st_mode & 0o777) == 0o600
    kept = json.loads(digests.path.read_text())["files"][str(model)]
    assert kept["xxh3_128"] == xxhash.xxh3_128_hexdigest(b"weights") and kept["size"] == 7


@settings(max_examples=20, deadline=None)
@given(st.binary(max_size=3 * 1024), st.integers(min_value=1, max_value=64))
def test_streaming_in_chunks_digests_the_whole_file(data: bytes, chunk: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "f"
        path.write_bytes(data)
        saved = content_digest.CHUNK
        content_digest.CHUNK = chunk  # many reads of a few bytes: the same digest as one read
        try:
            assert file_content_digest(path) == xxhash.xxh3_128_hexdigest(data)
        finally:
            content_digest.CHUNK = saved
    assert CHUNK == 8 << 20


def test_another_process_finds_the_digest_in_the_file(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    first = ContentDigests(tmp_path / "digests.json")
    found = first.digest(model)
    later = ContentDigests(tmp_path / "digests.json")  # the next process
    assert later.digest(model) == found and later.computed == 0


def test_a_changed_size_or_mtime_is_digested_again(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    digests = ContentDigests(tmp_path / "digests.json")
    before = digests.digest(model)
    os.utime(model, ns=(1, 1))  # touched: read again (the same bytes, so the same digest)
    assert digests.digest(model) == before and digests.computed == 2
    model.write_bytes(b"weights, retrained")
    after = digests.digest(model)
    assert after != before and after == xxhash.xxh3_128_hexdigest(b"weights, retrained") and digests.computed == 3
    assert ContentDigests(tmp_path / "digests.json").digest(model) == after  # the file keeps the latest


def test_a_corrupt_or_foreign_cache_file_is_digested_again_and_replaced(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    cache = tmp_path / "digests.json"
    for text in ("{not json", '{"files": []}', "[1, 2]", '{"files": {"x": 3}}', "\xff\xfe"):
        cache.write_text(text, errors="surrogateescape")
        digests = ContentDigests(cache)
        assert digests.digest(model) == xxhash.xxh3_128_hexdigest(b"weights") and digests.computed == 1
        assert str(model) in json.loads(cache.read_text())["files"]


def test_a_cache_that_cannot_be_written_still_answers(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    digests = ContentDigests(blocked / "digests.json")  # its folder is a file
    assert digests.digest(model) == xxhash.xxh3_128_hexdigest(b"weights")


def test_a_missing_file_has_no_digest(tmp_path: Path) -> None:
    assert ContentDigests(tmp_path / "digests.json").digest(tmp_path / "none") is None


def test_records_of_files_gone_are_dropped(tmp_path: Path) -> None:
    digests = ContentDigests(tmp_path / "digests.json")
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    gone.write_bytes(b"a")
    kept.write_bytes(b"b")
    digests.digest(gone)
    gone.unlink()
    digests.digest(kept)
    assert set(json.loads(digests.path.read_text())["files"]) == {str(kept)}


def test_threads_asking_for_one_file_read_it_once(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(1 << 20))
    digests = ContentDigests(tmp_path / "digests.json")
    answers: list[str | None] = []
    threads = [threading.Thread(target=lambda: answers.append(digests.digest(model))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(answers)) == 1 and answers[0] is not None and digests.computed == 1


def test_one_object_per_cache_file_per_process(tmp_path: Path) -> None:
    assert shared(tmp_path / "digests.json") is shared(tmp_path / "." / "digests.json")
    assert shared(tmp_path / "digests.json") is not shared(tmp_path / "other.json")
