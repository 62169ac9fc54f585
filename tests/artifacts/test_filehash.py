"""File hashes: right digest, remembered by (path, size, mtime_ns), re-read only when the file changed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifacts import filehash
from artifacts.errors import ModelFileError
from artifacts.filehash import file_hash, index_path, model_hash
from artifacts.ids import content_id

BIG = 50 * 1024 * 1024
OLD_NS = 1_600_000_000 * 10**9  # well outside the racy window


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _write(path: Path, data: bytes, mtime_ns: int = OLD_NS) -> Path:
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


class ReadCounter:
    """Counts content reads, wrapping the real reader."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = filehash._hash_content

        def counting(path: Path) -> str:
            self.calls += 1
            return real(path)

        monkeypatch.setattr(filehash, "_hash_content", counting)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> ReadCounter:
    return ReadCounter(monkeypatch)


@pytest.fixture
def big_file(tmp_path: Path) -> Path:
    block = os.urandom(1024 * 1024)
    path = tmp_path / "model.gguf"
    with open(path, "wb") as fh:
        for i in range(BIG // len(block)):
            fh.write(block[i:] + block[:i])  # distinct chunks, cheap to make
    os.utime(path, ns=(OLD_NS, OLD_NS))
    return path


def test_big_file_is_hashed_once_and_remembered(big_file: Path, tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    expected = _blake(big_file.read_bytes())
    assert file_hash(big_file, cache) == expected
    assert reads.calls == 1
    entry = json.loads(index_path(big_file, cache).read_text())
    assert entry == {"path": str(big_file.resolve()), "size": BIG, "mtime_ns": OLD_NS, "hash": expected}
    assert index_path(big_file, cache).parent == cache / "hash-index"
    for _ in range(3):
        assert file_hash(big_file, cache) == expected
    assert reads.calls == 1  # hits: a stat and a small JSON read, no content read


def test_changed_mtime_forces_a_recompute(big_file: Path, tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    first = file_hash(big_file, cache)
    os.utime(big_file, ns=(OLD_NS + 1, OLD_NS + 1))
    assert file_hash(big_file, cache) == first
    assert reads.calls == 2
    assert json.loads(index_path(big_file, cache).read_text())["mtime_ns"] == OLD_NS + 1


def test_changed_content_is_seen(tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    path = _write(tmp_path / "f.bin", b"one")
    assert file_hash(path, cache) == _blake(b"one")
    _write(path, b"two!", OLD_NS)  # other size, same mtime
    assert file_hash(path, cache) == _blake(b"two!")
    assert reads.calls == 2


def test_recently_modified_file_is_not_remembered(tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"still being written?")
    assert file_hash(path, cache) == _blake(b"still being written?")
    assert not index_path(path, cache).exists()
    file_hash(path, cache)
    assert reads.calls == 2


def test_damaged_cache_entry_is_a_miss(tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    path = _write(tmp_path / "f.bin", b"data")
    file_hash(path, cache)
    index_path(path, cache).write_text("{not json")
    assert file_hash(path, cache) == _blake(b"data")
    assert reads.calls == 2
    assert json.loads(index_path(path, cache).read_text())["hash"] == _blake(b"data")


def test_symlink_shares_the_target_entry(tmp_path: Path, reads: ReadCounter) -> None:
    cache = tmp_path / "cache"
    target = _write(tmp_path / "blob", b"weights")
    link = tmp_path / "model.gguf"
    link.symlink_to(target)
    assert file_hash(target, cache) == file_hash(link, cache) == _blake(b"weights")
    assert reads.calls == 1


def test_missing_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="not found"):
        file_hash(tmp_path / "nope.gguf", tmp_path / "cache")
    with pytest.raises(ModelFileError, match="not a regular file"):
        file_hash(tmp_path, tmp_path / "cache")


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=300), chunk=st.integers(min_value=1, max_value=64))
def test_chunked_read_matches_one_shot_hash(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, chunk: int
) -> None:
    old = filehash.CHUNK_BYTES
    filehash.CHUNK_BYTES = chunk
    try:
        path = tmp_path_factory.mktemp("h") / "f.bin"
        path.write_bytes(data)
        assert filehash._hash_content(path) == _blake(data)
    finally:
        filehash.CHUNK_BYTES = old


def test_model_hash_covers_contents_in_shard_order_not_names(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a = _write(tmp_path / "m-00001-of-00002.gguf", b"first")
    b = _write(tmp_path / "m-00002-of-00002.gguf", b"second")
    h = model_hash([a, b], cache)
    assert h == model_hash([b, a], cache)
    assert h == content_id({"shards": [_blake(b"first"), _blake(b"second")]})
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    a2 = _write(moved / "renamed-00001-of-00002.gguf", b"first")
    b2 = _write(moved / "renamed-00002-of-00002.gguf", b"second")
    assert model_hash([a2, b2], cache) == h, "the same bytes under other names are the same model"
    _write(b, b"SECOND", OLD_NS + 5)
    assert model_hash([a, b], cache) != h
    assert model_hash([a], cache) != h
    with pytest.raises(ModelFileError):
        model_hash([], cache)


def test_a_file_of_several_pieces_hashes_as_a_tree_of_piece_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filehash, "PIECE_BYTES", 1000)
    monkeypatch.setattr(filehash, "CHUNK_BYTES", 300)  # pieces read in several chunks, the last one short
    data = os.urandom(3500)
    path = _write(tmp_path / "m.gguf", data)
    root = hashlib.blake2b(filehash.TREE_TAG + len(data).to_bytes(8, "little"), digest_size=32)
    for i in range(0, len(data), 1000):
        root.update(hashlib.blake2b(data[i : i + 1000], digest_size=32).digest())
    assert filehash._hash_content(path) == root.hexdigest()
    one_piece = _write(tmp_path / "small.gguf", data[:1000])
    assert filehash._hash_content(one_piece) == _blake(data[:1000]), "a file of one piece hashes as its bytes"
    changed = bytearray(data)
    changed[2999] ^= 1
    assert filehash._hash_content(_write(tmp_path / "m2.gguf", bytes(changed))) != root.hexdigest()
