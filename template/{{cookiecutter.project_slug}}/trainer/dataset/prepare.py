"""Prepare training data: text files -> ArrayRecord shards of fixed-length token records.

    python -m trainer.prepare --output data/ [--input a.txt b.txt ...] [--seq-len 128]
                              [--tokenizer bytes | bpe | PATH/tokenizer.json] [--vocab-size N]
                              [--eval-fraction 0.05] [--num-shards 4] [--seed 0]

Every input file is one document. Each document is tokenized, the token streams are joined with
a separator token, and the stream is cut into records of seq_len + 1 tokens (inputs are the
first seq_len, targets the last seq_len); the incomplete tail is dropped. The last
`--eval-fraction` of the records is the held-out split (`eval-*.array_record`), the rest is dealt
round-robin into `data-SSSSS-of-NNNNN.array_record`; `metadata.json`, written last, records the
token dtype, the vocabulary size and the tokenizer, and `trainer.dataset.input_pipeline` checks
it on open.

Tokenizers:
    bytes        (default) token = byte, vocabulary 256, separator 0; nothing to download
    bpe          a byte-level BPE of `--vocab-size` tokens trained here on the input with
                 Hugging Face `tokenizers` (nothing is downloaded); saved as tokenizer.json
    FILE.json    an existing Hugging Face tokenizer file (copied next to the shards)

Token ids are stored as uint8, uint16 or uint32, the smallest that holds the vocabulary. Without
`--input` the deterministic synthetic corpus of `trainer.dataset.corpus` is used, so the demo
needs no download. The output directory must be a local path (the ArrayRecord writer opens local
files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus import generate_corpus
from .format import FORMAT, METADATA_FILE, SHARD_SUFFIX, DataError

SEPARATOR = 0
DEFAULT_SEQ_LEN = 128
DEFAULT_EVAL_FRACTION = 0.05
TOKENIZER_FILE = "tokenizer.json"
SEPARATOR_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


@dataclass(frozen=True)
class TokenizerChoice:
    """How documents become token ids, and what the metadata says about it."""

    kind: str  # bytes | huggingface
    vocab_size: int
    separator: int
    hf: object | None = None  # tokenizers.Tokenizer

    @classmethod
    def byte_level(cls) -> TokenizerChoice:
        """Token = byte: vocabulary 256, separator 0 (the zero-download default)."""
        return cls("bytes", 256, SEPARATOR)

    def encode(self, document: bytes) -> np.ndarray:
        if self.hf is None:
            return np.frombuffer(document, dtype=np.uint8)
        return np.asarray(self.hf.encode(document.decode("utf-8")).ids, dtype=np.int64)

    @property
    def token_dtype(self) -> str:
        if self.vocab_size <= 2**8:
            return "uint8"
        return "uint16" if self.vocab_size <= 2**16 else "uint32"


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


def _decode_all(documents: Sequence[bytes]) -> list[str]:
    texts = []
    for index, document in enumerate(documents):
        try:
            texts.append(document.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"document {index} is not UTF-8 text ({e}); a subword tokenizer "
                            "reads text, use --tokenizer bytes for binary input") from None
    return texts


def _separator_of(tokenizer, given: str | None, source: str) -> int:
    candidates = (given,) if given else SEPARATOR_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise DataError(f"the tokenizer {source} has none of the separator tokens "
                    f"{', '.join(candidates)}; name one with --separator-token")


MAX_BPE_VOCAB = 2**20


def train_bpe(documents: Sequence[bytes], vocab_size: int, separator_token: str | None = None):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on the documents, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = separator_token or SEPARATOR_CANDIDATES[0]
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least "
                        f"{len(alphabet) + 1} tokens (256 bytes + the separator)")
    if vocab_size > MAX_BPE_VOCAB:
        # Bounded here: the tokenizers library reserves the whole vocabulary up front and
        # aborts the process (no Python exception) when it cannot.
        raise DataError(f"--vocab-size {vocab_size:,}: at most {MAX_BPE_VOCAB:,} tokens (the "
                        "largest vocabularies in use are about 256k)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(_decode_all(documents), trainer)
    return tokenizer


def check_tokenizer_args(spec: str, vocab_size: int | None) -> None:
    """What can be told from the arguments alone, before any input is read (seconds for a big
    corpus): a vocabulary the tokenizer cannot have, a BPE without one, a missing file."""
    if spec == "bytes":
        if vocab_size not in (None, 256):
            raise DataError(f"--vocab-size {vocab_size}: the bytes tokenizer has 256 tokens")
    elif spec == "bpe":
        if vocab_size is None:
            raise DataError("--tokenizer bpe needs --vocab-size N (e.g. 8192)")
        if not 257 <= vocab_size <= MAX_BPE_VOCAB:
            raise DataError(f"--vocab-size {vocab_size:,}: a byte-level BPE needs at least 257 "
                            f"tokens (256 bytes + the separator) and at most {MAX_BPE_VOCAB:,}")
    elif not Path(spec).is_file():
        raise DataError(f"--tokenizer {spec}: not 'bytes', 'bpe' or an existing tokenizer "
                        "file (a Hugging Face tokenizer.json)")


def choose_tokenizer(spec: str, documents: Sequence[bytes], *, vocab_size: int | None = None,
                     separator_token: str | None = None) -> TokenizerChoice:
    """`bytes`, `bpe` (trained on `documents`) or the path of a tokenizer.json file."""
    if spec == "bytes":
        if vocab_size not in (None, 256):
            raise DataError(f"--vocab-size {vocab_size}: the bytes tokenizer has 256 tokens")
        return TokenizerChoice.byte_level()
    if spec == "bpe":
        if vocab_size is None:
            raise DataError("--tokenizer bpe needs --vocab-size N (e.g. 8192)")
        tokenizer = train_bpe(documents, vocab_size, separator_token)
        source = "trained here"
    else:
        from tokenizers import Tokenizer

        path = Path(spec)
        if not path.is_file():
            raise DataError(f"--tokenizer {spec}: not 'bytes', 'bpe' or an existing tokenizer "
                            "file (a Hugging Face tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise DataError(f"--tokenizer {spec}: not a Hugging Face tokenizer file "
                            f"({e})") from None
        source = str(path)
    separator = _separator_of(tokenizer, separator_token, source)
    return TokenizerChoice("huggingface", int(tokenizer.get_vocab_size()), separator, tokenizer)


def pack_records(documents: Sequence[bytes], seq_len: int,
                 tokenizer: TokenizerChoice | None = None) -> np.ndarray:
    """[num_records, seq_len + 1]: the tokenized documents joined by the separator, cut."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    tokenizer = tokenizer or TokenizerChoice.byte_level()
    dtype = np.dtype(tokenizer.token_dtype)
    pieces: list[np.ndarray] = []
    for index, document in enumerate(documents):
        if index:
            pieces.append(np.asarray([tokenizer.separator], dtype=dtype))
        pieces.append(tokenizer.encode(document).astype(dtype))
    stream = np.concatenate(pieces) if pieces else np.zeros((0,), dtype)
    width = seq_len + 1
    count = len(stream) // width
    if count == 0:
        unit = "bytes" if tokenizer.kind == "bytes" else "tokens"
        raise DataError(
            f"the input holds {len(stream)} {unit}, fewer than one record of seq_len + 1 = "
            f"{width} tokens; give more text or a smaller --seq-len"
        )
    return stream[: count * width].reshape(count, width)


