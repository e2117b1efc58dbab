"""The whole training position in one Orbax CheckpointManager under RUN_DIR/checkpoints.

Each checkpoint step directory holds one composite item:

    state/   the train state pytree of sharded jax.Arrays (StandardSave)
    data/    the data iterator state, one JSON file per process (Grain's process_I-of-N.json)
    meta/    JSON: step, the RNG key (key data + implementation), format version

API for the train loop:

    ckpt = Checkpointer(run_dir, save_interval_steps=100, max_to_keep=3)   # local path or gs://
    restored = ckpt.restore_latest(abstract_state, data_iterator)          # None: fresh start
    if restored: state, rng, step = restored.state, restored.rng, restored.step
    ...
    info = ckpt.save(step, state, data_iterator, rng)     # saves when step is on the interval
    info.saved, info.blocking_s                           # blocking_s: time the loop waited
    ckpt.save(final_step, state, data_iterator, rng, force=True)   # on completion / preemption
    ckpt.close()                                          # waits for the async write to finish

`abstract_state` is a pytree of jax.ShapeDtypeStruct carrying the *target* shardings (e.g.
`jax.eval_shape` of the init plus the shardings of the current mesh); the arrays are restored
straight into them, so a checkpoint written on one mesh is resharded onto another. The data
iterator is restored in place (`set_state`); a state written by a different number of processes
is accepted because it only holds the next global batch index.

Incomplete checkpoints are never picked: Orbax writes each step into a temporary directory
(`<step>.orbax-checkpoint-tmp-*`) and renames it on local disk, or writes a commit marker on GCS,
only once every item of every process is complete, and lists only finished steps; leftover
temporary directories are removed when the Checkpointer is created. If the newest finished step
cannot be read (a truncated or deleted file), `restore_latest` logs a warning naming it and the
step it falls back to, and deletes the unreadable newer steps so that they can be saved again.
In a multi-process job the processes agree after every attempt (an all-gather of "could I read
it"), so a file that only one host fails to read makes all of them fall back to the same step.

"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
META_VERSION = 1


class CheckpointMismatch(RuntimeError):
    """The run directory's checkpoints were written by another model (shapes or structure)."""


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored; the message names the steps and the errors."""


# --- the data iterator item ------------------------------------------------------------------


def brief_error(exc: BaseException, limit: int = 500) -> str:
    """`Type: message` of an exception and of its root cause, each cut to its first line.

    Orbax's read errors embed the whole TensorStore spec (hundreds of lines per array) and name
    the real problem (a checksum, a missing file) only in their cause.
    """
    def first_line(e: BaseException) -> str:
        text = str(e).split(" See full TensorStore details", 1)[0].strip()
        text = text.splitlines()[0] if text else ""
        return f"{type(e).__name__}: {text}"[:limit]

    root = exc
    while root.__cause__ is not None or (root.__context__ is not None
                                         and not root.__suppress_context__):
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    if root is exc:
        return first_line(exc)
    return f"{first_line(exc)} (caused by {first_line(root)})"


class _LoopThatFinishesItsReads(asyncio.SelectorEventLoop):
    """Closes only after every task it started has finished.

    Orbax runs a restore as one `asyncio.gather` on a fresh loop that it closes as soon as the
    gather raises. The sibling reads are still in flight inside TensorStore; when they complete,
    their callbacks find a closed loop, and each prints `RuntimeError: Event loop is closed` and an
    unretrieved exception with the array's full spec: thousands of lines after one corrupt
    checkpoint. Waiting for them (their outcome is already decided by the first failure) and
    retrieving their exceptions ends the restore cleanly.
    """

    DRAIN_TIMEOUT_S = 120.0

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=self.DRAIN_TIMEOUT_S))
            for task in pending:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a sibling's failure, reported by the first
        super().close()


class _LoopsThatFinishTheirReads(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _LoopThatFinishesItsReads()


@contextlib.contextmanager
def _loops_that_finish_their_reads() -> Iterator[None]:
    """Every event loop made inside (Orbax makes one per restore) drains its tasks on close."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_LoopsThatFinishTheirReads())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


