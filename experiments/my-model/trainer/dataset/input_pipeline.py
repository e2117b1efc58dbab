"""Token batches from ArrayRecord shards, in an order fixed by the seed and the global batch index.

The data order is defined once, globally, and never depends on how many processes read it:

    record_order = MapDataset.source(shards).shuffle(seed).repeat()      # reshuffled each epoch
    global batch g = record_order[g*B : (g+1)*B]                          # B = global_batch_size

Each process reads only its own rows of every global batch: a contiguous block [start, stop)
(`process_rows`: p*B/P .. (p+1)*B/P for process p of P) or any sorted set of row indices (taken
from the batch sharding with `rows_for_sharding`; a mesh such as ici_data > 1 with dcn_fsdp > 1
gives each process several separate blocks). The rows of all processes together make global batch
g whatever P is, so the complete iterator state is "the next global batch index".
Resume on the same topology is exact, and resuming with a different number of processes (say after
losing a slice) continues with the same global batches.

Public API (everything a train loop needs):

    info = open_dataset(data_dir, seq_len=cfg.model.seq_len)       # validates files, before compile
    rows = rows_for_sharding(batch_sharding, (B, seq_len + 1))   # sorted global row indices
    it = make_iterator(info, global_batch_size=B, seed=seed, rows=rows, worker_count=0)
    local_tokens = next(it)                        # np.int32 [len(rows), seq_len+1]
    tokens = to_global_array(local_tokens, batch_sharding, B, rows=rows)  # jax.Array [B, L+1]

    # or a contiguous block: start, stop = process_rows(B, p, P)
    it = make_iterator(info, global_batch_size=B, seed=seed, row_start=start, row_stop=stop)
    it.get_state() / it.set_state(state)           # JSON-able dict, Grain's DatasetIterator API

`DataIterator` is a `grain.DatasetIterator`, so `grain.checkpoint.CheckpointSave/Restore` can store
it directly; `trainer.runtime.checkpoint` stores it with its own handler that also restores onto a
different process count. Each row holds seq_len+1 tokens: inputs are row[:-1], targets row[1:].
The shard format is written by `trainer.prepare`: `metadata.json` records the token dtype
(uint8, uint16 or uint32), the vocabulary size and the tokenizer, and the held-out `eval_shards`
that `eval_batch` reads in file order (no shuffle, no state: evaluation never moves the training
data order).

This module imports only numpy, grain and etils at import time (jax inside functions), because
Grain worker processes (`worker_count > 0`) import it to rebuild the pipeline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np
from etils import epath

from .format import FORMATS, METADATA_FILE, TOKEN_DTYPES, DataError

STATE_VERSION = 1


@dataclass(frozen=True)
class DatasetInfo:
    """A prepared dataset: its shard files and the fixed record length (seq_len + 1 tokens)."""

    data_dir: str
    shards: tuple[str, ...]
    num_records: int
    seq_len: int
    token_dtype: str = "uint8"
    vocab_size: int = 256
    tokenizer: str = "bytes"  # bytes, or the tokenizer file in data_dir
    eval_shards: tuple[str, ...] = ()
    source: str = ""  # the gs:// data set that data_dir is this host's copy of ("" if local)
    eval_num_records: int = 0
    # sha256 of metadata.json, which lists every shard with its own sha256: which data set this
    # is, recorded in every checkpoint so that a resume on other data is refused.
    digest: str = ""

    @property
    def record_length(self) -> int:
        return self.seq_len + 1

    def eval_split(self) -> DatasetInfo:
        """The held-out split as a dataset of its own (for `local_batches(shuffle=False)`)."""
        return dataclasses.replace(self, shards=self.eval_shards,
                                   num_records=self.eval_num_records, eval_shards=(),
                                   eval_num_records=0)


def reprepare_command(meta: dict, seq_len: int) -> str:
    """The command that prepared this data set (metadata.json's `command`), with --seq-len
    changed and --overwrite added; a generic one for a data set that does not record it."""
    import shlex

    recorded = meta.get("command")
    try:
        words = shlex.split(recorded) if isinstance(recorded, str) and recorded else []
    except ValueError:
        words = []
    if not words:
        return f"python -m trainer.prepare --output DIR --seq-len {seq_len}"
    own, rest = (words[:words.index("--")], words[words.index("--"):]) if "--" in words else (
        words, [])
    if "--seq-len" in own[:-1]:
        own[own.index("--seq-len") + 1] = str(seq_len)
    else:
        own = [w for w in own if not w.startswith("--seq-len=")] + ["--seq-len", str(seq_len)]
    if "--overwrite" not in words:
        own.append("--overwrite")
    return shlex.join(own + rest)


def open_dataset(data_dir: str | epath.PathLike, *, seq_len: int | None = None,
                 vocab_size: int | None = None) -> DatasetInfo:
    """Reads `metadata.json` of a prepared dataset and checks every shard exists and has records.

    Raises DataError naming the offending path (missing directory, missing or empty shard), the
    mismatching seq_len, or a model vocabulary (`vocab_size`) smaller than the data's. Call it
    before compiling anything so a bad data path fails in seconds.
    """
    root = epath.Path(data_dir)
    meta_path = root / METADATA_FILE
    if not root.exists():
        raise DataError(
            f"data directory {root} does not exist; create it with "
            f"`python -m trainer.prepare --output {root}`"
        )
    if not meta_path.exists():
        raise DataError(
            f"{meta_path} is missing, so {root} is not a prepared dataset; "
            f"create one with `python -m trainer.prepare --output {root}`"
        )
    try:
        meta_text = meta_path.read_text()
        meta = json.loads(meta_text)
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} holds a JSON {type(meta).__name__}, not an object; "
                        f"prepare the data set again (`python -m trainer.prepare --output {root}`)")
    for field in ("format", "seq_len", "shards"):
        if field not in meta:
            raise DataError(f"{meta_path} lacks the field {field!r}; prepare the data set again "
                            f"(`python -m trainer.prepare --output {root}`)")
    if meta.get("format") not in FORMATS:
        raise DataError(
            f"{meta_path} has format {meta.get('format')!r}; this trainer reads "
            f"{', '.join(repr(f) for f in FORMATS)}"
        )
    data_seq_len = int(meta["seq_len"])
    if seq_len is not None and data_seq_len != seq_len:
        raise DataError(
            f"{root} holds records of seq_len={data_seq_len} tokens (+1 target), but the model "
            f"expects seq_len={seq_len}; prepare it again with `{reprepare_command(meta, seq_len)}`"
            f" or set model.seq_len={data_seq_len}"
        )
    token_dtype = meta.get("token_dtype", "uint8")
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"{meta_path} has token_dtype {token_dtype!r}; allowed "
                        f"{', '.join(TOKEN_DTYPES)}")
    data_vocab = int(meta.get("vocab_size", 256))
    tokenizer = meta.get("tokenizer", {"kind": "bytes"})
    tokenizer_name = ("bytes" if tokenizer.get("kind") == "bytes"
                      else str(root / tokenizer.get("file", "?")))
    if vocab_size is not None and vocab_size < data_vocab:
        raise DataError(
            f"model.vocab_size = {vocab_size} is smaller than the vocabulary of {root} "
            f"({data_vocab} tokens, tokenizer {tokenizer_name}): token ids up to {data_vocab - 1} "
            f"would index past the embedding; set model.vocab_size >= {data_vocab}"
        )

    def listed(key: str) -> tuple[tuple[str, ...], int]:
        paths, total = [], 0
        for entry in meta.get(key, []):
            path = root / entry["file"]
            check_shard(path)
            paths.append(str(path))
            total += int(entry["num_records"])
        return tuple(paths), total

    shards, total = listed("shards")
    if not shards or total == 0:
        raise DataError(f"{root} lists no records in {meta_path}; prepare it again with more text")
    eval_shards, eval_total = listed("eval_shards")
    return DatasetInfo(data_dir=str(root), shards=shards, num_records=total,
                       seq_len=data_seq_len, token_dtype=token_dtype, vocab_size=data_vocab,
                       tokenizer=tokenizer_name, eval_shards=eval_shards,
                       eval_num_records=eval_total,
                       digest=hashlib.sha256(meta_text.encode()).hexdigest())


def check_shard(path: epath.PathLike) -> None:
    """Raises DataError naming `path` if the shard file is missing or empty."""
    path = epath.Path(path)
    if not path.exists():
        raise DataError(f"data shard {path} does not exist")
    if path.is_dir():
        raise DataError(f"data shard {path} is a directory; expected an ArrayRecord file")
    if path.stat().length == 0:
        raise DataError(f"data shard {path} is empty (0 bytes)")


def process_rows(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """Rows [start, stop) of each global batch that process `process_index` of P reads."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(
            f"process_index={process_index} must be in [0, process_count={process_count})"
        )
    if global_batch_size % process_count:
        raise DataError(
            f"global_batch_size={global_batch_size} is not divisible by the number of processes "
            f"({process_count}); use a multiple of {process_count}"
        )
    per_process = global_batch_size // process_count
    return process_index * per_process, (process_index + 1) * per_process


