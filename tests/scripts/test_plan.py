"""`multislice plan`: the overview's numbers, the boundaries where advice changes, bad inputs."""

from __future__ import annotations

import json

import pytest

from scripts.cli import main
from scripts.plan.formulas import PlanError, transformer_params
from scripts.plan.output import plan_to_json
from scripts.plan.planner import make_plan
from scripts.plan.recommend import STRATEGIES

GIB = 2**30
SMALL = 1e8  # parameters that fit comfortably on any slice, so only DCN decides


@pytest.mark.parametrize("accelerator", ["v4-8", "v4-16", "v4-512"])
def test_v4_host_does_22000_flop_per_dcn_bit(accelerator: str) -> None:
    plan = make_plan(accelerator, 2, SMALL, 1e6)
    assert plan.hardware.flops_per_bit == 22_000  # 4 x 275e12 / 50e9


@pytest.mark.parametrize(
    ("slices", "bits", "minimum", "margin"),
    [(2, 32, 176_000, 350_000), (3, 64, 352_000, 700_000), (4, 64, 352_000, 700_000),
     (256, 64, 352_000, 700_000)],
)  # fmt: skip
def test_seed_minimum_and_margin_per_slice_on_v4(
    slices: int, bits: int, minimum: int, margin: int
) -> None:
    out = plan_to_json(make_plan("v4-8", slices, SMALL, 1e7))
    assert out["dcn_bits_per_param"] == bits
    assert out["min_tokens_per_slice"] == minimum
    assert out["recommended_tokens_per_slice"] == margin
    assert out["min_global_tokens_per_batch"] == minimum * slices


def test_operational_intensity_is_four_tokens_per_slice_over_bits() -> None:
    two = plan_to_json(make_plan("v4-8", 2, SMALL, 1_048_576))
    assert two["operational_intensity"] == 4 * (1_048_576 / 2) / 32
    four = plan_to_json(make_plan("v4-8", 4, SMALL, 1_048_576))
    assert four["operational_intensity"] == 4 * (1_048_576 / 4) / 64


@pytest.mark.parametrize(("slices", "per_slice_min"), [(2, 176_000), (3, 352_000), (8, 352_000)])
def test_data_parallel_is_compute_bound_from_exactly_the_minimum(
    slices: int, per_slice_min: int
) -> None:
    at = make_plan("v4-8", slices, SMALL, per_slice_min * slices)
    below = make_plan("v4-8", slices, SMALL, (per_slice_min - 1) * slices)
    assert at.data_parallel.compute_bound and at.recommendation.strategy == "data_parallel"
    assert not below.data_parallel.compute_bound
    assert below.recommendation.strategy == "pipeline"


def test_margin_warning_appears_only_below_350k_tokens_per_slice() -> None:
    at = make_plan("v4-8", 2, SMALL, 700_000)
    below = make_plan("v4-8", 2, SMALL, 699_998)
    assert at.data_parallel.meets_margin and not below.data_parallel.meets_margin
    assert below.recommendation.strategy == "data_parallel"
    assert not any("margin" in r for r in at.recommendation.reasons)
    assert any("below the recommended margin of 350,000" in r for r in below.recommendation.reasons)


def test_pipeline_depth_is_the_shallowest_that_hides_dcn() -> None:
    # 4 slices, just below pure DP's 4 x 352,000: depth 2 (2 replicas) gives 703,998 per pipeline.
    shallow = make_plan("v4-8", 4, SMALL, 4 * 352_000 - 4).recommendation
    assert shallow.strategy == "pipeline"
    assert shallow.assessment.mesh.dcn_pipeline == 2
    assert shallow.assessment.mesh.dcn_data == 2
    assert shallow.assessment.min_tokens_per_slice == 176_000
    # Below 2 x 176,000 even depth 2 is DCN-bound: one pipeline over all 4 slices.
    deep = make_plan("v4-8", 4, SMALL, 2 * 176_000 - 2).recommendation
    assert deep.assessment.mesh.dcn_pipeline == 4
    assert deep.assessment.mesh.dcn_data == 1
    assert any("raise the global batch to at least 1,408,000" in r for r in deep.reasons)


