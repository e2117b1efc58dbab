"""The local checkpoint tier on one process: exact round trip, what is never restored, the
directory that cannot be used, and the plan that picks a step and its sources across processes
(the peer transfer itself runs in the toolkit's multi-slice drills)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.runtime import local_tier as lt

RUN = "gs://bucket/runs/r"


class _Iterator:
    def __init__(self) -> None:
        self.state = {"next_global_batch": 0}

    def get_state(self) -> dict:
        return dict(self.state)

    def set_state(self, state: dict) -> None:
        self.state = dict(state)


def _shardings() -> dict:
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    return {"w": NamedSharding(mesh, PartitionSpec("fsdp", None)),  # one copy on each of 2 rows
            "b": NamedSharding(mesh, PartitionSpec()),
            "count": NamedSharding(mesh, PartitionSpec())}


def _state(step: int) -> dict:
    s = _shardings()
    w = (jnp.arange(32.0).reshape(8, 4) - 16 + step).astype(jnp.bfloat16)
    b = jnp.asarray([-0.0, 0.0, np.nan, 1e-40], jnp.float32) + 0 * step
    return {"w": jax.device_put(w, s["w"]), "b": jax.device_put(b, s["b"]),
            "count": jax.device_put(jnp.asarray(step, jnp.int32), s["count"])}


def _abstract() -> dict:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        _state(0), _shardings())


def _tier(directory: Path, lines: list[str], run: str = RUN, model: dict | None = None,
          every: int = 2, keep: int = 2) -> lt.LocalTier:
    return lt.LocalTier(str(directory), run_dir=run, every=every, max_to_keep=keep,
                        model=model or {"d_model": 8}, data_digest="d1", say=lines.append)


def _save(tier: lt.LocalTier, step: int) -> None:
    tier.save(step, _state(step), jax.random.key(step), {"next_global_batch": step})
    tier.wait()


def _bits(x: jax.Array) -> bytes:
    return np.asarray(x).tobytes()


def test_a_saved_part_restores_bit_for_bit_with_its_rng_and_data_position(tmp_path):
    lines: list[str] = []
    tier = _tier(tmp_path, lines)
    _save(tier, 4)
    iterator = _Iterator()
    got = _tier(tmp_path, lines).restore(_abstract(), iterator, bucket_newest=None)
    assert got is not None and got.step == 4 and got.source == "local"
    for name, want in _state(4).items():
        assert _bits(got.state[name]) == _bits(want), name
        assert got.state[name].sharding == _shardings()[name]
    assert iterator.state == {"next_global_batch": 4}
    assert jax.random.key_data(got.rng).tolist() == jax.random.key_data(jax.random.key(4)).tolist()
    # One copy of each shard: w's 4 row blocks (not 8), b and count once.
    assert got.bytes_read == 8 * 4 * 2 + 4 * 4 + 4 == lt.part_bytes(_abstract())
    assert lines == []


def test_only_the_newest_parts_are_kept_and_the_newest_at_least_as_new_as_the_bucket_wins(
        tmp_path):
    tier = _tier(tmp_path, [], keep=2)
    for step in (2, 4, 6):
        _save(tier, step)
    assert tier.steps() == [6, 4]
    assert tier.restore(_abstract(), _Iterator(), bucket_newest=6).step == 6  # equal: local
    assert tier.restore(_abstract(), _Iterator(), bucket_newest=8) is None  # the bucket's newer


def test_an_interrupted_save_is_never_restored_and_its_leftovers_are_cleaned(tmp_path):
    tier = _tier(tmp_path, [])
    _save(tier, 2)
    leftover = tier.dir / "tmp-step_4-123"
    leftover.mkdir()
    (leftover / lt.PAYLOAD_FILE).write_bytes(b"half")
    again = _tier(tmp_path, [])
    assert not leftover.exists()
    assert again.restore(_abstract(), _Iterator(), bucket_newest=None).step == 2


def test_another_runs_parts_are_freed_but_files_the_tier_did_not_write_are_left(tmp_path):
    _save(_tier(tmp_path, [], run="gs://bucket/runs/old"), 2)
    [old] = [p for p in tmp_path.iterdir()]
    mine = tmp_path / "0123456789abcdef"  # a name like a run's, of someone's own
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "readme.txt").write_text("keep")
    _tier(tmp_path, [])
    assert not old.exists()  # the old run's parts: written by a tier, freed for the new run
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "readme.txt").exists()


def test_a_corrupt_part_falls_back_to_the_next_part_with_one_line(tmp_path):
    lines: list[str] = []
    tier = _tier(tmp_path, lines)
    _save(tier, 2)
    _save(tier, 4)
    payload = tier.dir / "step_4" / lt.PAYLOAD_FILE
    data = bytearray(payload.read_bytes())
    data[3] ^= 0xFF
    payload.write_bytes(bytes(data))
    got = tier.restore(_abstract(), _Iterator(), bucket_newest=None)
    assert got is not None and got.step == 2
    assert [line for line in lines if "step 4" in line] == [
        f"local checkpoint step 4 in {tier.dir / 'step_4'} is partial or corrupt; falling back "
        "to the next tier"]
    payload.write_bytes(bytes(data[:10]))  # short: the same
    assert tier.restore(_abstract(), _Iterator(), bucket_newest=3) is None


@pytest.mark.parametrize("change", ["run", "model"])
def test_a_part_of_another_run_or_model_is_never_restored(tmp_path, change):
    _save(_tier(tmp_path, []), 2)
    lines: list[str] = []
    other = _tier(tmp_path, lines, **({"model": {"d_model": 16}} if change == "model" else {}))
    if change == "run":
        other = _tier(tmp_path, lines, run="gs://bucket/runs/other")
        assert other.steps() == []  # another run's directory: removed when this run started
    assert other.restore(_abstract(), _Iterator(), bucket_newest=None) is None
    if change == "model":
        assert lines == [f"local checkpoint step 2 in {other.dir} is not this run's (model "
                         "differ); not restored"]


def test_a_directory_that_cannot_be_made_turns_the_tier_off_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lines: list[str] = []
    tier = _tier(blocker / "local", lines)
    assert not tier.enabled and not tier.due(2)
    assert len(lines) == 1 and str(blocker / "local") in lines[0]
    assert "local checkpoint tier off" in lines[0] and "bucket tier only" in lines[0]
    assert tier.save(2, _state(2), jax.random.key(0), {}) == 0.0
    assert tier.restore(_abstract(), _Iterator(), bucket_newest=None) is None


def test_a_failed_write_turns_the_tier_off_with_one_warning(tmp_path, monkeypatch):
    lines: list[str] = []
    tier = _tier(tmp_path, lines)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lt.os, "fsync", full)
    tier.save(2, _state(2), jax.random.key(0), {})
    tier.wait()
    assert not tier.enabled and tier.steps() == []
    assert len(lines) == 1 and "No space left on device" in lines[0]
    assert not list(tier.dir.glob("tmp-*"))



def _row(slice_index: int, place: int, steps: list[int], layout: int = 7,
         floor: int = -1) -> list[int]:
    return [slice_index, place, layout, floor, *(steps + [-1] * 4)[:4]]


def test_the_plan_takes_each_place_from_its_own_part_else_its_lowest_twin():
    # 2 slices x 2 hosts: slice 1 host 0 was recreated (no parts), slice 0 host 1 lost step 6.
    table = [_row(0, 0, [6, 4]), _row(0, 1, [4]), _row(1, 0, []), _row(1, 1, [6, 4])]
    assert lt._plan(table, floor=-1) == (6, [0, 3, 0, 3])
    assert lt._plan(table, floor=6) == (6, [0, 3, 0, 3])
    assert lt._plan(table, floor=7) is None


def test_the_plan_falls_back_to_an_older_step_when_a_place_has_no_copy_of_the_newest():
    table = [_row(0, 0, [6, 4]), _row(0, 1, [4]), _row(1, 0, [4]), _row(1, 1, [4])]
    assert lt._plan(table, floor=-1) == (4, [0, 1, 2, 3])
    assert lt._plan(table, floor=5) is None


def test_twins_of_another_layout_do_not_stand_in_for_each_other():
    # The state sharded across slices: twins hold different shards.
    table = [_row(0, 0, [6], layout=1), _row(1, 0, [], layout=2)]
    assert lt._plan(table, floor=-1) is None
