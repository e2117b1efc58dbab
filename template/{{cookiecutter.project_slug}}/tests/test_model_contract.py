"""The model contract: what every preset and every registered variant must do, whatever its
architecture. A fork's new preset or variant runs here unchanged and passes, or fails for a real
defect; nothing here assumes the dense transformer (depth comes from the variant's own unit of
layers, the cross-check of a cache is on logits, not on the tokens a greedy decode happens to
pick).

The cases are every preset (shrunk, with its own options) and the variants the tests define
(tests/toy_moe.py, tests/toy_local_global.py: the README's worked examples) laid over tiny.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import toy_local_global
import toy_moe
from conftest import layers_per_unit, small_preset
from flax import nnx

from trainer.config import ResolvedMesh, load_config, mesh_axes, presets
from trainer.dataset.loader import device_batch
from trainer.mesh import build_mesh
from trainer.model.decode import greedy_cached, greedy_uncached
from trainer.model.registry import build_model, describe, param_count
from trainer.train_step import build_program

VARIANTS = {toy_moe.KIND: toy_moe, toy_local_global.KIND: toy_local_global}
CASES = [*(p for p in presets() if p != "base"), *VARIANTS]
QUICK = ("llama-tiny", toy_local_global.KIND)  # the rest in the slow tier


def cases(quick: tuple[str, ...] = QUICK) -> list:
    return [pytest.param(case, marks=[] if case in quick else [pytest.mark.slow])
            for case in CASES]


@pytest.fixture
def case_setup(request):
    """The variant's mesh axis and rules while a case that needs them runs."""
    module = VARIANTS.get(request.node.callspec.params["case"])
    if module is not None:
        module.declare()
    yield
    if module is not None:
        module.forget()


def small_config(case: str, *overrides: str):
    """The case shrunk to seconds on a CPU: two of its variant's units of layers."""
    if case not in VARIANTS:
        return load_config(case, [*small_preset(case), *overrides])
    base = [o for o in small_preset("tiny") if not o.startswith("model.n_layers=")]
    return load_config("tiny", [*base, f"model.kind={case}",
                                f"model.n_layers={2 * layers_per_unit(case)}", *overrides])


def sharpened(config, seed: int = 3):
    """The model with a larger init than training's: logits sharp enough that a difference
    between two paths shows."""
    model = build_model(config.model, rngs=nnx.Rngs(params=seed))
    nnx.update(model, jax.tree.map(lambda p: p * 3.0, nnx.state(model, nnx.Param)))
    return model


@pytest.mark.parametrize("case", cases(quick=(*QUICK, "default", "tiny", toy_moe.KIND)))
def test_the_parameter_count_is_the_initialised_models(case, case_setup):
    # The arithmetic the trainer logs, the planner reads and MFU divides by is the model's
    # real size (presets at full size: the build is abstract).
    config = load_config(case) if case not in VARIANTS else small_config(case)
    abstract = nnx.eval_shape(lambda: build_model(config.model, rngs=nnx.Rngs(params=0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) == param_count(config.model)
    layout = describe(config.model)
    assert layout.units * layout.layers_per_unit == config.model.n_layers


@pytest.mark.parametrize("case", cases())
def test_one_seed_builds_one_model_and_its_logits_are_float32_batch_by_length_by_vocab(
        case, case_setup):
    config = small_config(case, "model.seq_len=16")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    first, again, other = (build_model(config.model, rngs=nnx.Rngs(params=seed))
                           for seed in (0, 0, 1))
    logits = first(tokens)
    assert logits.shape == (2, 16, config.model.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(again(tokens)), np.asarray(logits))
    assert not np.allclose(np.asarray(other(tokens)), np.asarray(logits))


@pytest.mark.parametrize("case", cases())
def test_cached_decoding_gives_the_full_passes_logits_at_every_position(case, case_setup):
    # Teacher-forced: the prompt in one call, then one given token per call, against the
    # training forward pass over the whole sequence (a variant whose attention or head differs
    # by layer or by position is held to it at every position).
    config = small_config(case, "model.seq_len=24")
    model = sharpened(config)
    tokens_1xT = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 24)), jnp.int32)
    full_TxV = np.asarray(model(tokens_1xT)[0])
    caches = model.init_cache(1, 24)
    logits_1xPxV, caches = model.decode(tokens_1xT[:, :7], jnp.int32(0), caches)
    steps = [np.asarray(logits_1xPxV[0])]
    for position in range(7, 24):
        logits_1x1xV, caches = model.decode(tokens_1xT[:, position:position + 1],
                                            jnp.int32(position), caches)
        steps.append(np.asarray(logits_1x1xV[0]))
    # float32 summation order differs between one position and the whole sequence (1e-3 seen
    # at logits of about 3); a cache that is wrong is off by the logits themselves
    np.testing.assert_allclose(np.concatenate(steps), full_TxV, rtol=1e-3, atol=2e-3)
    prompt = [5, 17, 99, 3, 250, 42, 7]
    assert greedy_cached(model, prompt, 8, 24).ids == greedy_uncached(model, prompt, 8, 24).ids


