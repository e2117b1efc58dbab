"""A variant the tests define (tests/toy_moe.py: experts on a mesh axis of its own, a weighted
auxiliary loss, a metric) trains through the toolkit's interface as the dense model does: its
values are logged, it shards like one device, its values cross pipeline stages and gradient
accumulation as documented (model/aux.py), and two emulated slices resume it bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import toy_local_global
import toy_moe
from conftest import xla_flags
from test_multislice import free_port

from trainer.config import ConfigError, ResolvedMesh, Topology, load_config, mesh_axes
from trainer.dataset.loader import device_batch
from trainer.mesh import build_mesh
from trainer.model.checks import resolve
from trainer.model.registry import param_count
from trainer.runtime.metrics import read_metrics
from trainer.train_step import build_program

ROOT = Path(__file__).resolve().parent.parent
TOY = ["model.kind=toy-moe", "model.seq_len=32", "train.global_batch_size=8", "model.n_layers=2"]
STEPS = 3


@pytest.fixture
def toy():
    toy_moe.declare()
    yield
    toy_moe.forget()


def run_steps(config, ici: tuple[int, ...], devices: int, steps: int = STEPS):
    """(per-step metrics, final parameters) on `devices` CPU devices; ici: the sizes of
    (pipeline, data, fsdp, toyexpert, tensor), any axis a fork adds being 1."""
    sizes = dict(zip(("pipeline", "data", "fsdp", toy_moe.AXIS, "tensor"), ici, strict=True))
    axes = mesh_axes()
    mesh = build_mesh(ResolvedMesh(ici=tuple(sizes.get(axis, 1) for axis in axes),
                                   dcn=(1,) * len(axes)), jax.devices()[:devices])
    program = build_program(config, mesh)
    state = program.init()
    rows = []
    with jax.set_mesh(mesh):
        for index in range(steps):
            state, metrics = program.step(state, device_batch(index, config,
                                                              program.batch_sharding))
            rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return rows, jax.tree.map(np.asarray, state["params"])


def test_the_variant_reports_a_weighted_loss_and_a_metric_the_step_logs(toy):
    config = load_config("tiny", TOY)
    rows, params = run_steps(config, (1, 1, 1, 1, 1), 1, steps=1)
    row = rows[0]
    assert {"load_balance", "router_entropy", "cross_entropy"} <= set(row)
    assert row["load_balance"] >= 0.99 * config.model.n_layers  # 1 per layer when balanced
    assert row["loss"] == pytest.approx(row["cross_entropy"] + toy_moe.BALANCE_WEIGHT
                                        * row["load_balance"], rel=1e-6)
    assert param_count(config.model) == sum(p.size for p in jax.tree.leaves(params))


@pytest.mark.parametrize("ici", [(1, 2, 1, 2, 2), (1, 1, 2, 4, 1)],
                         ids=["data2-expert2-tensor2", "fsdp2-expert4"])
def test_sharding_over_its_own_expert_axis_matches_one_device(toy, ici):
    config = load_config("tiny", TOY)
    reference, ref_params = run_steps(config, (1, 1, 1, 1, 1), 1)
    rows, params = run_steps(config, ici, 8)
    for got, want in zip(rows, reference, strict=True):
        for name in ("loss", "load_balance", "router_entropy", "cross_entropy"):
            assert got[name] == pytest.approx(want[name], rel=2e-5), name
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_pipeline_stages_report_what_accumulation_over_as_many_micro_batches_does(toy):
    """A pipeline of M micro-batches and accumulation over K = M split the batch alike (rows
    m, m + M, ...), so every value is the same mean over micro-batches; a token mean (the
    cross-entropy, the router entropy) equals the whole batch's, a batch statistic (the load
    balance) need not (model/aux.py)."""
    whole, _ = run_steps(load_config("tiny", TOY), (1, 1, 1, 1, 1), 1, steps=1)
    accumulated, _ = run_steps(load_config("tiny", [*TOY, "train.grad_accum_steps=2"]),
                               (1, 1, 1, 1, 1), 1, steps=1)
    piped, _ = run_steps(load_config("tiny", [*TOY, "mesh.ici_pipeline=2",
                                              "train.pipeline_microbatches=2"]),
                         (2, 1, 1, 1, 1), 2, steps=1)
    for name in ("loss", "load_balance", "router_entropy", "cross_entropy"):
        assert piped[0][name] == pytest.approx(accumulated[0][name], rel=2e-5), name
    for name in ("router_entropy", "cross_entropy"):
        assert accumulated[0][name] == pytest.approx(whole[0][name], rel=2e-5), name
    assert accumulated[0]["load_balance"] != pytest.approx(whole[0]["load_balance"], rel=1e-6)


def test_an_expert_count_the_axis_does_not_divide_is_refused_before_init(toy):
    config = load_config("tiny", [*TOY, "mesh.ici_fsdp=1", "mesh.ici_toyexpert=8"])
    with pytest.raises(ConfigError, match=r"= 4 is not divisible by the toyexpert parallelism 8 "
                                          r"\(toyexpert 8 = ici_toyexpert 8 \* dcn_toyexpert 1\): "
                                          r"parameter blocks.mlp.w_in_ExDxF splits its "
                                          r"dimension 1 \(logical axis 'toy_experts'\)"):
        resolve(config, Topology(num_slices=1, devices_per_slice=8, num_processes=1))


def test_a_mesh_key_of_an_axis_no_one_declared_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) mesh.ici_toyexpert( \(did you "
                                          r"mean .*\))?; allowed keys in \[mesh\]: ici_data"):
        load_config("tiny", ["mesh.ici_toyexpert=2"])


MOE_ON_TWO_SLICES = [*TOY, "mesh.dcn_data=2", "mesh.ici_toyexpert=2", "mesh.ici_fsdp=2"]


def _launch(run_dir: Path, steps: int, port: int, kill_after: int | None = None,
            overrides: list[str] = MOE_ON_TWO_SLICES):
    """Two processes, one emulated slice of 4 CPU devices each (by default: data-parallel over
    DCN and the experts split in two inside a slice); with `kill_after`, both are SIGKILLed once
    process 0 has finished that step. Returns (return code, output) per process."""
    args = ["--config", "tiny", "--steps", str(steps), "--run-dir", str(run_dir),
            *[f"--set={o}" for o in overrides], "--set=checkpoint.save_interval_steps=2",
            "--set=checkpoint.async_save=false", "--expect-slices", "2",
            "--expect-devices-per-slice", "4"]
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
                   PYTHONPATH=f"{ROOT / 'tests' / 'hooks'}{os.pathsep}{ROOT}",
                   TRAINER_TEST_VARIANTS="toy_moe,toy_local_global",
                   MULTISLICE_COORDINATOR=f"127.0.0.1:{port}", MULTISLICE_NUM_PROCESSES="2",
                   MULTISLICE_PROCESS_ID=str(pid), MULTISLICE_INIT_TIMEOUT_S="60",
                   MULTISLICE_STEP_MARKERS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    lines: list[str] = []
    if kill_after is not None:
        for line in procs[0].stdout:
            lines.append(line)
            if line.strip() == f"MULTISLICE_STEP {kill_after}":
                break
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
    outputs = []
    for index, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=240)
        outputs.append((proc.returncode, ("".join(lines) if index == 0 else "") + out))
    return outputs


@pytest.mark.slow
def test_two_emulated_slices_train_the_variant_log_its_values_and_resume_bit_for_bit(tmp_path):
    steps = 6
    reference = _launch(tmp_path / "reference", steps, free_port())
    for code, out in reference:
        assert code == 0, out
    assert "toyexpert=2" in reference[0][1]  # the mesh line names the variant's axis
    rows = [r for r in read_metrics(str(tmp_path / "reference")) if r.get("event") == "step"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all({"load_balance", "router_entropy", "cross_entropy"} <= set(r) for r in rows)
    assert "load_balance" in reference[0][1]  # the status line too

    run = tmp_path / "killed"
    killed = _launch(run, steps, free_port(), kill_after=3)
    assert all(code == -signal.SIGKILL for code, _ in killed), killed
    resumed = _launch(run, steps, free_port())
    for code, out in resumed:
        assert code == 0, out
    assert re.search(r"resuming run .* at checkpoint step [24]\b", resumed[0][1]), resumed[0][1]
    want = json.loads((tmp_path / "reference" / "summary.json").read_text())
    got = json.loads((run / "summary.json").read_text())
    assert got["params_digest"] == want["params_digest"]
    resumed_rows = {r["step"]: r for r in read_metrics(str(run)) if r.get("event") == "step"}
    for row in rows:
        for name in ("loss", "load_balance", "router_entropy"):
            assert resumed_rows[row["step"]][name] == row[name], (row["step"], name)


@pytest.mark.slow
def test_the_worked_example_pipelined_over_two_slices_resumes_a_killed_run_exactly(tmp_path):
    # The README's second worked example (tests/toy_local_global.py): its two units of two
    # layers are the two stages, one a slice (activations cross DCN), each stage running the
    # variant's own units and head; killed after step 3, the run resumes to the digest and the
    # per-step values of the uninterrupted one.
    overrides = [f"model.kind={toy_local_global.KIND}", "model.n_layers=4", "model.seq_len=32",
                 "train.global_batch_size=8", "mesh.dcn_data=1", "mesh.dcn_pipeline=2",
                 "mesh.ici_fsdp=4", "train.pipeline_microbatches=2",
                 "model.settings.window=4"]
    steps = 6
    reference = _launch(tmp_path / "reference", steps, free_port(), overrides=overrides)
    for code, out in reference:
        assert code == 0, out
    assert "pipeline: 2 stages, GPipe, 2 layers a stage" in reference[0][1]
    rows = [r for r in read_metrics(str(tmp_path / "reference")) if r.get("event") == "step"]
    assert all({"z_loss", "cross_entropy"} <= set(r) for r in rows)
    run = tmp_path / "killed"
    killed = _launch(run, steps, free_port(), kill_after=3, overrides=overrides)
    assert all(code == -signal.SIGKILL for code, _ in killed), killed
    resumed = _launch(run, steps, free_port(), overrides=overrides)
    for code, out in resumed:
        assert code == 0, out
    want = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert json.loads((run / "summary.json").read_text())["params_digest"] == want["params_digest"]
    resumed_rows = {r["step"]: r for r in read_metrics(str(run)) if r.get("event") == "step"}
    for row in rows:
        for name in ("loss", "z_loss", "cross_entropy"):
            assert resumed_rows[row["step"]][name] == row[name], (row["step"], name)


def test_a_variants_activation_estimate_is_what_check_adds_up(toy, monkeypatch):
    # The memory hook (model/registry.py activation_bytes): --check counts what the variant
    # says its activations take, here the dense estimate plus every token's expert activations.
    from trainer.check import activation_bytes_estimate, check_report
    from trainer.model import registry

    config = load_config("tiny", [*TOY, "mesh.ici_fsdp=-1", "mesh.dcn_data=1"])
    extra = 3 * 2**30

    def with_experts(cfg, batch_shards, tensor, stages=1, rows=None):
        return activation_bytes_estimate(cfg, batch_shards, tensor, stages, rows) + extra

    kind = registry.model_kind(config.model)
    monkeypatch.setitem(registry._KINDS, toy_moe.KIND,
                        registry.ModelKind(kind.name, kind.build, kind.param_count,
                                           kind.flops_per_token, with_experts))
    report = check_report(config, None, device_memory_gib=16)
    assert report["memory_per_device_gib"]["activations_estimate"] >= 3.0
    with pytest.raises(ConfigError, match=r"activations about 3\.0\d\) but a device has 2\.00 "
                                          r"GiB \(--device-memory-gib\)"):
        check_report(config, None, device_memory_gib=2)
