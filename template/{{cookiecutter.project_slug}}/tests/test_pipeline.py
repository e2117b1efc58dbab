"""Pipeline parallelism: a GPipe or circular step equals the single-device step; only one
micro-batch activation per tick each way (and the non-layer parameters' gradients, once) cross
the stage axis; every rule fails before compiling."""

import jax
import numpy as np
import pytest
from collectives import collectives, crossing

from trainer.config import ConfigError, ResolvedMesh, Topology, load_config
from trainer.dataset.loader import device_batch
from trainer.mesh import build_mesh
from trainer.model.checks import resolve
from trainer.pipeline import Schedule, bubble_fraction
from trainer.train_step import build_program

STEPS = 3
BASE = ["model.seq_len=32", "train.global_batch_size=16", "model.n_layers=4",
        "mesh.dcn_data=1"]
PIPELINE_FSDP = ["mesh.ici_pipeline=2", "mesh.ici_fsdp=2"]
PIPELINE_TENSOR = ["mesh.ici_pipeline=2", "mesh.ici_fsdp=1", "mesh.ici_tensor=2"]


def run_steps(ici: tuple[int, int, int, int], overrides: list[str], preset: str = "llama-tiny"):
    config = load_config(preset, BASE + overrides)
    devices = jax.devices()[:int(np.prod(ici))]
    mesh = build_mesh(ResolvedMesh(ici=ici, dcn=(1, 1, 1, 1)), devices)
    program = build_program(config, mesh)
    step = program.compile_step()
    state = program.init()
    losses = []
    for index in range(STEPS):
        state, metrics = step(state, device_batch(index, config, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    held_out = float(program.eval_loss(state["params"],
                                       device_batch(STEPS, config, program.batch_sharding)))
    saved = program.to_saved(state)["params"]  # the model's layer order, as checkpoints hold
    return np.array(losses), held_out, jax.tree.map(np.asarray, saved)


def assert_same_run(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=2e-6)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("ici", "overrides"), [
    # 4 micro-batches over 2 stages, each stage FSDP over 2 devices; remat, accumulation and
    # the chunked loss all on
    ((2, 1, 2, 1), PIPELINE_FSDP + ["train.pipeline_microbatches=4", "model.remat=full",
                                    "train.grad_accum_steps=2", "model.loss_chunk_size=8"]),
    # M = S (the default), tensor parallelism inside a stage, jax.nn attention, save_matmuls;
    # each stage's 2 layers as a loop (the cases above and below run them unrolled)
    ((2, 1, 1, 2), PIPELINE_TENSOR + ["model.attention=dot_product",
                                      "model.remat=save_matmuls",
                                      "train.pipeline_unroll_layers=0"]),
    # circular: 2 laps of 2 stages of one layer each; M = 4 > S puts every lap through stage
    # 0's delay line
    ((2, 1, 2, 1), PIPELINE_FSDP + ["train.pipeline_microbatches=4", "train.pipeline_repeats=2",
                                    "model.remat=full", "train.grad_accum_steps=2",
                                    "model.loss_chunk_size=8"]),
    # circular with M = S: a lap's output goes straight from the last stage to stage 0
    ((2, 1, 1, 2), PIPELINE_TENSOR + ["train.pipeline_repeats=2"]),
], ids=["pipeline2-fsdp2-M4-remat-accum-chunked", "pipeline2-tensor2-M2-dot-product-loop",
        "circular2x2-fsdp2-M4-remat-accum-chunked", "circular2x2-tensor2-M2"])
def test_pipelined_training_matches_the_single_device_run(ici, overrides):
    pipelined = run_steps(ici, overrides)
    reference = run_steps((1, 1, 1, 1), [o for o in overrides if "mesh." not in o and
                                         "train.pipeline_" not in o])
    assert pipelined[0][-1] < pipelined[0][0]
    assert_same_run(pipelined, reference)


@pytest.mark.slow
def test_pipelined_splash_attention_trains_and_evaluates_like_one_device():
    overrides = ["model.attention=splash", "model.seq_len=128"]
    assert_same_run(run_steps((2, 1, 2, 1), PIPELINE_FSDP + overrides),
                    run_steps((1, 1, 1, 1), overrides))


@pytest.mark.parametrize("repeats", [1, 2])
def test_one_micro_batch_per_tick_each_way_and_one_reduction_cross_the_stage_axis(repeats):
    config = load_config("llama-tiny", BASE + PIPELINE_FSDP + ["train.pipeline_microbatches=4",
                                                               f"train.pipeline_repeats={repeats}"])
    mesh = build_mesh(ResolvedMesh(ici=(2, 1, 2, 1), dcn=(1, 1, 1, 1)), jax.devices()[:4])
    program = build_program(config, mesh)
    across = crossing(collectives(program.compile_step().as_text(), mesh), "pipeline")
    assert {c.kind for c in across} == {"collective-permute", "all-reduce"}, [
        c.line[:200] for c in across]
    permutes = [c for c in across if c.kind == "collective-permute"]
    # one micro-batch of activations per device: (rows / fsdp) x seq_len x d_model, float32
    rows = 16 // 4 // 2
    assert {c.bytes for c in permutes} == {rows * 32 * config.model.d_model * 4}
    assert all(c.axes == ("pipeline",) for c in permutes)
    # forward: one hand-over a tick (stage s to s + 1, and the last to stage 0 between laps);
    # backward: the same pairs reversed, which XLA may split in two
    forward = [c for c in permutes if "transpose(" not in c.line]
    backward = [c for c in permutes if "transpose(" in c.line]
    assert len(forward) == 1 and 1 <= len(backward) <= 2
    pairs = {(0, 2), (1, 3)} | ({(2, 0), (3, 1)} if repeats > 1 else set())
    assert set(map(tuple, forward[0].groups)) == pairs
    assert {tuple(p[::-1]) for c in backward for p in c.groups} == pairs

    def nbytes(tree) -> int:
        return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
                   for leaf in jax.tree.leaves(tree))

    params = program.abstract_state["params"]
    other_bytes = nbytes({k: v for k, v in params.items() if k != "blocks"})
    # the tied table's gradient (from the embedding on stage 0 and the head on the last) and
    # the final norm's, summed over the stages once a step; a layer's gradient never is
    reductions = [c for c in across if c.kind == "all-reduce"]
    assert len(reductions) == 1
    assert other_bytes <= reductions[0].bytes <= 2 * other_bytes < nbytes(params["blocks"])


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_short_stage_block_runs_unrolled_and_a_long_one_as_a_loop_in_the_tick_loop(repeats):
    # llama-tiny's 4 layers: 2 stages x R blocks of 4 / (2 R) layers. A block of at most
    # train.pipeline_unroll_layers runs without a loop of its own inside the tick loop.
    def while_loops(unroll_layers: int) -> int:
        config = load_config("llama-tiny", BASE + PIPELINE_FSDP + [
            f"train.pipeline_repeats={repeats}", f"train.pipeline_unroll_layers={unroll_layers}"])
        mesh = build_mesh(ResolvedMesh(ici=(2, 1, 2, 1), dcn=(1, 1, 1, 1)), jax.devices()[:4])
        hlo = build_program(config, mesh).compile_step().as_text()
        return sum(" while(" in line for line in hlo.splitlines())

    unrolled, looped = while_loops(4), while_loops(0)
    if repeats == 1:  # blocks of 2 layers: forward and backward each lose their layer loop
        assert looped >= unrolled + 2, (looped, unrolled)
    else:  # blocks of 1 layer: XLA drops a one-trip loop either way
        assert looped == unrolled
    assert Schedule(2, 2, 1, unroll_layers=2).unrolled(4)
    assert not Schedule(2, 2, 1, unroll_layers=1).unrolled(4)
    assert Schedule(2, 2, 2, unroll_layers=1).unrolled(4)