def one_step(config, ici: dict[str, int], devices: int, steps: int = 1):
    """(metrics of the last step, parameters) after `steps` steps on a mesh of `ici` sizes."""
    axes = mesh_axes()
    mesh = build_mesh(ResolvedMesh(ici=tuple(ici.get(a, 1) for a in axes), dcn=(1,) * len(axes)),
                      jax.devices()[:devices])
    program = build_program(config, mesh)
    state = program.init()
    with jax.set_mesh(mesh):
        for index in range(steps):
            state, metrics = program.step(state, device_batch(index, config,
                                                              program.batch_sharding))
    return ({k: float(v) for k, v in jax.device_get(metrics).items()},
            jax.tree.map(np.asarray, state["params"]))


@pytest.mark.parametrize("case", cases(quick=("llama-tiny",)))
def test_gradient_accumulation_gives_the_same_update_as_one_batch(case, case_setup):
    # Accumulation averages each micro-batch's values: the same update for a mean over tokens.
    # An objective that adds weighted auxiliary losses keeps its cross-entropy (checked); its
    # other values equal their whole-batch value only if they too are means over tokens
    # (trainer/model/aux.py), which this test cannot know, and says so.
    common = ["model.seq_len=32", "train.global_batch_size=8"]
    metrics, params = one_step(small_config(case, *common), {"data": 2}, 2)
    other, other_params = one_step(small_config(case, *common, "train.grad_accum_steps=4"),
                                   {"data": 2}, 2)
    if "cross_entropy" in metrics:
        assert other["cross_entropy"] == pytest.approx(metrics["cross_entropy"], rel=1e-6)
        added = sorted(set(metrics) - {"loss", "grad_norm", "learning_rate", "finite",
                                       "cross_entropy"})
        pytest.skip(f"{case}'s objective adds the weighted values of {', '.join(added)}: the "
                    "cross-entropy agrees (checked); the rest agree only where each is a mean "
                    "over tokens (trainer/model/aux.py)")
    assert other["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    for got, want in zip(jax.tree.leaves(other_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", cases(quick=()))
def test_two_pipeline_stages_train_as_data_parallelism_does(case, case_setup):
    # Two of the variant's units, one a stage: the stages run the variant's own embedding,
    # units (with their places in the stack) and head, so the step equals the data-parallel
    # one over as many micro-batches (accumulation over 2).
    common = ["model.seq_len=32", "train.global_batch_size=8"]
    piped, piped_params = one_step(
        small_config(case, *common, "mesh.ici_pipeline=2", "train.pipeline_microbatches=2"),
        {"pipeline": 2}, 2, steps=2)
    parallel, parallel_params = one_step(small_config(case, *common, "train.grad_accum_steps=2"),
                                         {"data": 2}, 2, steps=2)
    for name in parallel:
        if name not in ("learning_rate", "finite", "batch_digest"):
            assert piped[name] == pytest.approx(parallel[name], rel=2e-5, abs=1e-6), name
    for got, want in zip(jax.tree.leaves(piped_params), jax.tree.leaves(parallel_params),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_readmes_worked_example_is_the_tested_twin():
    # README.md's trainer/model/local_global.py, but for its imports (relative there) and name,
    # is tests/toy_local_global.py: the code the README shows is the code these tests train.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = readme.split("# trainer/model/local_global.py\n", 1)[1].split("```", 1)[0]
    twin = Path(toy_local_global.__file__).read_text()
    twin = twin[twin.index("import jax\n"):twin.index("\n\ndef declare()")]

    def code(text: str) -> list[str]:
        return [line for line in text.strip().splitlines()
                if not line.startswith(("from ", "KIND = "))]

    assert code(shown) == code(twin)


def test_check_shows_the_stack_and_only_the_architecture_keys_the_variant_reads():
    # --check's model summary (trainer/check.py model_report): the dense model reads model.mlp;
    # the MoE twin builds its own MLP and never does, so its summary does not claim "gelu".
    from trainer.check import model_report

    dense = load_config("tiny").model
    moe = small_config(toy_moe.KIND).model
    local_global = small_config(toy_local_global.KIND).model
    assert model_report(dense, describe(dense))["mlp"] == "gelu"
    moe_report = model_report(moe, describe(moe))
    assert "mlp" not in moe_report and moe_report["attention"] == "dense"
    assert {k: model_report(local_global, describe(local_global))[k]
            for k in ("kind", "n_layers", "stacked_units", "layers_per_unit")} == {
        "kind": toy_local_global.KIND, "n_layers": 4, "stacked_units": 2, "layers_per_unit": 2}


def test_the_memory_estimate_counts_what_the_variant_itself_saves():
    # --check's activation estimate follows the variant's own loss (an abstract trace of what
    # its backward pass keeps): the MoE twin's every expert runs on every token, so it keeps
    # more than the dense model of the same size, and the dense model is its own arithmetic's.
    from trainer.check import activation_bytes_estimate, model_activation_bytes

    dense = small_config("tiny", "model.remat=save_matmuls")
    moe = small_config(toy_moe.KIND, "model.remat=save_matmuls")
    toy_moe.declare()
    try:
        dense_bytes, moe_bytes = (model_activation_bytes(c, 1, 1) for c in (dense, moe))
    finally:
        toy_moe.forget()
    assert 0.5 < dense_bytes / activation_bytes_estimate(dense, 1, 1) < 2
    assert moe_bytes > 1.3 * dense_bytes  # 1.48x measured; the dense arithmetic says 1.0x
