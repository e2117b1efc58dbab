"""An elastic job's step at fewer slices: the config it runs, what it refuses, and the canonical
reduction's bits (6 batch shards against 4, the micro-batches scaled to keep the chunk)."""

import jax
import numpy as np
import pytest

from trainer.config import ConfigError, ResolvedMesh, Topology, load_config
from trainer.dataset.loader import device_batch
from trainer.mesh import build_mesh
from trainer.model.checks import resolve
from trainer.runtime import elastic
from trainer.runtime.digest import params_digest
from trainer.train_step import build_program, pairwise_sum

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.seq_len=16"]


def test_a_shrunk_job_keeps_the_batch_and_takes_the_lost_rows_as_micro_batches():
    config = load_config("tiny", ["elastic.min_slices=2", "train.grad_accum_steps=2",
                                  "train.global_batch_size=24"])
    shrunk = elastic.at_size(config, full=3, slices=2)
    assert shrunk.train.grad_accum_steps == 3
    assert shrunk.train.global_batch_size == 24
    assert shrunk.mesh.dcn_data == 2
    assert elastic.at_size(config, full=3, slices=3) is config
    # resolved at 2 slices x 2 devices: 4 batch shards of 6 rows, 3 micro-batches of 2 rows
    resolved = resolve(shrunk, Topology(num_slices=2, devices_per_slice=2, num_processes=2))
    assert resolved.batch_shards == 4


@pytest.mark.parametrize("overrides, full, slices, words", [
    (["elastic.min_slices=2", "train.grad_accum_steps=1"], 3, 2,
     "grad_accum_steps = 1 on the job's 3 slices is 3 micro-batches a step, which do not split "
     "over 2 slices"),
    (["elastic.min_slices=3"], 4, 2, "fewer than elastic.min_slices = 3"),
    ([], 3, 2, "elastic.min_slices = 0 (off)"),
    (["elastic.min_slices=2", "mesh.dcn_data=4", "train.grad_accum_steps=2"], 3, 2,
     "mesh.dcn_data = 4 but the job has 3 slices"),
])
def test_a_size_the_job_cannot_train_at_is_one_line_with_the_numbers(overrides, full, slices,
                                                                      words):
    config = load_config("tiny", overrides)
    with pytest.raises(ConfigError) as info:
        elastic.at_size(config, full=full, slices=slices)
    assert words in str(info.value)


@pytest.mark.parametrize("overrides, words", [
    (["elastic.min_slices=-1"], "elastic.min_slices = -1: must be >= 0"),
    (["elastic.canonical_reduction=true"], "needs elastic.min_slices >= 1"),
    (["elastic.min_slices=2", "mesh.dcn_fsdp=2", "mesh.dcn_data=1"],
     "dcn_fsdp = 2 shards it across slices"),
])
def test_an_elastic_setting_that_cannot_work_is_refused_at_load(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides)
    assert words in str(info.value)


def test_every_size_down_to_the_floor_is_checked_at_start():
    # An eval batch of 8 rows splits over 4 slices x 2 devices, not over 3 x 2: the floor of 3
    # is checked before the first step, not at the first failure.
    config = load_config("tiny", ["elastic.min_slices=3", "train.grad_accum_steps=3",
                                  "train.global_batch_size=24", "eval.num_batches=1",
                                  "eval.batch_size=8"])
    whole = Topology(num_slices=4, devices_per_slice=2, num_processes=4)
    resolve(config, whole)
    with pytest.raises(ConfigError) as info:
        elastic.check_every_size(config, 4, whole, resolve)
    assert "on 3 of the job's 4 slices" in str(info.value)
    assert "the eval batch 8" in str(info.value)
    with pytest.raises(ConfigError, match="floor must be at most the job's size"):
        elastic.check_every_size(load_config("tiny", ["elastic.min_slices=5"]), 4, whole, resolve)


def test_the_full_size_comes_from_the_launcher_or_is_the_size_running():
    topology = Topology(num_slices=2, devices_per_slice=1, num_processes=2)
    assert elastic.full_slices(topology, {}) == 2
    assert elastic.full_slices(topology, {elastic.FULL_SLICES_ENV: "3"}) == 3
    with pytest.raises(ConfigError, match="integer >= the 2 slice"):
        elastic.full_slices(topology, {elastic.FULL_SLICES_ENV: "1"})


def test_pairwise_sum_is_a_fixed_tree():
    values = np.float32([1e8, 1.0, -1e8, 1.0, 3.0])
    # ((a+b) + (c+d)) + e, in float32: 1e8 + 1 rounds to 1e8
    expected = (np.float32(1e8 + 1.0) + np.float32(-1e8 + 1.0)) + np.float32(3.0)
    assert float(pairwise_sum(jax.numpy.asarray(values))) == float(expected)


def _steps(config, devices, batches):
    mesh = build_mesh(ResolvedMesh(ici=(len(devices), 1, 1), dcn=(1, 1, 1)), devices)
    program = build_program(config, mesh)
    state = program.init()
    compiled = program.compile_step()
    losses = []
    for step in range(batches):
        state, metrics = compiled(state, device_batch(step, config, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return params_digest(state["params"]), losses


def test_the_canonical_reduction_gives_the_same_bits_on_fewer_batch_shards():
    devices = jax.devices()
    base = ["train.global_batch_size=24", "elastic.min_slices=2", "train.seed=3", *TINY]
    canonical = [*base, "elastic.canonical_reduction=true"]
    # 6 batch shards x 2 micro-batches against 4 x 3: chunks of 2 rows either way
    six = _steps(load_config("tiny", [*canonical, "train.grad_accum_steps=2"]), devices[:6], 2)
    four = _steps(load_config("tiny", [*canonical, "train.grad_accum_steps=3"]), devices[:4], 2)
    assert six == four
    # the same mean gradient as XLA's own reduction, to rounding; XLA's own is not the same
    # bits on 4 shards as on 6 (why the canonical order exists)
    plain = _steps(load_config("tiny", [*base, "train.grad_accum_steps=2"]), devices[:6], 2)
    np.testing.assert_allclose(plain[1], six[1], rtol=1e-5)
    plain_four = _steps(load_config("tiny", [*base, "train.grad_accum_steps=3"]), devices[:4], 2)
    assert plain_four[0] != plain[0]
