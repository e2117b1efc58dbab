"""`python -m trainer.prepare`: text -> ArrayRecord records of seq_len + 1 byte tokens."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from trainer.dataset import prepare
from trainer.dataset.input_pipeline import DataError, open_dataset


def _read_split(out, key: str) -> list[bytes]:
    meta = json.loads((out / "metadata.json").read_text())
    shards = [grain.sources.ArrayRecordDataSource(str(out / s["file"])) for s in meta[key]]
    # Records were dealt round-robin: record i is record i // n of shard i % n.
    total = sum(len(s) for s in shards)
    return [shards[i % len(shards)][i // len(shards)] for i in range(total)]


def _read_all_records(out) -> list[bytes]:
    """Training records, then the held-out ones (the tail of the stream)."""
    return _read_split(out, "shards") + _read_split(out, "eval_shards")


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
    total = len(stream) // 6
    held_out = -(-total * 5 // 100)  # ceil of the default 5%
    assert info.num_records == total - held_out and len(info.shards) == 3
    assert info.eval_num_records == held_out == 1 and len(info.eval_shards) == 1
    assert (info.token_dtype, info.vocab_size, info.tokenizer) == ("uint8", 256, "bytes")


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
    with pytest.raises(DataError, match="num_shards=3 exceeds the 2 training records"):
        prepare.write_shards(records, tmp_path, num_shards=3, sources=[])


def test_held_out_records_are_the_tail_of_the_stream(tmp_path):
    # Held out = the last 10% of the token stream, so no training record overlaps one of them.
    prepare.prepare(tmp_path / "d", seq_len=16, num_shards=2, num_sentences=400,
                    eval_fraction=0.1)
    from trainer.dataset.corpus import generate_corpus

    packed = [row.tobytes() for row in prepare.pack_records([generate_corpus(0, 400)], 16)]
    held_out = _read_split(tmp_path / "d", "eval_shards")
    assert len(held_out) == -(-len(packed) // 10)
    assert held_out == packed[-len(held_out):]
    assert _read_split(tmp_path / "d", "shards") == packed[:-len(held_out)]


def _text_files(tmp_path, count: int = 3) -> list[str]:
    from trainer.dataset.corpus import generate_corpus

    paths = []
    for index in range(count):
        path = tmp_path / f"doc{index}.txt"
        path.write_bytes(generate_corpus(index, 300))
        paths.append(str(path))
    return paths


def test_bpe_tokenizer_is_trained_locally_and_recorded(tmp_path):
    inputs = _text_files(tmp_path)
    out = tmp_path / "bpe"
    assert prepare.main(["--input", *inputs, "--output", str(out), "--seq-len", "32",
                         "--tokenizer", "bpe", "--vocab-size", "400", "--num-shards", "2"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["token_dtype"], meta["vocab_size"]) == ("uint16", 400)
    assert meta["tokenizer"]["kind"] == "huggingface" and (out / "tokenizer.json").is_file()
    info = open_dataset(out, seq_len=32, vocab_size=400)
    assert info.tokenizer == str(out / "tokenizer.json")
    tokens = np.frombuffer(_read_split(out, "shards")[0], dtype=np.uint16)
    assert tokens.shape == (33,) and tokens.max() < 400 and tokens.max() >= 256  # merges used

    # The saved tokenizer is an existing tokenizer file for the next data set.
    again = tmp_path / "again"
    assert prepare.main(["--input", *inputs, "--output", str(again), "--seq-len", "32",
                         "--tokenizer", str(out / "tokenizer.json"), "--num-shards", "2"]) == 0
    assert _read_all_records(again) == _read_all_records(out)


def test_model_vocabulary_smaller_than_the_data_is_rejected(tmp_path):
    out = tmp_path / "bpe"
    prepare.prepare(out, inputs=_text_files(tmp_path, 1), seq_len=16, num_shards=1,
                    tokenizer="bpe", vocab_size=300)
    with pytest.raises(DataError, match=r"model\.vocab_size = 256 is smaller than the vocabulary "
                                        r"of .* \(300 tokens, tokenizer .*tokenizer\.json\).*"
                                        r"set model\.vocab_size >= 300"):
        open_dataset(out, seq_len=16, vocab_size=256)


def test_tokenizer_arguments_are_checked(tmp_path, capsys):
    out = tmp_path / "o"
    assert prepare.main(["--output", str(out), "--tokenizer", "bpe"]) == 2
    assert "--tokenizer bpe needs --vocab-size" in capsys.readouterr().err
    assert prepare.main(["--output", str(out), "--tokenizer", "missing.json"]) == 2
    assert "not 'bytes', 'bpe' or an existing tokenizer file" in capsys.readouterr().err
    assert prepare.main(["--output", str(out), "--tokenizer", "bpe", "--vocab-size", "100"]) == 2
    assert "at least 257 tokens" in capsys.readouterr().err
    # Bounded before the library call, which would abort the process instead of raising.
    assert prepare.main(["--output", str(out), "--tokenizer", "bpe", "--vocab-size",
                         str(10**12)]) == 2
    assert "--vocab-size 1,000,000,000,000: a byte-level BPE needs at least 257 tokens (256 " \
        "bytes + the separator) and at most 1,048,576" in capsys.readouterr().err
    assert not out.exists()


def test_the_prepare_command_starts_without_importing_grain_or_jax():
    # `multislice data prepare` runs it as a process of its own: Grain and JAX cost ~1.6 CPU-s
    # of imports that writing ArrayRecord files does not need.
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys, trainer.prepare; "
             "print(sorted(m for m in ('grain', 'jax', 'orbax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout
    assert out.strip() == "[]"