def test_the_run_log_names_the_schedule_and_whether_a_stage_block_runs_unrolled():
    from trainer.train import pipeline_line

    def line(*overrides: str) -> str:
        return pipeline_line(load_config("llama-tiny", BASE + ["mesh.ici_pipeline=2",
                                                               *overrides]), 2)

    assert "GPipe, 2 layers a stage, unrolled, 2 micro-batches" in line()
    assert ("GPipe, 2 layers a stage, each block a loop (train.pipeline_unroll_layers)"
            in line("train.pipeline_unroll_layers=1"))
    assert "circular, 2 blocks of 1 layer a stage (train.pipeline_repeats), 2 micro" in line(
        "train.pipeline_repeats=2", "train.pipeline_unroll_layers=0")


def test_bubble_fraction_is_the_gpipe_formula_divided_by_about_the_repeats():
    assert bubble_fraction(1, 1) == 0
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 16, repeats=2) == pytest.approx(3 / 35)
    schedule = Schedule(stages=4, microbatches=8)
    assert (schedule.ticks, schedule.delay) == (11, 0)
    circular = Schedule(stages=4, microbatches=8, repeats=3)
    assert (circular.ticks, circular.delay) == (27, 4)


def test_stage_order_gives_each_stage_its_blocks_and_inverts():
    from trainer.pipeline import to_model_order, to_stage_order

    layers = np.arange(8)
    # 2 stages x 2 repeats of 2 layers: stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3
    staged = np.asarray(to_stage_order(layers, stages=2, repeats=2))
    assert staged.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert np.asarray(to_model_order(staged, stages=2, repeats=2)).tolist() == layers.tolist()
    assert np.asarray(to_stage_order(layers, stages=2, repeats=1)).tolist() == layers.tolist()