def rows_for_sharding(sharding: Any, global_shape: Sequence[int]) -> tuple[int, ...]:
    """The sorted batch rows that this process's devices hold under `sharding`.

    Reading exactly these rows (`make_iterator(rows=...)`) is what `to_global_array(rows=...)`
    needs. They need not be contiguous: a mesh may give a process several separate row blocks.
    """
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        start, stop, _ = index[0].indices(global_shape[0]) if index else (0, global_shape[0], 1)
        rows.update(range(start, stop))
    if not rows:
        raise DataError(f"this process holds no rows of a batch of shape {tuple(global_shape)}")
    return tuple(sorted(rows))


def _check_rows(rows: Sequence[int], global_batch_size: int) -> tuple[int, ...]:
    rows = tuple(int(r) for r in rows)
    if (not rows or list(rows) != sorted(set(rows)) or rows[0] < 0
            or rows[-1] >= global_batch_size):
        shown = list(rows) if len(rows) <= 16 else f"{list(rows[:16])}..."
        raise DataError(
            f"rows {shown} are not a non-empty, strictly increasing set of row indices of a "
            f"global batch of {global_batch_size} rows (allowed: 0..{global_batch_size - 1})"
        )
    return rows


def _rows_from(global_batch_size: int, row_start: int | None, row_stop: int | None,
               rows: Sequence[int] | None) -> tuple[int, ...]:
    if rows is not None:
        if row_start is not None or row_stop is not None:
            raise DataError("give either rows or row_start/row_stop, not both")
        return _check_rows(rows, global_batch_size)
    if row_start is None or row_stop is None:
        raise DataError("give the rows to read: rows=..., or both row_start and row_stop")
    if not 0 <= row_start < row_stop <= global_batch_size:
        raise DataError(
            f"rows [{row_start}, {row_stop}) are not a non-empty part of a global batch of "
            f"{global_batch_size} rows"
        )
    return tuple(range(row_start, row_stop))