def _write_shard_set(records: np.ndarray, out: Path, prefix: str, num_shards: int) -> list[dict]:
    from array_record.python.array_record_module import ArrayRecordWriter

    shards = []
    for shard in range(num_shards):
        name = f"{prefix}-{shard:05d}-of-{num_shards:05d}{SHARD_SUFFIX}"
        # group_size:1 keeps every record individually addressable for random access.
        writer = ArrayRecordWriter(str(out / name), "group_size:1")
        rows = records[shard::num_shards]
        for row in rows:
            writer.write(row.tobytes())
        writer.close()
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()
        shards.append({"file": name, "num_records": int(len(rows)), "sha256": digest})
    return shards


def write_shards(records: np.ndarray, output_dir: str | Path, num_shards: int,
                 sources: Sequence[str], *, eval_fraction: float = 0.0,
                 tokenizer: TokenizerChoice | None = None) -> dict:
    """Writes train and held-out ArrayRecord shards plus metadata.json (last)."""
    if num_shards < 1:
        raise DataError(f"num_shards={num_shards} must be >= 1")
    if not 0.0 <= eval_fraction < 1.0 or not math.isfinite(eval_fraction):
        raise DataError(f"eval_fraction={eval_fraction} must be in [0, 1)")
    tokenizer = tokenizer or TokenizerChoice.byte_level()
    num_eval = math.ceil(eval_fraction * len(records)) if eval_fraction else 0
    train, held_out = records[: len(records) - num_eval], records[len(records) - num_eval:]
    if num_shards > len(train):
        raise DataError(f"num_shards={num_shards} exceeds the {len(train)} training records; "
                        "every shard needs at least one record")
    out = Path(output_dir)
    check_output_dir(out, overwrite=False)  # never mixed with another data set's shards
    out.mkdir(parents=True, exist_ok=True)
    shards = _write_shard_set(train, out, "data", num_shards)
    eval_shards = (_write_shard_set(held_out, out, "eval", min(num_shards, len(held_out)))
                   if len(held_out) else [])
    if tokenizer.hf is not None:
        tokenizer.hf.save(str(out / TOKENIZER_FILE))
        digest = hashlib.sha256((out / TOKENIZER_FILE).read_bytes()).hexdigest()
        tokenizer_meta = {"kind": "huggingface", "file": TOKENIZER_FILE, "sha256": digest}
    else:
        tokenizer_meta = {"kind": "bytes"}
    meta = {"format": FORMAT, "seq_len": int(records.shape[1] - 1),
            "num_records": int(len(train)), "eval_num_records": int(len(held_out)),
            "token_dtype": tokenizer.token_dtype, "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer_meta, "separator": tokenizer.separator, "shards": shards,
            "eval_shards": eval_shards, "sources": list(sources)}
    # metadata.json is written last: a directory without it is an unfinished preparation.
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(output_dir: str | Path, *, inputs: Sequence[str | Path] | None = None,
            seq_len: int = DEFAULT_SEQ_LEN, num_shards: int = 4, seed: int = 0,
            num_sentences: int = 60_000, tokenizer: str = "bytes",
            vocab_size: int | None = None, separator_token: str | None = None,
            eval_fraction: float = DEFAULT_EVAL_FRACTION) -> dict:
    """Builds a prepared dataset in `output_dir` and returns its metadata."""
    check_tokenizer_args(tokenizer, vocab_size)
    if inputs:
        documents = read_documents(inputs)
        sources = [str(p) for p in inputs]
    else:
        documents = [generate_corpus(seed, num_sentences)]
        sources = [f"trainer.dataset.corpus.generate_corpus(seed={seed}, "
                   f"num_sentences={num_sentences})"]
    choice = choose_tokenizer(tokenizer, documents, vocab_size=vocab_size,
                              separator_token=separator_token)
    records = pack_records(documents, seq_len, choice)
    return write_shards(records, output_dir, num_shards, sources, eval_fraction=eval_fraction,
                        tokenizer=choice)


