"""Prepare training data: text files -> ArrayRecord shards of fixed-length byte-token records.

    python -m trainer.prepare --output data/ [--input a.txt b.txt ...] [--seq-len 128]
                              [--num-shards 4] [--seed 0]

Every input file is one document. The documents are joined with a separator byte (0, which never
occurs in text) and the byte stream is cut into records of seq_len + 1 tokens (inputs are the first
seq_len, targets the last seq_len); the incomplete tail is dropped. Records are written round-robin
into `data-SSSSS-of-NNNNN.array_record` shards plus a `metadata.json` that `trainer.data_pipeline`
checks on open. Without `--input` the deterministic synthetic corpus of `trainer.corpus` is used,
so the demo needs no download.

The output directory must be a local path (the ArrayRecord writer opens local files); copy the
result to a bucket with `gcloud storage cp -r` if the trainer reads it from there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .corpus import generate_corpus
from .data_pipeline import FORMAT, METADATA_FILE, SHARD_SUFFIX, DataError

SEPARATOR = 0
DEFAULT_SEQ_LEN = 128


def read_documents(paths: Sequence[str | Path]) -> list[bytes]:
    """The bytes of each input file; DataError names a missing, unreadable or empty file."""
    if not paths:
        raise DataError("no input files given; pass --input FILE [FILE ...] or omit --input for "
                        "the built-in synthetic corpus")
    documents = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(f"input file {path} does not exist")
        if not path.is_file():
            raise DataError(f"input {path} is not a regular file")
        data = path.read_bytes()
        if not data:
            raise DataError(f"input file {path} is empty (0 bytes)")
        documents.append(data)
    return documents


def pack_records(documents: Sequence[bytes], seq_len: int) -> np.ndarray:
    """uint8 [num_records, seq_len + 1]: the documents joined by SEPARATOR, cut into records."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    stream = bytes([SEPARATOR]).join(documents)
    width = seq_len + 1
    count = len(stream) // width
    if count == 0:
        raise DataError(
            f"the input holds {len(stream)} bytes, fewer than one record of seq_len + 1 = {width} "
            "tokens; give more text or a smaller --seq-len"
        )
    return np.frombuffer(stream[: count * width], dtype=np.uint8).reshape(count, width)


def write_shards(records: np.ndarray, output_dir: str | Path, num_shards: int,
                 sources: Sequence[str]) -> dict:
    """Writes the records round-robin into `num_shards` ArrayRecord files plus metadata.json."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise DataError(f"num_shards={num_shards} must be >= 1")
    if num_shards > len(records):
        raise DataError(f"num_shards={num_shards} exceeds the {len(records)} records; every shard "
                        "needs at least one record")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for shard in range(num_shards):
        name = f"data-{shard:05d}-of-{num_shards:05d}{SHARD_SUFFIX}"
        # group_size:1 keeps every record individually addressable for random access.
        writer = ArrayRecordWriter(str(out / name), "group_size:1")
        rows = records[shard::num_shards]
        for row in rows:
            writer.write(row.tobytes())
        writer.close()
        shards.append({"file": name, "num_records": int(len(rows))})
    meta = {"format": FORMAT, "seq_len": int(records.shape[1] - 1),
            "num_records": int(len(records)), "separator": SEPARATOR, "shards": shards,
            "sources": list(sources)}
    # metadata.json is written last: a directory without it is an unfinished preparation.
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(output_dir: str | Path, *, inputs: Sequence[str | Path] | None = None,
            seq_len: int = DEFAULT_SEQ_LEN, num_shards: int = 4, seed: int = 0,
            num_sentences: int = 60_000) -> dict:
    """Builds a prepared dataset in `output_dir` and returns its metadata."""
    if inputs:
        documents = read_documents(inputs)
        sources = [str(p) for p in inputs]
    else:
        documents = [generate_corpus(seed, num_sentences)]
        sources = [f"trainer.corpus.generate_corpus(seed={seed}, num_sentences={num_sentences})"]
    return write_shards(pack_records(documents, seq_len), output_dir, num_shards, sources)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--output", required=True, help="directory for the shards (local path)")
    parser.add_argument("--input", nargs="+", default=None,
                        help="text files, one document each (default: synthetic corpus)")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help=f"tokens per training sequence (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpus")
    parser.add_argument("--num-sentences", type=int, default=60_000,
                        help="size of the synthetic corpus")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.output, inputs=args.input, seq_len=args.seq_len,
                       num_shards=args.num_shards, seed=args.seed,
                       num_sentences=args.num_sentences)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {meta['num_records']} records of {meta['seq_len'] + 1} tokens in "
          f"{len(meta['shards'])} shards to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
