"""The local checkpoint tier: every host keeps its part of recent training positions on its own
storage, and a restart restores from it, or from a surviving slice's copy, before the bucket.

Every `checkpoint.local_every` steps each process writes its *part* of the training position:
the bytes of the state shards its devices hold (one copy of each), with the step, the loop's RNG
key, the data iterator's state and the identity of what wrote it (run directory, model, mesh
layout, process place). The device-to-host copy blocks the loop; the file writes run on a thread
of their own. A part is written into `tmp-step_N-PID/` and renamed to `step_N/` once its
`part.json` (written last, with the payload's CRC-32) is on disk: a part that is not renamed, or
whose payload does not match its CRC, is never restored. `local_max_to_keep` parts are kept.

Slices are data-parallel replicas: process r of every slice holds the same shards (its *twins*)
when no axis shards the state across slices. At every start the processes agree (one all-gather)
on the newest step that is complete somewhere, every place in a slice having at least one twin
that holds it; when it is at least as new as the bucket's newest, they restore it: each process
from its own part, and a process whose storage lost it (a recreated VM, a rescheduled pod) from
a twin's, sent over the network training uses (one cross-slice max-reduction of the part's bytes,
exact on unsigned integers). Nothing is read from the bucket then. When the state is sharded
across slices, twins hold different shards: the tier still restores a job whose every process
kept its own part, and otherwise falls back to the bucket.

The directory is MULTISLICE_LOCAL_CHECKPOINT_DIR (set by the launchers: the TPU VM's own disk,
the node's directory of a GKE pod, RUN_DIR/local/slice-I under `multislice local`), else
RUN_DIR/local/process-P for a run directory on local disk. A directory that cannot be made or
written turns the tier off with one warning; the run goes on with the bucket tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .checkpoint import gather_ints, rng_from_json, rng_to_json

LOCAL_DIR_ENV = "MULTISLICE_LOCAL_CHECKPOINT_DIR"
FORMAT = 1
PART_FILE = "part.json"
PAYLOAD_FILE = "state.bin"
_NO_STEP = -1
# How many of its newest parts a process offers at a restart (the ones max_to_keep keeps).
_OFFERED = 4


@dataclasses.dataclass(frozen=True)
class LocalRestore:
    step: int
    state: Any
    rng: jax.Array
    restore_s: float
    source: str  # "local" (this process's own part) or "peer" (a twin's, over the network)
    bytes_read: int
    data_digest: str = ""
    skipped_steps: tuple[int, ...] = ()
    # Seconds of each part of it on this process: agreeing on the step (listing, all-gathers),
    # reading its own part (and its CRC), receiving a peer's, placing the arrays on the devices.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop)
                 for d, s in enumerate(index))


def _entries(tree: Any) -> tuple[list[tuple[int, tuple[tuple[int, int], ...]]], str]:
    """(leaf, shard index) of one copy of each shard this process's devices hold, in a fixed
    order, and the layout's digest (tree structure, shapes, dtypes, shardings' indices)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    entries = []
    described = [str(treedef)]
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        keys = sorted({_index_key(idx, shape) for idx in
                       leaf.sharding.addressable_devices_indices_map(shape).values()})
        entries.extend((i, key) for key in keys)
        described.append(f"{i}:{shape}:{jax.numpy.dtype(leaf.dtype).name}:{keys}")
    return entries, hashlib.sha256("\n".join(described).encode()).hexdigest()


def part_bytes(tree: Any) -> int:
    """Bytes of one copy of each shard this process's devices hold (what a part holds, and what
    a restore from the bucket reads)."""
    leaves = jax.tree_util.tree_leaves(tree)
    total = 0
    for leaf_index, key in _entries(tree)[0]:
        count = int(np.prod([hi - lo for lo, hi in key], dtype=np.int64))
        total += count * jax.numpy.dtype(leaves[leaf_index].dtype).itemsize
    return total


def _place() -> tuple[int, int]:
    """(slice, place in the slice) of this process: its twins share the second number."""
    from ..mesh import slice_of

    own = slice_of(jax.local_devices()[0])
    peers = sorted({d.process_index for d in jax.devices() if slice_of(d) == own})
    return own, peers.index(jax.process_index())


def default_directory(run_dir: str) -> str | None:
    """Where this process keeps its parts: the launcher's directory, else beside a local run."""
    if os.environ.get(LOCAL_DIR_ENV):
        return os.environ[LOCAL_DIR_ENV]
    if "://" in run_dir:
        return None
    return str(Path(run_dir) / "local" / f"process-{jax.process_index()}")