def topology(devices: int, slices: int = 1) -> Topology:
    return Topology(num_slices=slices, devices_per_slice=devices, num_processes=slices)


def test_pipeline_axes_resolve_with_fills_and_every_stage_holds_the_batch_shards():
    resolved = resolve(load_config("llama-tiny", BASE[:3] + ["mesh.ici_pipeline=2"]),
                       topology(4))
    assert resolved == ResolvedMesh(ici=(2, 1, 2, 1), dcn=(1, 1, 1, 1))
    assert (resolved.pipeline, resolved.batch_shards, resolved.stage_batch_shards) == (2, 2, 2)
    over_dcn = resolve(load_config("llama-tiny", BASE[:3] + ["mesh.dcn_data=1",
                                                             "mesh.dcn_pipeline=-1"]),
                       topology(2, slices=2))
    assert over_dcn == ResolvedMesh(ici=(1, 1, 2, 1), dcn=(2, 1, 1, 1))


@pytest.mark.parametrize(("overrides", "message"), [
    (["mesh.ici_pipeline=2", "model.scan_layers=false"],
     r"mesh.ici_pipeline \* mesh.dcn_pipeline = 2 needs model.scan_layers = true"),
    (["mesh.ici_pipeline=2", "train.pipeline_microbatches=3"],
     r"train.pipeline_microbatches = 3 is not a multiple of the 2 pipeline stages.*use 2, 4, "
     r"8"),
    (["mesh.ici_pipeline=2", "train.pipeline_microbatches=32"],
     r"= 16 rows do not split into train.pipeline_microbatches = 32 micro-batches"),
    (["train.pipeline_microbatches=4"],
     r"train.pipeline_microbatches = 4 needs a pipeline, but mesh.ici_pipeline \* "
     r"mesh.dcn_pipeline = 1"),
    (["train.pipeline_microbatches=-1"], r"train.pipeline_microbatches = -1: must be >= 0"),
    (["train.pipeline_repeats=2"],
     r"train.pipeline_repeats = 2 needs a pipeline, but mesh.ici_pipeline \* mesh.dcn_pipeline "
     r"= 1"),
    (["mesh.ici_pipeline=2", "train.pipeline_repeats=0"], r"train.pipeline_repeats = 0: must be "
                                                           r">= 1"),
    (["mesh.ici_pipeline=2", "train.pipeline_unroll_layers=-1"],
     r"train.pipeline_unroll_layers = -1: must be >= 0 .*0 = always a loop"),
    (["mesh.ici_pipeline=0"], r"mesh.ici_pipeline = 0: must be a positive integer or -1"),
    (["mesh.ici_pipeline=-1"], r"at most one ici axis may be -1.*ici_pipeline = -1, "
                               r"ici_fsdp = -1"),
])
def test_pipeline_rules_fail_at_load_naming_field_value_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("llama-tiny", BASE + overrides)