def _state_file(directory: epath.Path, index: int, count: int) -> epath.Path:
    return directory / f"process_{index}-of-{count}.json"


class DataIteratorHandler(ocp.AsyncCheckpointHandler):
    """Saves `iterator.get_state()` per process in Grain's file layout; restores elastically.

    The state is captured when the save starts and written in the background commit. On restore
    this process reads its own `process_I-of-N.json`; if the checkpoint was written by another
    number of processes it reads process 0's file (every process holds the same global batch
    index), which is what lets a run resume on fewer or more slices.
    """

    async def async_save(self, directory: epath.Path, args: DataIteratorSave) -> list[Any]:
        state = json.dumps(args.item.get_state(), indent=2)
        path = _state_file(directory, jax.process_index(), jax.process_count())

        async def write() -> None:
            path.write_text(state)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_save")]

    def save(self, directory: epath.Path, args: DataIteratorSave) -> None:
        path = _state_file(directory, jax.process_index(), jax.process_count())
        path.write_text(json.dumps(args.item.get_state(), indent=2))

    def restore(self, directory: epath.Path, args: DataIteratorRestore) -> Any:
        own = _state_file(directory, jax.process_index(), jax.process_count())
        if own.exists():
            path = own
        else:
            written = sorted(directory.glob("process_0-of-*.json"))
            if not written:
                raise FileNotFoundError(f"no data iterator state in {directory}")
            path = written[0]
        args.item.set_state(json.loads(path.read_text()))
        return args.item

    def metadata(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    item: Any


# --- RNG key <-> JSON -------------------------------------------------------------------------


def rng_to_json(key: jax.Array) -> dict[str, Any]:
    """A typed key (jax.random.key) or a raw uint32 key (jax.random.PRNGKey) as JSON."""
    if isinstance(key, jax.Array) and not key.is_fully_addressable:
        key = key.addressable_data(0)  # replicated across processes: any local copy is the key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"typed": True, "impl": str(jax.random.key_impl(key)),
                "data": np.asarray(jax.random.key_data(key)).tolist()}
    return {"typed": False, "impl": None, "data": np.asarray(key).tolist()}


def rng_from_json(value: dict[str, Any]) -> jax.Array:
    data = np.asarray(value["data"], dtype=np.uint32)
    if value["typed"]:
        return jax.random.wrap_key_data(data, impl=value["impl"])
    return jax.numpy.asarray(data)


def gather_ints(values: list[int]) -> list[list[int]]:
    """Every process's `values` (same length everywhere), in process order; a collective."""
    row = np.asarray(values, dtype=np.int32)
    if jax.process_count() == 1:
        return [row.tolist()]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).tolist()


# --- the manager ------------------------------------------------------------------------------


class _CheckpointManager(ocp.CheckpointManager):
    """Orbax's CheckpointManager that never asks JAX's preemption sync point itself.

    JAX's protocol (`multihost_utils.reached_preemption_sync_point`) takes each process's last
    step id as its position and wants one call per training step; Orbax's manager also asks it,
    in `should_save`, in `save` and from its finalize thread, for the step being saved, which
    can be an older one than the loop's. The train loop's PreemptionGuard is the one caller and
    saves the sync-point step itself (`force=True`); here the answer is always "no", so
    `should_save` keeps only its interval policy and Orbax's logs and metrics no preemption."""

    def reached_preemption(self, step: int) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    step: int
    saved: bool
    blocking_s: float  # wall time the caller was blocked (device-to-host copy, previous save)


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    rng: jax.Array
    restore_s: float
    skipped_steps: tuple[int, ...]  # newer steps that could not be read
    data_digest: str = ""  # the data set it was trained on ("" in checkpoints older than that)


