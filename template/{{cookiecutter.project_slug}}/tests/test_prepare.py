"""`python -m trainer.prepare`: text -> ArrayRecord records of seq_len + 1 byte tokens."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from trainer import prepare
from trainer.data_pipeline import DataError, open_dataset


def _read_all_records(out) -> list[bytes]:
    meta = json.loads((out / "metadata.json").read_text())
    shards = [grain.sources.ArrayRecordDataSource(str(out / s["file"])) for s in meta["shards"]]
    # Records were dealt round-robin: record i is record i // n of shard i % n.
    total = sum(len(s) for s in shards)
    return [shards[i % len(shards)][i // len(shards)] for i in range(total)]


def test_records_are_the_joined_documents_cut_into_seq_len_plus_one(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"The quick brown fox jumps.")
    b.write_bytes(b"Over the lazy dog, twice over!")
    out = tmp_path / "out"
    assert prepare.main(["--input", str(a), str(b), "--output", str(out), "--seq-len", "5",
                         "--num-shards", "3"]) == 0

    stream = a.read_bytes() + b"\x00" + b.read_bytes()
    records = _read_all_records(out)
    assert all(len(r) == 6 for r in records)
    assert b"".join(records) == stream[: len(stream) // 6 * 6]
    info = open_dataset(out, seq_len=5)
    assert info.num_records == len(stream) // 6 and len(info.shards) == 3


def test_default_corpus_is_deterministic_and_needs_no_input(tmp_path):
    for name in ("one", "two"):
        prepare.prepare(tmp_path / name, seq_len=16, num_shards=2, num_sentences=300)
    one, two = _read_all_records(tmp_path / "one"), _read_all_records(tmp_path / "two")
    assert one == two and len(one) > 100
    text = b"".join(one)
    assert text.isascii() and b". " in text


def test_different_corpus_seeds_give_different_text(tmp_path):
    prepare.prepare(tmp_path / "s0", seq_len=16, num_shards=1, num_sentences=50, seed=0)
    prepare.prepare(tmp_path / "s1", seq_len=16, num_shards=1, num_sentences=50, seed=1)
    assert _read_all_records(tmp_path / "s0") != _read_all_records(tmp_path / "s1")


def test_missing_input_file_is_named(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert prepare.main(["--input", str(missing), "--output", str(tmp_path / "o")]) == 2
    assert f"input file {missing} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o" / "metadata.json").exists()


def test_empty_input_file_is_named(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"input file {empty} is empty"):
        prepare.read_documents([empty])


def test_text_shorter_than_one_record_is_rejected_with_sizes():
    with pytest.raises(DataError, match=r"holds 3 bytes, fewer than one record of .* = 9"):
        prepare.pack_records([b"abc"], seq_len=8)


def test_more_shards_than_records_is_rejected(tmp_path):
    records = np.zeros((2, 5), dtype=np.uint8)
    with pytest.raises(DataError, match="num_shards=3 exceeds the 2 records"):
        prepare.write_shards(records, tmp_path, num_shards=3, sources=[])