@pytest.mark.parametrize(("overrides", "devices", "message"), [
    # 16 rows / 2 micro-batches = 8 rows over the 4 data x fsdp shards of a stage: fine;
    # 16 / 8 = 2 rows over 4 shards: not
    (["mesh.ici_pipeline=2", "mesh.ici_fsdp=4", "train.pipeline_microbatches=8"], 8,
     r"a pipeline micro-batch of .* = 8 rows does not split over the 4 batch shards of a "
     r"stage \(data 1 = ici_data 1 \* dcn_data 1, fsdp 4 = ici_fsdp 4 \* dcn_fsdp 1\); make "
     r"the batch a multiple of 32"),
    (["mesh.ici_pipeline=2", "mesh.ici_fsdp=-1", "train.pipeline_microbatches=4",
      "eval.num_batches=1", "eval.batch_size=4"], 4,
     r"the eval batch 4 .* does not split into train.pipeline_microbatches = 4 micro-batches "
     r"over the 2 batch shards of a stage"),
    (["mesh.ici_pipeline=-1", "mesh.ici_fsdp=1", "train.global_batch_size=24"], 3,
     r"^model.n_layers = 4 does not split into 3 pipeline stages \(mesh.ici_pipeline \* "
     r"mesh.dcn_pipeline = 3\); use a number of stages that divides 4: 1, 2, 4$"),
    (["mesh.ici_pipeline=2", "mesh.ici_fsdp=1", "train.pipeline_repeats=4"], 2,
     r"model.n_layers = 4 does not split into 2 pipeline stages x train.pipeline_repeats = 4 "
     r"blocks .*use train.pipeline_repeats in \[1, 2\]"),
    (["mesh.ici_pipeline=2", "mesh.ici_fsdp=1"], 4,
     r"ici_pipeline\*ici_data\*ici_fsdp\*ici_tensor = 2 but each slice has 4 devices"),
])
def test_pipeline_rules_that_need_the_topology_fail_at_resolve(overrides, devices, message):
    config = load_config("llama-tiny", BASE + overrides)
    with pytest.raises(ConfigError, match=message):
        resolve(config, topology(devices))


def test_check_shows_the_stage_share_of_parameters_and_the_in_flight_activations():
    from trainer.check import check_report

    common = ["model.seq_len=32", "train.global_batch_size=32", "model.n_layers=4",
              "mesh.dcn_data=1", "mesh.ici_fsdp=4"]
    data_parallel = check_report(load_config("llama-tiny", common + ["mesh.ici_data=2"]), None)
    piped = check_report(load_config("llama-tiny", common + ["mesh.ici_pipeline=2",
                                                             "train.pipeline_microbatches=4"]),
                         None)
    assert piped["mesh"]["pipeline"] == 2 and piped["mesh"]["fsdp"] == 4
    assert piped["mesh"]["ici"] == list(ResolvedMesh(ici=(2, 1, 4, 1), dcn=(1, 1, 1, 1)).ici)
    table = 256 * 64 * 4 + 64 * 4  # the tied table and the final norm, float32
    assert piped["pipeline"] == {"stages": 2, "microbatches": 4, "repeats": 1,
                                 "layers_per_stage": 2, "layers_per_block": 2,
                                 "block_unrolled": True, "bubble_fraction": 0.2,
                                 "permutes_per_step": 8, "reduced_across_stages_bytes": table}
    circular = check_report(load_config("llama-tiny", common + [
        "mesh.ici_pipeline=2", "train.pipeline_microbatches=4", "train.pipeline_repeats=2"]),
        None)["pipeline"]
    assert (circular["layers_per_block"], circular["bubble_fraction"]) == (1, round(1 / 9, 4))
    assert data_parallel["pipeline"] is None
    dp, pp = data_parallel["memory_per_device_gib"], piped["memory_per_device_gib"]
    # each stage holds half of the layers (and their optimizer state); the embedding is whole
    assert pp["params"] < dp["params"] and pp["optimizer_state"] < dp["optimizer_state"]
    # a stage's device holds twice the rows (the pipeline took the data axis's place) of half
    # the layers, (M + S - 1) / M = 5/4 of them in flight, plus the micro-batch buffers and the
    # logits of all its rows (the loss runs on the last stage)
    assert dp["activations_estimate"] < pp["activations_estimate"] < 2 * dp[
        "activations_estimate"]