def test_pipeline_on_an_odd_slice_count_uses_every_slice() -> None:
    rec = make_plan("v4-8", 3, SMALL, 3 * 352_000 - 3).recommendation
    assert rec.strategy == "pipeline" and rec.assessment.mesh.dcn_pipeline == 3


def test_hbm_fit_moves_the_recommendation_to_fsdp_over_dcn_at_the_budget() -> None:
    # v4-8: 4 devices of 32 GiB, budget 75% = 24 GiB; fp32 params+grads+Adam = 16 B/param,
    # sharded 4 ways inside the slice: 4 B/param/device, so 6 GiB of parameters is the limit.
    limit = 6 * GIB
    fits = make_plan("v4-8", 2, limit, 1e6)
    over = make_plan("v4-8", 2, limit + 1, 1e6)
    assert fits.data_parallel.state_bytes_per_device == 24 * GIB
    assert fits.recommendation.strategy == "data_parallel"
    assert over.recommendation.strategy == "fsdp_over_dcn"
    assert over.recommendation.assessment.mesh.dcn_fsdp == 2
    assert over.recommendation.assessment.state_bytes_per_device <= 12 * GIB + 8


def test_bfloat16_parameters_shrink_the_state() -> None:
    plan = make_plan("v4-8", 2, 6 * GIB + 1, 1e6, param_dtype="bfloat16")
    assert plan.workload.state_bytes_per_param == 12
    assert plan.recommendation.strategy == "data_parallel"


def test_a_model_too_big_for_every_device_is_reported() -> None:
    rec = make_plan("v4-8", 2, 1e12, 1e6).recommendation
    assert rec.strategy == "does_not_fit"
    assert any("Even sharded over every device of all 2 slices" in r for r in rec.reasons)


def test_checked_mesh_fills_minus_one_and_flags_dcn_tensor() -> None:
    plan = make_plan(
        "v4-16", 4, SMALL, 4e6, mesh_args={"ici_fsdp": -1, "dcn_data": 2, "dcn_tensor": 2}
    )
    assert plan.check is not None
    assert plan.check.mesh.ici_fsdp == 8
    assert plan.check.dcn_replicas == 2
    assert any("dcn_tensor=2" in note for note in plan.check_notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(accelerator_type="v3-8"), "'v3-8': TPU v3 cannot run Multislice"),
        (dict(accelerator_type="v9-8"), "unknown TPU family 'v9'"),
        (dict(slices=1), "slices 1 is out of range: Multislice uses 2 to 256"),
        (dict(slices=257), "slices 257 is out of range"),
        (dict(params=0), "params 0 must be a positive number"),
        (dict(params=-5.0), "params -5 must be a positive number"),
        (dict(tokens_per_batch=0), "tokens per batch 0 must be a positive"),
        (
            dict(mesh_args={"dcn_data": 3}),
            r"DCN .* multiply to 3 \(dcn_data=3 x dcn_fsdp=1 x dcn_tensor=1 x dcn_pipeline=1\) but must "
            r"equal 2",
        ),
        (dict(mesh_args={"ici_fsdp": 3}), r"ICI .* multiply to 3 .* but must equal 4"),
        (dict(mesh_args={"dcn_data": -1, "dcn_fsdp": -1}), "at most one DCN .* may be -1"),
    ],
)
def test_bad_inputs_name_the_value_and_what_is_allowed(kwargs: dict, message: str) -> None:
    args = dict(accelerator_type="v4-8", slices=2, params=SMALL, tokens_per_batch=1e6)
    args.update(kwargs)
    with pytest.raises(PlanError, match=message):
        make_plan(**args)


