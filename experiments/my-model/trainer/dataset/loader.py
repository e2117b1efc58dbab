"""The train loop's data: find (or build) the prepared dataset, then feed global batch g at step g.

    info, prepared = ensure_dataset(config, run_dir)   # before compiling: errors name the path
    data = TrainData(info, config, program.batch_sharding)
    tokens = data.next_batch()        # jax.Array [global_batch_size, seq_len + 1], batch-sharded
    digest = data.digest(tokens)      # uint32 fingerprint of the whole global batch

`data.iterator` is the checkpointable `input_pipeline.DataIterator` (its state is the next global
batch index), read through Grain with `data.worker_count` worker processes. `data.path = ""` means
RUN_DIR/data, which the built-in synthetic corpus (`trainer.prepare`) fills the first time. A
data.path that the user named and that does not exist is an error naming it (a typo never trains
on synthetic data), unless `data.prepare_if_missing = true` asks for the built-in corpus there;
an existing directory is never written to, so a path that exists but holds no prepared dataset is
an error naming it.

On gs:// (every host of every slice starting at once) exactly one process prepares: the one that
creates `PREPARE_CLAIM` first; the data set is complete when `metadata.json`, written last,
exists; the others wait up to `data.prepare_wait_s`. Each host then stages the shards to local
disk (`storage.stage_files`, MD5-verified, reused on later boots): Grain's ArrayRecord reader
opens local files, and a local copy read at disk speed keeps the data order exact.

`batch_digest` (trainer.runtime.digest) is the same for global batch g whatever the mesh or the
number of processes that hold its rows; the metrics log it per step to show two runs read the
same data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import tempfile
import time
import uuid

import jax
import numpy as np
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from ..config import Config
from ..runtime.digest import batch_digest
from ..runtime.storage import create_exclusive, gcs, is_remote, read_text, stage_files, staging_dir
from ..runtime.storage import exists as storage_exists
from .input_pipeline import (
    METADATA_FILE,
    DataError,
    DatasetInfo,
    eval_batches,
    make_iterator,
    open_dataset,
    rows_for_sharding,
    to_global_array,
)

DATA_SUBDIR = "data"
PREPARE_CLAIM = ".prepare-claim"  # gs://: created (only if absent) by the one process preparing


def data_dir(config: Config, run_dir: str) -> str:
    """Where the prepared dataset lives: `data.path`, or RUN_DIR/data when that is empty."""
    if config.data.path:
        return config.data.path
    return str(epath.Path(run_dir) / DATA_SUBDIR)


def _prepare_into(target: epath.Path, seq_len: int) -> None:
    """Writes the synthetic corpus so that `target` appears complete or not at all.

    Local: staged next to `target` and renamed (the first rename of racing processes wins).
    gs://: uploaded with metadata.json last; only the caller that won the claim calls this.
    """
    from .prepare import prepare

    scratch = tempfile.mkdtemp(prefix="trainer-prepare-")
    try:
        staged = os.path.join(scratch, "data")
        prepare(staged, seq_len=seq_len)
        if not is_remote(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            local = f"{target}.tmp-{uuid.uuid4().hex}"
            shutil.copytree(staged, local)
            try:
                os.rename(local, str(target))
            except OSError:
                shutil.rmtree(local, ignore_errors=True)
            return
        names = sorted(os.listdir(staged), key=lambda name: name == METADATA_FILE)
        for name in names:  # metadata.json last: it marks the dataset as complete
            gcs().put_file(os.path.join(staged, name), f"{target}/{name}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _prepare_remote_once(path: epath.Path, config: Config) -> bool:
    """On gs://, exactly one of all racing processes prepares; the others wait for metadata.json.

    The winner is whoever creates PREPARE_CLAIM first (an `ifGenerationMatch=0` upload). Returns
    whether this process prepared the data set. Raises DataError when the wait runs out.
    """
    meta, claim = f"{path}/{METADATA_FILE}", f"{path}/{PREPARE_CLAIM}"
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
    if create_exclusive(claim, owner):
        _prepare_into(path, config.model.seq_len)
        return True
    deadline = time.monotonic() + config.data.prepare_wait_s
    polls = 0
    while not storage_exists(meta):
        if time.monotonic() > deadline:
            try:
                holder = read_text(claim)
            except OSError:
                holder = "(claim unreadable)"
            raise DataError(
                f"{path} is still not complete after waiting data.prepare_wait_s = "
                f"{config.data.prepare_wait_s} s for the process preparing it ({holder}); if "
                f"that process died, delete {claim} and restart"
            )
        if polls % 15 == 0:  # every 30 s
            print(f"[data] waiting for {meta} (being prepared by another process)", flush=True)
        time.sleep(2.0)
        polls += 1
    return False


def _stage_remote(path: epath.Path, config: Config) -> DatasetInfo:
    """Validates the gs:// data set, then copies its files to this host (ArrayRecord reads local
    files only), metadata.json last, and opens the local copy."""
    remote = open_dataset(path, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    tokenizer = [] if remote.tokenizer == "bytes" else [remote.tokenizer]
    local = staging_dir(str(path))
    stage_files([*remote.shards, *remote.eval_shards, *tokenizer, f"{path}/{METADATA_FILE}"],
                local)
    staged = open_dataset(local, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    return dataclasses.replace(staged, source=str(path))


def may_prepare(config: Config) -> bool:
    """Whether a missing data set is filled with the built-in corpus: always at RUN_DIR/data (no
    data set was named), at a named data.path only when data.prepare_if_missing asks for it."""
    return not config.data.path or config.data.prepare_if_missing


def ensure_dataset(config: Config, run_dir: str) -> tuple[DatasetInfo, bool]:
    """(opened dataset, whether this call prepared it). Raises DataError naming the path."""
    path = epath.Path(data_dir(config, run_dir))
    remote = is_remote(path)
    prepared = False
    complete = storage_exists(f"{path}/{METADATA_FILE}") if remote else path.exists()
    if not complete:
        # Objects first, then the claim: the claim is the first object a preparer writes, so
        # objects seen without a claim seen after them are not a preparation in progress.
        if remote and storage_exists(str(path)) and not storage_exists(f"{path}/{PREPARE_CLAIM}"):
            raise DataError(
                f"{path} holds objects but no {METADATA_FILE}, so it is not a prepared data "
                f"set; it exists, so it is not filled automatically. Run `python -m "
                f"trainer.prepare --output {path} --seq-len {config.model.seq_len}` or remove it"
            )
        if not may_prepare(config):
            raise DataError(
                f"data.path {path} does not exist; point data.path at a prepared data set, "
                f"prepare one there (`python -m trainer.prepare --output {path} --seq-len "
                f"{config.model.seq_len}`), or set data.prepare_if_missing=true to generate the "
                "built-in synthetic corpus there"
            )
        if remote:
            prepared = _prepare_remote_once(path, config)
        else:
            _prepare_into(path, config.model.seq_len)
            prepared = True
    elif not remote and path.is_dir() and not any(path.iterdir()):
        raise DataError(
            f"data directory {path} is empty; it exists, so it is not filled automatically. "
            f"Run `python -m trainer.prepare --output {path} --seq-len {config.model.seq_len}` "
            "or remove the directory"
        )
    if remote:
        return _stage_remote(path, config), prepared
    info = open_dataset(path, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    return info, prepared


class TrainData:
    """This process's rows of every global batch, assembled into global sharded arrays.

    With eval.num_batches > 0 it also holds the held-out batches (`eval_batch(i)`), read from
    their own shards without touching the training iterator; a data set without enough held-out
    records fails here, before compiling.
    """

    def __init__(self, info: DatasetInfo, config: Config, sharding: NamedSharding):
        self.sharding = sharding
        self.data_digest = info.digest  # which data set: recorded in every checkpoint
        self.global_batch_size = config.train.global_batch_size
        shape = (self.global_batch_size, config.model.seq_len + 1)
        self.rows = rows_for_sharding(sharding, shape)  # only these records are read here
        self.iterator = make_iterator(
            info, global_batch_size=self.global_batch_size, seed=config.train.seed,
            rows=self.rows, worker_count=config.data.worker_count,
            prefetch=config.data.prefetch)
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
        self.digest = jax.jit(batch_digest, out_shardings=replicated)
        self.eval_batch_size = config.eval_batch_size
        self.num_eval_batches = config.eval.num_batches
        self._eval = None
        if self.num_eval_batches:
            self.eval_rows = rows_for_sharding(sharding, (self.eval_batch_size,
                                                          config.model.seq_len + 1))
            self._eval = eval_batches(info, batch_size=self.eval_batch_size,
                                      num_batches=self.num_eval_batches, rows=self.eval_rows)

    def next_batch(self) -> jax.Array:
        return to_global_array(next(self.iterator), self.sharding, self.global_batch_size,
                               rows=self.rows)

    def eval_batch(self, index: int) -> jax.Array:
        """Held-out batch `index` (the same records at every evaluation), batch-sharded."""
        assert self._eval is not None, "eval.num_batches = 0"
        return to_global_array(np.asarray(self._eval[index]), self.sharding,
                               self.eval_batch_size, rows=self.eval_rows)

    def close(self) -> None:
        self.iterator.close()


# --- file-free batches for benchmarks (no dataset, no iterator state) -------------------------


@functools.lru_cache(maxsize=4)
def _corpus_array(seed: int) -> np.ndarray:
    from .corpus import generate_corpus

    return np.frombuffer(generate_corpus(seed), dtype=np.uint8)


def device_batch(step: int, config: Config, sharding: NamedSharding) -> jax.Array:
    """Random windows of the synthetic corpus as a sharded global batch, for benchmarks only."""
    corpus = _corpus_array(config.train.seed)
    width = config.model.seq_len + 1
    rng = np.random.default_rng([config.train.seed, step])
    starts = rng.integers(0, len(corpus) - width, size=config.train.global_batch_size)
    batch = corpus[starts[:, None] + np.arange(width)].astype(np.int32)
    rows = rows_for_sharding(sharding, batch.shape)
    return to_global_array(batch[list(rows)], sharding, batch.shape[0], rows=rows)