class _ProcessRowsMapDataset(grain.MapDataset):
    """Element i is global row rows[i % n] of global batch (i // n), n = len(rows)."""

    def __init__(self, parent: grain.MapDataset, global_batch_size: int, rows: tuple[int, ...]):
        super().__init__(parent)
        self._global_batch_size = global_batch_size
        self._rows = rows

    def __len__(self) -> int:
        return (len(self._parent) // self._global_batch_size) * len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        batch, position = divmod(index, len(self._rows))
        return self._parent[batch * self._global_batch_size + self._rows[position]]

    def __str__(self) -> str:
        rows = self._rows
        shown = (f"[{rows[0]}, {rows[-1] + 1})" if rows[-1] - rows[0] + 1 == len(rows)
                 else str(list(rows)))
        return f"_ProcessRowsMapDataset(global_batch_size={self._global_batch_size}, rows={shown})"


class _DecodeRecord(grain.transforms.Map):
    def __init__(self, record_length: int, token_dtype: str = "uint8"):
        self._record_length = record_length
        self._dtype = np.dtype(token_dtype)

    def map(self, record: bytes) -> np.ndarray:
        tokens = np.frombuffer(record, dtype=self._dtype)
        if tokens.shape[0] != self._record_length:
            raise DataError(
                f"a record holds {tokens.shape[0]} tokens, expected {self._record_length} "
                "(seq_len + 1); the shards were not written by this trainer.prepare version"
            )
        return tokens.astype(np.int32)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:160] or type(exc).__name__


REPREPARE = "prepare the data set again (python -m trainer.prepare --overwrite)"


def shard_problem(shard: str | epath.PathLike, want: int | None = None) -> str | None:
    """Why a local ArrayRecord shard cannot be used (it does not open, or holds another number
    of records than `want`), or None; gs:// shards are checked for presence and size only."""
    if str(shard).startswith("gs://"):
        return None
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(shard))
        try:
            have = reader.num_records()
        finally:
            reader.close()
    except Exception as exc:  # noqa: BLE001 - riegeli reports a cut file as RuntimeError
        return (f"data shard {shard} cannot be read ({_first_line(exc)}): the file is "
                f"truncated or not an ArrayRecord file; {REPREPARE}")
    if want is not None and have != want:
        return (f"data shard {shard} holds {have} records but metadata.json lists {want}: the "
                f"file is truncated or from another preparation; {REPREPARE}")
    return None