TIER_MARKER = ".multislice-local-tier"  # in each run's directory: the run it holds parts of


class LocalTier:
    """One process's parts under `directory`/RUN_KEY (RUN_KEY: a digest of the run directory)."""

    def __init__(self, directory: str, *, run_dir: str, every: int, max_to_keep: int,
                 model: dict[str, Any], data_digest: str, say: Callable[[str], None],
                 off_because: str | None = None):
        self.every = every
        self.max_to_keep = max_to_keep
        self.say = say
        self.run_dir = run_dir
        self.model_digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()
        self.data_digest = data_digest
        self.root = Path(directory)
        self.dir = self.root / hashlib.sha256(run_dir.encode()).hexdigest()[:16]
        self.enabled = True
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._place: tuple[int, int] | None = None
        if off_because is not None:
            self._off(off_because)
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / TIER_MARKER).write_text(run_dir)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            self._off(f"cannot write {self.dir} ({exc.strerror or exc})")
            return
        self._clean()

    def _off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            self.say(f"warning: local checkpoint tier off: {why}; the run goes on with the "
                     "bucket tier only (checkpoint.save_interval_steps)")

    def _clean(self) -> None:
        """Leftovers of saves that were cut short, and other runs' parts (this directory holds
        one run's: a new run on the host frees the space). Only what a tier wrote goes: a
        directory it is pointed at may hold someone's own files."""
        for entry in self.root.iterdir():
            if entry.is_dir() and entry != self.dir and (entry / TIER_MARKER).is_file():
                shutil.rmtree(entry, ignore_errors=True)
        for entry in self.dir.iterdir():
            if entry.name.startswith("tmp-") or entry.name.startswith(".probe-"):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()

    # --- saving ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def save(self, step: int, state: Any, rng: jax.Array, data_state: dict[str, Any]) -> float:
        """Copies this process's shards to host memory (the blocking part, returned in seconds)
        and writes them on a thread; waits first for the previous write, if still running."""
        if not self.enabled:
            return 0.0
        start = time.perf_counter()
        self.wait()
        if not self.enabled:
            return time.perf_counter() - start
        entries, layout = _entries(state)
        leaves = jax.tree_util.tree_leaves(state)
        for leaf in leaves:
            for shard in leaf.addressable_shards:
                shard.data.copy_to_host_async()
        arrays: dict[tuple[int, tuple[tuple[int, int], ...]], np.ndarray] = {}
        for i, leaf in enumerate(leaves):
            shape = tuple(leaf.shape)
            for shard in leaf.addressable_shards:
                key = (i, _index_key(shard.index, shape))
                if key not in arrays:
                    arrays[key] = np.array(shard.data, copy=True)
        meta = {"format": FORMAT, "step": int(step), "run_dir": self.run_dir,
                "model": self.model_digest, "data_digest": self.data_digest, "layout": layout,
                "rng": rng_to_json(rng), "data_state": data_state, **self._identity()}
        chunks = [arrays[key] for key in entries]
        self._writer = threading.Thread(target=self._write, args=(step, meta, chunks),
                                        name="local-checkpoint", daemon=True)
        self._writer.start()
        return time.perf_counter() - start

    def _where(self) -> tuple[int, int]:
        if self._place is None:
            self._place = _place()
        return self._place

    def _identity(self) -> dict[str, Any]:
        slice_index, place = self._where()
        return {"process_count": jax.process_count(), "slice": slice_index, "place": place,
                "process": jax.process_index()}

    def _write(self, step: int, meta: dict[str, Any], chunks: list[np.ndarray]) -> None:
        tmp = self.dir / f"tmp-step_{step}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            crc, size = 0, 0
            with open(tmp / PAYLOAD_FILE, "wb") as out:
                for chunk in chunks:
                    data = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
                    out.write(data)
                    crc = zlib.crc32(data, crc)
                    size += data.size
                out.flush()
                os.fsync(out.fileno())
            meta = {**meta, "nbytes": size, "crc32": crc,
                    "shapes": [list(c.shape) for c in chunks],
                    "dtypes": [c.dtype.name for c in chunks]}
            with open(tmp / PART_FILE, "w") as out:
                json.dump(meta, out)
                out.flush()
                os.fsync(out.fileno())
            final = self.dir / f"step_{step}"
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for old in self.steps()[self.max_to_keep:]:
                shutil.rmtree(self.dir / f"step_{old}", ignore_errors=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the loop's thread (wait)
            shutil.rmtree(tmp, ignore_errors=True)
            self._write_error = exc

    def wait(self) -> None:
        """Until the write in flight is on disk; a failed write turns the tier off."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            exc, self._write_error = self._write_error, None
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._off(f"writing to {self.dir} failed ({text})")

    # --- listing and reading ---------------------------------------------------------------

    def steps(self) -> list[int]:
        """Renamed (complete) parts, newest first."""
        found = []
        for entry in self.dir.iterdir() if self.dir.is_dir() else ():
            if entry.name.startswith("step_") and entry.name[5:].isdigit():
                found.append(int(entry.name[5:]))
        return sorted(found, reverse=True)

    def _part(self, step: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / f"step_{step}" / PART_FILE).read_text())
        except (OSError, ValueError):
            return None

    def usable(self, layout: str) -> list[int]:
        """Parts this process may restore: this run, model, data, layout and place."""
        if not self.enabled:
            return []
        # Not the slice: a part of this place is a twin's, whichever slice wrote it.
        # Nor the process count: an elastic job that lost a slice restores the survivors' own
        # parts, whose shards (the layout) are what the smaller job's processes hold.
        want = {"format": FORMAT, "run_dir": self.run_dir, "model": self.model_digest,
                "data_digest": self.data_digest, "layout": layout, "place": self._where()[1]}
        good = []
        for step in self.steps():
            part = self._part(step)
            differs = [k for k, v in want.items() if part is None or part.get(k) != v]
            if differs:
                self.say(f"local checkpoint step {step} in {self.dir} is not this run's "
                         f"({', '.join(differs) or 'unreadable'} differ); not restored")
                continue
            good.append(step)
        return good

    def read(self, step: int) -> bytes | None:
        """This process's part of `step` as one blob (header, part.json, payload); None (with
        one line) when it is missing, short or fails its CRC."""
        folder = self.dir / f"step_{step}"
        part = self._part(step)
        try:
            payload = (folder / PAYLOAD_FILE).read_bytes()
        except OSError as exc:
            payload, part = b"", None if part is None else {**part, "error": str(exc)}
        if part is None or len(payload) != part.get("nbytes") or \
                zlib.crc32(payload) != part.get("crc32"):
            self.say(f"local checkpoint step {step} in {folder} is partial or corrupt; falling "
                     "back to the next tier")
            return None
        header = json.dumps(part).encode()
        return struct.pack("<Q", len(header)) + header + payload

    # --- restoring --------------------------------------------------------------------------

    def restore(self, abstract_state: Any, data_iterator: Any, bucket_newest: int | None
                ) -> LocalRestore | None:
        """Collective. The newest step complete in the local tier (own parts and twins'), if
        at least as new as `bucket_newest`, restored into `abstract_state`; None: use the
        bucket. Every process returns the same kind of answer for the same step."""
        start = time.perf_counter()
        entries, layout = _entries(abstract_state)
        slice_index, place = self._where()
        offered = (self.usable(layout) + [_NO_STEP] * _OFFERED)[:_OFFERED]
        layout_word = int(layout[:7], 16)
        table = gather_ints([slice_index, place, layout_word,
                              _NO_STEP if bucket_newest is None else bucket_newest, *offered])
        floor = max(row[3] for row in table)  # the bucket's newest, as any process lists it
        me = jax.process_index()
        phases = {"agree_s": time.perf_counter() - start, "read_s": 0.0}
        for _attempt in range(_OFFERED * 2):
            plan = _plan(table, floor)
            if plan is None:
                return None
            step, sources = plan
            t0 = time.perf_counter()
            blob = self.read(step) if sources[me] == me else None
            phases["read_s"] += time.perf_counter() - t0
            ok = blob is not None or sources[me] != me
            agreed = gather_ints([step, int(ok)])
            failed = [p for p, row in enumerate(agreed) if not row[1]]
            if not failed:
                break
            for p in failed:  # drop the part that could not be read, and plan again
                table[p] = [*table[p][:4], *[s if s != step else _NO_STEP for s in table[p][4:]]]
        else:
            return None
        need_peer = any(sources[p] != p for p in range(len(sources)))
        source = "local"
        t0 = time.perf_counter()
        if need_peer:
            received = _exchange(blob if sources[me] == me else None, sources, table)
            if sources[me] != me:
                blob, source = received, "peer"
            phases["exchange_s"] = time.perf_counter() - t0
        assert blob is not None
        t0 = time.perf_counter()
        (length,) = struct.unpack_from("<Q", blob)
        part = json.loads(blob[8:8 + length])
        payload = memoryview(blob)[8 + length:]
        state = _assemble(abstract_state, entries, part, payload)
        jax.block_until_ready(state)
        phases["place_s"] = time.perf_counter() - t0
        data_iterator.set_state(part["data_state"])
        return LocalRestore(step=step, state=state, rng=rng_from_json(part["rng"]),
                            restore_s=time.perf_counter() - start, source=source,
                            bytes_read=len(payload), data_digest=str(part["data_digest"]),
                            phases=phases)

    def drop_newer_than(self, step: int) -> None:
        """Parts newer than the step a run resumes from belong to a path it will recompute."""
        for newer in self.steps():
            if newer > step:
                shutil.rmtree(self.dir / f"step_{newer}", ignore_errors=True)

    def close(self) -> None:
        self.wait()


def _plan(table: list[list[int]], floor: int) -> tuple[int, list[int]] | None:
    """(step, source process of each process) for the newest step >= floor that every place
    has: a process's own part, else its lowest-numbered twin's with the same layout."""
    steps = sorted({s for row in table for s in row[4:] if s != _NO_STEP}, reverse=True)
    for step in steps:
        if step < floor:
            return None
        sources = []
        for p, row in enumerate(table):
            place, layout = row[1], row[2]
            if step in row[4:]:
                sources.append(p)
                continue
            twins = [q for q, other in enumerate(table)
                     if other[1] == place and other[2] == layout and step in other[4:]]
            if not twins:
                break
            sources.append(twins[0])
        else:
            return step, sources
    return None


def _exchange(blob: bytes | None, sources: list[int], table: list[list[int]]) -> bytes:
    """Every process's twin source sends its blob; returns the blob of this process's place.
    A mesh of (slice, place, local device) and a max over slices of each place's bytes (the
    sources' bytes, zeros elsewhere): exact, and a collective over the slices' network."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    me = jax.process_index()
    places = sorted({row[1] for row in table})
    slices = sorted({row[0] for row in table})
    local = len(jax.local_devices())
    mine_len = len(blob) if blob is not None else 0
    lengths = [(hi << 31) + lo for hi, lo in gather_ints([mine_len >> 31, mine_len & 0x7FFFFFFF])]
    width = max(lengths)
    words = -(-width // (4 * local)) * local  # uint32 words, a multiple of the local devices
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    grid = np.empty((len(slices), len(places), local), dtype=object)
    for p, row in enumerate(table):
        grid[slices.index(row[0]), places.index(row[1])] = sorted(by_process[p], key=lambda d: d.id)
    mesh = Mesh(grid, ("slice", "place", "local"))
    sending = blob is not None and any(sources[p] == me and p != me for p in range(len(sources)))
    buffer = np.zeros(words * 4, dtype=np.uint8)
    if sending:
        buffer[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    buffer = buffer.view(np.uint32)
    sharding = NamedSharding(mesh, PartitionSpec("slice", "place", "local"))
    shape = (len(slices), len(places), words)
    per_device = words // local
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        lo = index[2].start or 0
        arrays.append(jax.device_put(buffer[lo:lo + per_device][None, None, :], device))
    stacked = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    out = jax.jit(lambda x: x.max(axis=0),
                  out_shardings=NamedSharding(mesh, PartitionSpec("place", "local")))(stacked)
    mine = places.index(table[me][1])
    received = np.zeros(words, dtype=np.uint32)
    for shard in out.addressable_shards:
        rows, cols = shard.index
        if (rows.start or 0) == mine:
            lo = cols.start or 0
            received[lo:lo + per_device] = np.asarray(shard.data)[0]
    size = lengths[sources[me]]
    return received.view(np.uint8)[:size].tobytes()


def _assemble(abstract_state: Any, entries: list[tuple[int, tuple[tuple[int, int], ...]]],
              part: dict[str, Any], payload: memoryview) -> Any:
    """The state's arrays in `abstract_state`'s shardings from a part's payload."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract_state)
    pieces: dict[tuple[int, tuple[tuple[int, int], ...]], np.ndarray] = {}
    offset = 0
    for (leaf_index, key), shape, dtype in zip(entries, part["shapes"], part["dtypes"],
                                               strict=True):
        dt = jax.numpy.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        pieces[(leaf_index, key)] = np.frombuffer(payload, dtype=dt, count=count,
                                                  offset=offset).reshape(shape)
        offset += count * dt.itemsize
    out = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        out.append(jax.make_array_from_callback(
            shape, leaf.sharding,
            lambda idx, i=i, shape=shape: pieces[(i, _index_key(idx, shape))]))
    return jax.tree_util.tree_unflatten(treedef, out)