def test_cli_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--accelerator-type", "v4-8", "--slices", "2", "--params", "8e9",
            "--tokens-per-batch", "1048576", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("hardware_flops_per_bit", "dcn_bits_per_param", "operational_intensity",
                "min_tokens_per_slice", "compute_bound", "recommendation"):  # fmt: skip
        assert key in out
    assert out["hardware_flops_per_bit"] == 22_000
    assert out["compute_bound"] is True
    assert out["recommendation"]["strategy"] in STRATEGIES


def test_cli_table_and_model_dimensions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--accelerator-type", "v4-8", "--slices", "3", "--d-model", "768",
            "--n-layers", "12", "--tokens-per-batch", "1M"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "22,000 FLOP per DCN bit per host" in text
    assert "352,000" in text and "700,000" in text
    assert "recommendation: pipeline" in text  # 333,333 tokens per slice < 352,000


def test_cli_errors_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--accelerator-type", "v2-8", "--slices", "2", "--params", "1e9",
            "--tokens-per-batch", "1e6"]  # fmt: skip
    assert main(argv) == 2
    assert "v2 cannot run Multislice" in capsys.readouterr().err


def test_transformer_parameter_count_matches_the_template_layout() -> None:
    # d=8, 2 layers, vocab 256, d_ff 32, tied: 2*(4*64 + 2*8*32 + 16) + 256*8 + 8
    assert transformer_params(8, 2, 256, 32) == 2 * (256 + 512 + 16) + 2048 + 8
    assert transformer_params(8, 2, 256, 32, tied=False) == 2 * (256 + 512 + 16) + 4096 + 8


LLAMA_1B_DIMS = ["--d-model", "2048", "--n-layers", "16", "--vocab-size", "128256",
                 "--d-ff", "8192"]


def test_the_pipeline_recommendation_is_a_mesh_to_paste_with_its_bubble_and_dcn_traffic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # ~1B parameters on 2 x v4-8 with 256k tokens per step: data parallelism is DCN-bound.
    argv = ["plan", "--accelerator-type", "v4-8", "--slices", "2", *LLAMA_1B_DIMS,
            "--tokens-per-batch", "256k", "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["strategy"] == "pipeline"
    assert rec["mesh"]["dcn_pipeline"] == 2 and rec["mesh"]["dcn_data"] == 1
    pipe = rec["pipeline"]
    assert (pipe["stages"], pipe["microbatches"], pipe["repeats"]) == (2, 16, 1)
    assert pipe["bubble_fraction"] == pytest.approx(1 / 17)
    # every tick: one micro-batch forward, and its gradient back in the backward pass; bf16
    assert pipe["activation_bytes_per_step"] == pytest.approx(2 * 17 / 16 * 256_000 * 2048 * 2)
    embedding = 128256 * 2048
    assert pipe["gradient_bytes_per_step"] == pytest.approx(embedding * 32 / 8)
    assert pipe["data_parallel_gradient_bytes_per_step"] > 3 * pipe["gradient_bytes_per_step"]
    assert "dcn_pipeline: 2" in rec["stack_settings"]
    assert "train.pipeline_microbatches: 16" in rec["stack_settings"]
    assert "train.pipeline_repeats: 1" in rec["stack_settings"]
    assert not any("no pipeline axis" in r for r in rec["reasons"])


def test_the_text_plan_shows_the_settings_to_paste(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--accelerator-type", "v4-8", "--slices", "2", *LLAMA_1B_DIMS,
            "--tokens-per-batch", "256k", "--pipeline-microbatches", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # 4 micro-batches leave a 1/5 bubble; 2 or 4 laps would shrink it but make the
    # activations wait on DCN (GPipe's hide behind the stage's compute): GPipe it is
    assert "bubble of (S-1)/(M+S-1) = 1/5 = 20.0%" in text
    assert "stack settings to paste" in text and "train.pipeline_microbatches: 4" in text
    assert "train.pipeline_repeats: 1" in text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"microbatches": 3}, "pipeline microbatches 3 is not a multiple of the 2 pipeline stages"),
    ({"microbatches": 0}, "pipeline microbatches 0 must be a positive integer"),
    ({"mesh_args": {"dcn_pipeline": 2, "dcn_data": 1}, "n_layers": 3},
     r"ici_pipeline x dcn_pipeline = 1 x 2 = 2 stages do not divide n-layers 3"),
])
def test_pipeline_inputs_that_cannot_run_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan("v4-8", 2, SMALL, 256_000, **kwargs)