def changed_shards(info: DatasetInfo) -> list[str]:
    """The local shards whose sha256 differs from the one metadata.json records."""
    try:
        meta = json.loads((epath.Path(info.data_dir) / METADATA_FILE).read_text())
        recorded = {e["file"]: e.get("sha256") for key in ("shards", "eval_shards")
                    for e in meta.get(key, [])}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    changed = []
    for shard in (*info.shards, *info.eval_shards):
        want = recorded.get(epath.Path(shard).name)
        if want and not str(shard).startswith("gs://"):
            with open(shard, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != want:
                    changed.append(str(shard))
    return changed


def local_batches(info: DatasetInfo, *, global_batch_size: int, seed: int,
                  row_start: int | None = None, row_stop: int | None = None,
                  rows: Sequence[int] | None = None, shuffle: bool = True) -> grain.MapDataset:
    """MapDataset whose element g is this process's rows of global batch g (np.int32 [n, L+1]).

    The rows are either `rows` (sorted global row indices) or the block [row_start, row_stop).
    `shuffle=False` keeps the records in file order and does not repeat them (the eval split).
    """
    selected = _rows_from(global_batch_size, row_start, row_stop, rows)
    if not 0 <= seed < 2**32:
        raise DataError(f"seed={seed} must be in [0, 2**32)")
    try:
        source = grain.sources.ArrayRecordDataSource(list(info.shards))
    except Exception as exc:  # noqa: BLE001 - riegeli reports a cut or foreign file as RuntimeError
        for shard in info.shards:
            if (problem := shard_problem(shard)) is not None:
                raise DataError(problem) from None
        raise DataError(f"the shards in {info.data_dir} cannot be opened "
                        f"({_first_line(exc)}); prepare the data again") from None
    if len(source) != info.num_records:
        raise DataError(
            f"the shards in {info.data_dir} hold {len(source)} records but {METADATA_FILE} says "
            f"{info.num_records}; prepare the data again"
        )
    # Grain reshuffles epoch e with seed + e, so seed s would replay seed s+1 one epoch late;
    # spreading the seeds apart makes such overlaps need about a million epochs.
    shuffle_seed = (seed * 1_000_003 + 0x5EED) % 2**32
    order = grain.MapDataset.source(source)
    if shuffle:
        order = order.shuffle(seed=shuffle_seed).repeat()
    mine = _ProcessRowsMapDataset(order, global_batch_size, selected)
    return mine.map(_DecodeRecord(info.record_length, info.token_dtype)).batch(len(selected))


def eval_batches(info: DatasetInfo, *, batch_size: int, num_batches: int,
                 rows: Sequence[int]) -> grain.MapDataset:
    """Element i: this process's rows of held-out batch i (records i*B .. (i+1)*B - 1 in order).

    Raises DataError (before compiling) when the data set has no eval split or too few records.
    """
    needed = batch_size * num_batches
    if not info.eval_shards:
        raise DataError(
            f"{info.data_dir} has no held-out split (eval_shards in {METADATA_FILE}) but "
            f"eval.num_batches = {num_batches}; prepare it again with `python -m trainer.prepare "
            "--eval-fraction F` or set eval.num_batches = 0"
        )
    if info.eval_num_records < needed:
        raise DataError(
            f"the held-out split of {info.source or info.data_dir} has {info.eval_num_records} "
            f"records, fewer than eval.num_batches x eval batch = {num_batches} x {batch_size} = "
            f"{needed}; lower them or prepare with a larger --eval-fraction"
        )
    return local_batches(info.eval_split(), global_batch_size=batch_size, seed=0, rows=rows,
                         shuffle=False)


class DataIterator(grain.DatasetIterator):
    """Iterates local batches from a given global batch index; its state is that index.

    get_state() -> {"version", "next_global_batch", "seed", "global_batch_size", "seq_len"}.
    set_state() accepts a state saved by any number of processes, and refuses one whose seed,
    global batch size or seq_len differ from this pipeline's (the index would mean other data).
    """

    def __init__(self, dataset: grain.MapDataset, *, seed: int, global_batch_size: int,
                 seq_len: int, worker_count: int, prefetch: int, next_global_batch: int = 0,
                 info: DatasetInfo | None = None):
        super().__init__()
        self._info = info  # to name a corrupt shard when a read fails
        if worker_count < 0:
            raise DataError(f"worker_count={worker_count} must be >= 0 (0 = read in-process)")
        self._dataset = dataset
        self._seed = seed
        self._global_batch_size = global_batch_size
        self._seq_len = seq_len
        self._worker_count = worker_count
        self._prefetch = prefetch
        self._next = next_global_batch
        self._inner: grain.DatasetIterator | None = None

    @property
    def next_global_batch(self) -> int:
        return self._next

    def _start(self) -> grain.DatasetIterator:
        ds = self._dataset[self._next:]
        if self._worker_count == 0:
            it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        else:
            _mark_absl_flags_parsed()
            it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self._worker_count, per_worker_buffer_size=max(1, self._prefetch)))
        return iter(it_ds)

    def __next__(self) -> np.ndarray:
        if self._inner is None:
            self._inner = self._start()
        # A plain copy: worker batches arrive in shared memory that Grain frees with the view.
        try:
            batch = np.array(next(self._inner))
        except (StopIteration, DataError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - a record that cannot be read or decoded
            # the same data fails the same way after any restart: a data error, not a crash
            changed = changed_shards(self._info) if self._info is not None else []
            which = (f"data shard {', '.join(changed)} differs from the sha256 metadata.json "
                     "records (corrupt or changed after preparation)" if changed else
                     "a shard is corrupt or was changed after preparation")
            raise DataError(f"reading global batch {self._next} of the data set failed "
                            f"({type(exc).__name__}: {_first_line(exc)[:80]}): {which}; "
                            f"{REPREPARE}") from None
        self._next += 1
        return batch

    def start_prefetch(self) -> None:
        if self._inner is None:
            self._inner = self._start()

    def get_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "next_global_batch": self._next, "seed": self._seed,
                "global_batch_size": self._global_batch_size, "seq_len": self._seq_len}

    def set_state(self, state: dict[str, Any]) -> None:
        mine = self.get_state()
        for key in ("version", "seed", "global_batch_size", "seq_len"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"the saved data iterator state has {key}={state.get(key)!r} but this run "
                    f"has {key}={mine[key]!r}; resuming would read different data. Keep "
                    f"{key} unchanged when resuming, or start a new run directory"
                )
        next_batch = state["next_global_batch"]
        if not isinstance(next_batch, int) or next_batch < 0:
            raise DataError(f"next_global_batch={next_batch!r} in the saved state is not an "
                            "index >= 0")
        self._close_inner()
        self._next = next_batch

    def _close_inner(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None

    def close(self) -> None:
        self._close_inner()
        super().close()

    def __str__(self) -> str:
        return f"DataIterator(next_global_batch={self._next}, workers={self._worker_count})"


def _mark_absl_flags_parsed() -> None:
    # Grain's worker start-up reads an absl flag; outside an absl app nothing parses flags, and
    # reading one raises UnparsedFlagAccessError. Defaults are what we want.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_iterator(info: DatasetInfo, *, global_batch_size: int, seed: int,
                  row_start: int | None = None, row_stop: int | None = None,
                  rows: Sequence[int] | None = None, worker_count: int = 0, prefetch: int = 2,
                  next_global_batch: int = 0) -> DataIterator:
    """An iterator of this process's rows of global batches g, g+1, ...

    The rows are `rows` (sorted global row indices, e.g. from `rows_for_sharding`) or the block
    [row_start, row_stop); only those records are read.

    worker_count=0 reads in the calling thread; worker_count>0 decodes in that many Grain worker
    processes (same batches, same order).
    """
    dataset = local_batches(info, global_batch_size=global_batch_size, seed=seed,
                            row_start=row_start, row_stop=row_stop, rows=rows)
    return DataIterator(dataset, seed=seed, global_batch_size=global_batch_size,
                        seq_len=info.seq_len, worker_count=worker_count, prefetch=prefetch,
                        next_global_batch=next_global_batch, info=info)