def check_output_dir(out: Path, *, overwrite: bool) -> None:
    """A data set is written only into a new or empty directory, or with overwrite: preparing
    over an existing one would mix its shards with the new ones, or change the data under a run
    that resumes on it."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} is a file, not a directory; name a new directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    foreign = sorted(set(held) - _data_set_files(out))
    if foreign:  # --overwrite removes only what a data set wrote, never a user's own files
        what = ("a prepared data set and files it did not write" if METADATA_FILE in held
                else "files that are not a prepared data set")
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                          if len(foreign) > 3 else "")
        raise DataError(f"--output {out} is not empty: it holds {what} ({shown}); nothing was "
                        "written, even with --overwrite (which replaces a prepared data set "
                        "only). Name a new directory, or move those files")
    if not overwrite:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise DataError(f"--output {out} is not empty: it holds a prepared data set ({shown}); "
                        "nothing was written. Name a new directory, or pass --overwrite to "
                        "replace it (the new data set is prepared beside it and swapped in)")


def _data_set_files(out: Path) -> set[str]:
    """The names a prepared data set in `out` wrote: its metadata.json, the shards and the
    tokenizer file it lists (nothing when there is no readable metadata.json)."""
    try:
        meta = json.loads((out / METADATA_FILE).read_text(encoding="utf-8"))
        listed = [*meta.get("shards", []), *meta.get("eval_shards", [])]
        names = {METADATA_FILE, *(str(entry["file"]) for entry in listed)}
        tokenizer = meta.get("tokenizer") or {}
        if isinstance(tokenizer, dict) and tokenizer.get("file"):
            names.add(str(tokenizer["file"]))
        return names
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return set()


def swap_in(staged: Path, out: Path) -> None:
    """Put the prepared `staged` directory at `out`, replacing what is there in two renames."""
    if not out.exists():
        os.rename(staged, out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    os.rename(out, old)
    os.rename(staged, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", allow_abbrev=False,
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="directory for the shards (local path)")
    parser.add_argument("--input", nargs="+", default=None,
                        help="text files, one document each (default: synthetic corpus)")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help=f"tokens per training sequence (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes (default), bpe (trained here), or a tokenizer.json file")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary of the BPE trained with --tokenizer bpe")
    parser.add_argument("--separator-token", default=None,
                        help="token placed between documents (default: the tokenizer's "
                             "end-of-text token)")
    parser.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION,
                        help=f"share of records held out for evaluation (default "
                             f"{DEFAULT_EVAL_FRACTION})")
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpus")
    parser.add_argument("--num-sentences", type=int, default=60_000,
                        help="size of the synthetic corpus")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --output: the new data set is prepared beside "
                             "it and swapped in, so the directory is never half old, half new")
    parser.add_argument("--command", default=None,
                        help="the command line to record in metadata.json for the hints that "
                             "tell how to prepare it again (default: this one)")
    args = parser.parse_args(argv)
    command = args.command or shlex.join(["python", "-m", "trainer.prepare",
                                          *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.output)
    staged = out.parent / f".{out.name}.preparing-{os.getpid()}"
    try:
        check_output_dir(out, overwrite=args.overwrite)
        meta = prepare(staged, inputs=args.input, seq_len=args.seq_len,
                       num_shards=args.num_shards, seed=args.seed,
                       num_sentences=args.num_sentences, tokenizer=args.tokenizer,
                       vocab_size=args.vocab_size, separator_token=args.separator_token,
                       eval_fraction=args.eval_fraction)
        meta["command"] = command  # still in the staged directory: rewritten before the swap
        (staged / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        swap_in(staged, out)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    print(f"wrote {meta['num_records']} training and {meta['eval_num_records']} held-out records "
          f"of {meta['seq_len'] + 1} {meta['token_dtype']} tokens (vocabulary "
          f"{meta['vocab_size']}) in {len(meta['shards'])} shards to {args.output}")
    if meta["vocab_size"] != 256:
        print(f"train on it with --set model.vocab_size={meta['vocab_size']} (or larger) and "
              f"--set model.seq_len={meta['seq_len']}")
    return 0