def test_layers_that_do_not_split_into_stages_are_named() -> None:
    rec = make_plan("v4-8", 2, SMALL, 256_000, n_layers=3).recommendation
    assert rec.strategy == "does_not_fit"
    assert any("n-layers 3 does not split into that many stages" in r for r in rec.reasons)


def test_a_checked_pipeline_mesh_reports_its_schedule() -> None:
    plan = make_plan("v4-8", 2, SMALL, 256_000, d_model=1024,
                     mesh_args={"dcn_pipeline": 2, "dcn_data": 1}, microbatches=8, repeats=1)
    assert plan.check is not None and plan.check.pipeline is not None
    assert plan.check.pipeline.bubble_fraction == pytest.approx(1 / 9)
    assert any("train.pipeline_microbatches=8" in note for note in plan.check_notes)


def test_the_planner_picks_repeats_only_when_the_batch_has_too_few_micro_batches() -> None:
    from scripts.plan.pipeline import default_schedule

    # 64 sequences over 2 stages of 2 shards: M = 16 reaches 10% alone (R = 1 sends least)
    assert default_schedule(2, sequences=64, shards=2, n_layers=16) == (16, 1)
    # 8 sequences: at most M = 4 (1/5 bubble); R = 4 gives 1/17 < 10% for 4x the hand-overs,
    # and R = 3 is refused: 16 layers do not split into 2 stages x 3 blocks
    assert default_schedule(2, sequences=8, shards=2, n_layers=16) == (4, 4)
    assert default_schedule(2, sequences=8, shards=2, n_layers=12) == (4, 3)
    # no repeats split the layers beyond R = 1: the smallest bubble the batch allows
    assert default_schedule(2, sequences=8, shards=2, n_layers=2) == (4, 1)
    assert default_schedule(2, sequences=8, shards=2, n_layers=16, repeats=2) == (4, 2)
    # laps that would make the hand-overs wait on DCN are not taken while GPipe's hide
    assert default_schedule(2, sequences=8, shards=2, n_layers=16,
                            hidden=lambda m, r: r <= 2) == (4, 2)
    assert default_schedule(2, sequences=8, shards=2, n_layers=16,
                            hidden=lambda m, r: r == 1) == (4, 1)
    assert default_schedule(2, sequences=8, shards=2, n_layers=16,
                            hidden=lambda m, r: False) == (4, 4)


def test_a_circular_schedule_is_named_with_its_bubble_and_extra_hand_overs() -> None:
    plan = make_plan("v4-8", 2, SMALL, 256_000, d_model=1024, n_layers=16,
                     mesh_args={"dcn_pipeline": 2, "dcn_data": 1}, microbatches=4, repeats=2)
    cost = plan.check.pipeline
    assert (cost.microbatches, cost.repeats) == (4, 2)
    assert cost.bubble_fraction == pytest.approx(1 / 9)
    assert cost.activation_bytes_per_step == pytest.approx(2 * 9 / 4 * 256_000 * 1024 * 2)
    assert any("train.pipeline_repeats=2" in note and "1/9" in note
               for note in plan.check_notes)
    with pytest.raises(PlanError, match="stages x pipeline repeats 3 do not divide n-layers 16"):
        make_plan("v4-8", 2, SMALL, 256_000, n_layers=16,
                  mesh_args={"dcn_pipeline": 2, "dcn_data": 1}, repeats=3)