def to_global_array(local_batch: np.ndarray, sharding: Any, global_batch_size: int, *,
                    rows: Sequence[int] | None = None) -> Any:
    """Assembles every process's local rows into one global jax.Array [global_batch_size, ...].

    `local_batch[i]` is global row `rows[i]` (`rows` as given to `make_iterator`); without
    `rows` the local batch is this process's contiguous block, in process order.
    """
    import jax

    global_shape = (global_batch_size, *local_batch.shape[1:])
    if rows is None:
        return jax.make_array_from_process_local_data(sharding, local_batch, global_shape)
    rows = np.asarray(rows)
    if local_batch.shape[0] != len(rows):
        raise DataError(f"the local batch has {local_batch.shape[0]} rows but {len(rows)} row "
                        "indices were given")

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        # Each addressable device asks for a block of global rows (and maybe of columns).
        wanted = np.arange(*index[0].indices(global_batch_size)) if index else rows
        positions = np.searchsorted(rows, wanted)
        if positions.size and (positions.max() >= len(rows)
                               or not np.array_equal(rows[positions], wanted)):
            raise DataError(f"a device of this process needs batch rows {wanted.tolist()}, "
                            f"which are not among the rows read here ({rows.tolist()})")
        return local_batch[(positions, *index[1:])]

    return jax.make_array_from_callback(global_shape, sharding, shard)
