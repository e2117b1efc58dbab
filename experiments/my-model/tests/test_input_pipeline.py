"""The data order depends only on (seed, global batch index); state and errors behave."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from trainer.dataset import input_pipeline as dp
from trainer.dataset.prepare import write_shards

SEQ_LEN = 7
NUM_RECORDS = 40
GLOBAL_BATCH = 8


def _numbered_records(count: int, seq_len: int) -> np.ndarray:
    """Record i starts with the two bytes of i, so a batch row tells which record it is."""
    records = np.zeros((count, seq_len + 1), dtype=np.uint8)
    records[:, 0] = np.arange(count) // 256
    records[:, 1] = np.arange(count) % 256
    records[:, 2:] = (np.arange(count)[:, None] * 7 + np.arange(seq_len - 1)) % 256
    return records


def _ids(batch: np.ndarray) -> list[int]:
    return (batch[:, 0] * 256 + batch[:, 1]).tolist()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> dp.DatasetInfo:
    out = tmp_path_factory.mktemp("data")
    write_shards(_numbered_records(NUM_RECORDS, SEQ_LEN), out, num_shards=3, sources=["test"])
    return dp.open_dataset(out, seq_len=SEQ_LEN)


def _iterator(info: dp.DatasetInfo, process: int = 0, processes: int = 1, seed: int = 0,
              **kwargs) -> dp.DataIterator:
    start, stop = dp.process_rows(GLOBAL_BATCH, process, processes)
    return dp.make_iterator(info, global_batch_size=GLOBAL_BATCH, seed=seed, row_start=start,
                            row_stop=stop, **kwargs)


def _global_batches(info: dp.DatasetInfo, processes: int, count: int, seed: int = 0) -> list:
    iterators = [_iterator(info, p, processes, seed) for p in range(processes)]
    return [np.concatenate([next(it) for it in iterators]) for _ in range(count)]


def test_global_batches_are_identical_for_1_2_and_4_processes(dataset):
    # 12 batches of 8 cross two epoch boundaries of the 40 records.
    one = _global_batches(dataset, 1, 12)
    for processes in (2, 4):
        other = _global_batches(dataset, processes, 12)
        for g, (a, b) in enumerate(zip(one, other, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"global batch {g}, {processes} processes")


def test_each_process_reads_its_contiguous_rows_of_the_global_batch(dataset):
    whole = next(_iterator(dataset))
    quarter = next(_iterator(dataset, process=2, processes=4))
    assert quarter.shape == (2, SEQ_LEN + 1)
    np.testing.assert_array_equal(quarter, whole[4:6])


def test_interleaved_row_sets_read_exactly_their_rows_of_each_global_batch(dataset):
    whole = _iterator(dataset)
    halves = [dp.make_iterator(dataset, global_batch_size=GLOBAL_BATCH, seed=0, rows=rows)
              for rows in ((0, 1, 4, 5), (2, 3, 6, 7))]
    for g in range(6):  # crosses an epoch boundary
        batch = next(whole)
        for rows, it in zip(((0, 1, 4, 5), (2, 3, 6, 7)), halves, strict=True):
            np.testing.assert_array_equal(next(it), batch[list(rows)], err_msg=f"batch {g}")


def test_a_process_indexes_only_the_records_of_its_rows():
    order = grain.MapDataset.range(100)  # element i is record-order position i
    mine = dp._ProcessRowsMapDataset(order, global_batch_size=8, rows=(1, 2, 6))
    assert len(mine) == 12 * 3
    assert [mine[i] for i in range(6)] == [1, 2, 6, 9, 10, 14]


@pytest.mark.parametrize("rows", [(), (3, 1), (1, 1), (-1, 2), (2, 8)])
def test_bad_row_sets_are_rejected_with_the_allowed_range(dataset, rows):
    with pytest.raises(dp.DataError, match=r"allowed: 0\.\.7"):
        dp.make_iterator(dataset, global_batch_size=GLOBAL_BATCH, seed=0, rows=rows)


def test_every_epoch_visits_each_record_once_in_a_new_order(dataset):
    batches = _global_batches(dataset, 1, 2 * NUM_RECORDS // GLOBAL_BATCH)
    ids = [i for b in batches for i in _ids(b)]
    first, second = ids[:NUM_RECORDS], ids[NUM_RECORDS:]
    assert sorted(first) == list(range(NUM_RECORDS))
    assert sorted(second) == list(range(NUM_RECORDS))
    assert first != second
    assert first != sorted(first)


def test_batches_hold_int32_tokens_of_seq_len_plus_one(dataset):
    batch = next(_iterator(dataset))
    assert batch.dtype == np.int32
    assert batch.shape == (GLOBAL_BATCH, SEQ_LEN + 1)
    records = _numbered_records(NUM_RECORDS, SEQ_LEN)
    np.testing.assert_array_equal(batch, records[_ids(batch)])


def test_different_seeds_give_different_orders(dataset):
    a = _global_batches(dataset, 1, 3, seed=0)
    b = _global_batches(dataset, 1, 3, seed=1)
    assert [_ids(x) for x in a] != [_ids(x) for x in b]
    assert [_ids(x) for x in a] == [_ids(x) for x in _global_batches(dataset, 1, 3, seed=0)]


def test_next_seed_does_not_replay_the_next_epoch(dataset):
    per_epoch = NUM_RECORDS // GLOBAL_BATCH
    seed0 = _global_batches(dataset, 1, 2 * per_epoch, seed=0)[per_epoch:]
    seed1 = _global_batches(dataset, 1, per_epoch, seed=1)
    assert [_ids(x) for x in seed0] != [_ids(x) for x in seed1]


def test_restored_state_continues_exactly(dataset):
    it = _iterator(dataset)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    assert state["next_global_batch"] == 5

    resumed = _iterator(dataset)
    next(resumed)  # a fresh iterator that already moved must be repositioned, not continued
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


def test_state_saved_by_one_process_resumes_on_two(dataset):
    single = _iterator(dataset)
    for _ in range(3):
        next(single)
    state = single.get_state()
    expected = [next(single) for _ in range(3)]

    halves = [_iterator(dataset, p, 2) for p in range(2)]
    for it in halves:
        it.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(np.concatenate([next(it) for it in halves]), want)


@pytest.mark.parametrize("key,value", [("seed", 5), ("global_batch_size", 16), ("seq_len", 9)])
def test_set_state_refuses_a_state_of_other_data(dataset, key, value):
    state = _iterator(dataset).get_state() | {key: value}
    with pytest.raises(dp.DataError, match=key):
        _iterator(dataset).set_state(state)


def test_grain_checkpoint_handler_saves_and_restores_the_iterator(dataset, tmp_path):
    it = _iterator(dataset)
    next(it)
    next(it)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(tmp_path, args=grain.checkpoint.CheckpointSave(it))
    expected = next(it)

    target = _iterator(dataset)
    restored = handler.restore(tmp_path, args=grain.checkpoint.CheckpointRestore(target))
    assert restored.next_global_batch == 2
    np.testing.assert_array_equal(next(restored), expected)


@pytest.mark.slow
def test_worker_processes_give_the_same_batches_as_in_process(dataset):
    in_process = _iterator(dataset)
    workers = _iterator(dataset, worker_count=2)
    try:
        for g in range(6):
            np.testing.assert_array_equal(next(workers), next(in_process), err_msg=f"batch {g}")
        state = workers.get_state()
    finally:
        workers.close()
    assert state["next_global_batch"] == 6


def test_rows_for_sharding_and_global_array_cover_the_batch(dataset):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    batch_size = 2 * len(jax.devices())
    rows = dp.rows_for_sharding(sharding, (batch_size, SEQ_LEN + 1))
    assert rows == tuple(range(batch_size))  # one process holds every row
    local = np.arange(batch_size * (SEQ_LEN + 1), dtype=np.int32).reshape(batch_size, -1)
    for arr in (dp.to_global_array(local, sharding, batch_size),
                dp.to_global_array(local, sharding, batch_size, rows=rows)):
        assert arr.shape == (batch_size, SEQ_LEN + 1)
        assert arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), local)


def test_global_array_from_rows_puts_each_row_on_the_device_that_holds_it():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    sharding = NamedSharding(Mesh(devices, ("a", "b", "c")), PartitionSpec(("b", "a"), "c"))
    local = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    arr = dp.to_global_array(local, sharding, 8, rows=range(8))
    np.testing.assert_array_equal(np.asarray(arr), local)
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), local[shard.index])
    with pytest.raises(dp.DataError, match=r"needs batch rows \[0, 1\]"):
        dp.to_global_array(local[2:], sharding, 8, rows=range(2, 8))


def test_indivisible_global_batch_is_rejected_with_the_numbers():
    with pytest.raises(dp.DataError, match=r"global_batch_size=10 .* \(4\)"):
        dp.process_rows(10, 0, 4)


def test_missing_data_directory_error_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(dp.DataError, match=str(missing)):
        dp.open_dataset(missing)


def test_directory_without_metadata_error_names_the_file(tmp_path):
    with pytest.raises(dp.DataError, match="metadata.json is missing"):
        dp.open_dataset(tmp_path)


def _copy_dataset(info: dp.DatasetInfo, dest) -> list:
    import shutil

    shutil.copytree(info.data_dir, dest)
    return sorted(dest.glob("*.array_record"))


def test_missing_shard_error_names_the_path(dataset, tmp_path):
    shards = _copy_dataset(dataset, tmp_path / "d")
    shards[1].unlink()
    with pytest.raises(dp.DataError, match=f"{shards[1]} does not exist"):
        dp.open_dataset(tmp_path / "d")


def test_empty_shard_error_names_the_path(dataset, tmp_path):
    shards = _copy_dataset(dataset, tmp_path / "d")
    shards[0].write_bytes(b"")
    with pytest.raises(dp.DataError, match=f"{shards[0]} is empty"):
        dp.open_dataset(tmp_path / "d")


def test_seq_len_mismatch_names_both_lengths(dataset):
    with pytest.raises(dp.DataError, match=f"seq_len={SEQ_LEN} .* seq_len=32"):
        dp.open_dataset(dataset.data_dir, seq_len=32)