class Checkpointer:
    """One Orbax CheckpointManager over RUN_DIR/checkpoints (local path or gs://)."""

    def __init__(self, run_dir: str | os.PathLike, *, save_interval_steps: int,
                 max_to_keep: int | None, async_save: bool = True):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps={save_interval_steps} must be >= 1")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 (or None to keep all)")
        self.directory = epath.Path(run_dir) / CHECKPOINT_SUBDIR
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of saves that were killed mid-write
        )
        self._manager = _CheckpointManager(self.directory, options=options)
        self._state_handler = ocp.StandardCheckpointHandler()
        self._save_started: float | None = None
        self.last_save_s: float | None = None  # start to commit of the newest finished save

    def poll(self) -> None:
        """Notes when the save in flight committed (cheap: call it at every step)."""
        if self._save_started is not None and not self._manager.is_saving_in_progress():
            self.last_save_s = time.perf_counter() - self._save_started
            self._save_started = None

    def all_steps(self) -> list[int]:
        """Finished checkpoint steps, oldest first (incomplete ones are never listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, data_iterator: Any, rng: jax.Array, *,
             force: bool = False, data_digest: str = "",
             model: dict[str, Any] | None = None) -> SaveInfo:
        """Starts an async save of this step if it is on the interval (or `force`)."""
        start = time.perf_counter()
        if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
            return SaveInfo(step=step, saved=False, blocking_s=0.0)
        # `model`: the model config the state was built from, so a deployer's preview can tell
        # that a new config would not restore this run (docs/CONTRACTS.md, checkpoints).
        meta = {"version": META_VERSION, "step": int(step), "rng": rng_to_json(rng),
                **({"data_digest": data_digest} if data_digest else {}),
                **({"model": model} if model is not None else {})}
        self.poll()
        self._save_started = time.perf_counter()
        saved = self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=DataIteratorSave(data_iterator),
            meta=ocp.args.JsonSave(meta),
        ), force=force)
        if not saved:
            self._save_started = None
        return SaveInfo(step=step, saved=bool(saved), blocking_s=time.perf_counter() - start)

    def restore_latest(self, abstract_state: Any, data_iterator: Any) -> Restored | None:
        """Restores the newest checkpoint that every process can read, into `abstract_state`.

        Collective: every process must call it. The processes try the steps newest first and
        agree after each attempt, so all of them restore the same step even when only one host
        fails to read a file. Returns None (and logs it) when there is no checkpoint. Falls back
        to older steps, with a warning naming both, when the newest is unreadable somewhere, then
        deletes the unreadable newer steps; raises CheckpointError if no step is readable.
        """
        steps = self.all_steps()
        views = gather_ints([steps[-1] if steps else -1, len(steps)])
        if len({tuple(v) for v in views}) > 1:
            seen = "; ".join(f"process {p}: newest {v[0]}, {v[1]} step(s)"
                             for p, v in enumerate(views))
            raise CheckpointError(f"the processes list different checkpoints in "
                                  f"{self.directory} ({seen}); they must share one directory")
        if not steps:
            log.info("no checkpoint in %s; starting fresh", self.directory)
            return None
        self._check_same_model(steps[-1], abstract_state)
        start = time.perf_counter()
        failures: list[tuple[int, str]] = []
        for i, step in enumerate(reversed(steps)):
            error = None
            try:
                out = self._restore_step(step, abstract_state, data_iterator)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint means "try older"
                error = brief_error(e)
            ok = gather_ints([step, error is None])
            if any(row[0] != step for row in ok):
                raise CheckpointError(f"the processes tried different checkpoint steps "
                                      f"{[int(row[0]) for row in ok]} in {self.directory}")
            bad_on = [p for p, row in enumerate(ok) if not row[1]]
            if bad_on:
                failures.append((step, error or f"unreadable on process(es) {bad_on}"))
                older = steps[-i - 2] if i + 1 < len(steps) else None
                log.warning("checkpoint step %d in %s is unreadable on process(es) %s%s; %s",
                            step, self.directory, bad_on, f" ({error})" if error else "",
                            f"falling back to step {older}" if older is not None
                            else "no older checkpoint is left")
                continue
            meta = out["meta"]
            if meta.get("step") != step:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} records "
                                      f"step {meta.get('step')} in its meta item")
            for bad, _ in failures:
                # Training resumes before these steps and saves them again; Orbax never
                # overwrites an existing step, so the unreadable ones must go. Every process
                # calls delete (it holds a barrier); only Orbax's primary host removes files.
                log.warning("deleting unreadable checkpoint step %d in %s", bad, self.directory)
                self._manager.delete(bad)
            return Restored(step=step, state=out["state"], rng=rng_from_json(meta["rng"]),
                            restore_s=time.perf_counter() - start,
                            skipped_steps=tuple(s for s, _ in failures),
                            data_digest=str(meta.get("data_digest", "")))
        details = "; ".join(f"step {s}: {err}" for s, err in failures)
        raise CheckpointError(
            f"none of the checkpoints {steps} in {self.directory} could be restored ({details}); "
            "if the model or mesh config changed, use a new run directory"
        )

    def _check_same_model(self, step: int, abstract_state: Any) -> None:
        """CheckpointMismatch, naming the first difference, when the newest checkpoint holds
        other arrays than this model's train state (a changed shape, layer or optimizer). Read
        from the checkpoint's metadata only; nothing is restored, deleted or overwritten."""
        try:
            with _loops_that_finish_their_reads():
                meta = self._state_handler.metadata(self.directory / str(step) / "state")
        except Exception:  # noqa: BLE001 - unreadable metadata: restore_latest's fallback decides
            return
        tree = getattr(meta, "tree", meta)

        def name(key: Any) -> str:  # dict key, index or attribute alike: Orbax stores
            for attr in ("key", "idx", "name"):  # named tuples and dataclasses as dicts
                if hasattr(key, attr):
                    return str(getattr(key, attr))
            return str(key)

        def by_path(pytree: Any) -> dict[str, tuple[int, ...]]:
            leaves = jax.tree_util.tree_flatten_with_path(pytree)[0]
            return {"/".join(map(name, path)): tuple(getattr(leaf, "shape", ()) or ())
                    for path, leaf in leaves}

        saved, wanted = by_path(tree), by_path(abstract_state)
        fix = (f"the checkpoints in {self.directory} are left as they are; start a new run for "
               "this model (a new multislice:run_name on a stack, or another --run-dir)")
        for path in sorted(saved.keys() | wanted.keys()):
            if path not in saved or path not in wanted:
                where = "only in the checkpoint" if path not in wanted else "only in the model"
                raise CheckpointMismatch(f"checkpoint step {step} was written by another model: "
                                         f"{path} is {where}; {fix}")
            if saved[path] != wanted[path]:
                raise CheckpointMismatch(f"checkpoint step {step} was written by another model: "
                                         f"{path} has shape {saved[path]} there and "
                                         f"{wanted[path]} now; {fix}")

    def _restore_step(self, step: int, abstract_state: Any, data_iterator: Any) -> dict[str, Any]:
        # The items are read with their handlers directly rather than CheckpointManager.restore:
        # that one ends in a cross-process barrier which a process that failed to read never
        # reaches, leaving the others waiting there while it waits in the agreement above.
        step_dir = self.directory / str(step)
        if not step_dir.is_dir():
            raise FileNotFoundError(f"checkpoint step directory {step_dir} does not exist")
        with _loops_that_finish_their_reads():
            return self._read_items(step_dir, abstract_state, data_iterator)

    def _read_items(self, step_dir: epath.Path, abstract_state: Any,
                    data_iterator: Any) -> dict[str, Any]:
        return {
            "state": self._state_handler.restore(
                step_dir / "state", args=ocp.args.StandardRestore(abstract_state)),
            "data": DataIteratorHandler().restore(
                step_dir / "data", DataIteratorRestore(data_iterator)),
            "meta": ocp.JsonCheckpointHandler().restore(
                step_dir / "meta", args=ocp.args.JsonRestore()),
        }

    def wait_until_finished(self) -> float:
        """Blocks until the in-flight save is committed; returns the seconds waited."""
        start = time.perf_counter()
        self._manager.wait_until_finished()
        self.poll()
        return time.perf_counter() - start

    def close(self) -> None:
        self._manager.close()
        self._state_handler.close()
