"""Every attention implementation matches the dense reference, forward and backward.

The splash kernel is TPU code; off TPU it runs in Pallas interpret mode, which executes the same
kernel (block loop, masking, online softmax, its custom backward) on the CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import ResolvedMesh, load_config
from trainer.dataset.loader import device_batch
from trainer.mesh import build_mesh
from trainer.model import attention
from trainer.model.rope import Rope
from trainer.train_step import build_program


def qkv(heads: int, kv_heads: int, length: int = 128, batch: int = 2, head_dim: int = 16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("kind", ["dot_product", "splash"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)],
                         ids=["multi-head", "grouped-query", "multi-query"])
def test_implementation_matches_dense_forward_and_backward(kind, heads, kv_heads):
    q, k, v = qkv(heads, kv_heads)
    np.testing.assert_allclose(attention.attend(kind, q, k, v), attention.dense(q, k, v),
                               rtol=1e-5, atol=1e-5)

    def loss(impl):
        return lambda q, k, v: jnp.sum(jnp.sin(attention.attend(impl, q, k, v)))

    want = jax.grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(kind), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_dense_attention_is_causal():
    q, k, v = qkv(2, 2, length=16)
    changed_future = v.at[:, 8:].set(0.0)
    before = attention.dense(q, k, v)[:, :8]
    after = attention.dense(q, k, changed_future)[:, :8]
    np.testing.assert_array_equal(before, after)


@pytest.mark.slow
def test_splash_inside_the_sharded_model_matches_dense():
    # Under a mesh the kernel runs per device block through shard_map (batch over fsdp, heads
    # over tensor); the train step's loss must not notice.
    def first_loss(kind: str) -> float:
        config = load_config("llama-tiny", ["model.seq_len=128", "model.n_layers=1",
                                            "train.global_batch_size=2",
                                            f"model.attention={kind}"])
        mesh = build_mesh(ResolvedMesh(ici=(1, 2, 2), dcn=(1, 1, 1)), jax.devices()[:4])
        program = build_program(config, mesh)
        with jax.set_mesh(mesh):
            _, metrics = program.step(program.init(),
                                      device_batch(0, config, program.batch_sharding))
        return float(metrics["loss"]), float(metrics["grad_norm"])

    dense_loss, dense_norm = first_loss("dense")
    splash_loss, splash_norm = first_loss("splash")
    assert splash_loss == pytest.approx(dense_loss, rel=1e-5)
    assert splash_norm == pytest.approx(dense_norm, rel=1e-4)


SPLASH = ["model.seq_len=128", "model.n_layers=1", "train.global_batch_size=8",
          "model.attention=splash"]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["train-then-eval", "eval-then-train"])
def test_splash_train_and_eval_steps_run_in_either_order(order):
    # Each jitted program traces the kernel anew: a kernel cached from the first trace held that
    # trace's tracers, and the second program failed with UnexpectedTracerError.
    config = load_config("llama-tiny", SPLASH)
    mesh = build_mesh(ResolvedMesh(ici=(1, 2, 2), dcn=(1, 1, 1)), jax.devices()[:4])
    program = build_program(config, mesh)
    with jax.set_mesh(mesh):
        state = program.init()
        batch = device_batch(0, config, program.batch_sharding)
        losses = []
        for what in order.split("-then-"):
            if what == "eval":
                losses.append(float(program.eval_loss(state["params"], batch)))
            else:
                state, metrics = program.step(state, batch)
                losses.append(float(metrics["loss"]))
                assert float(metrics["learning_rate"]) == 0.0  # warmup: step 0 changes nothing
    # The same parameters and batch through both programs: the same loss.
    assert np.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.slow
def test_a_whole_training_run_with_splash_attention_and_periodic_evaluation(tmp_path, capsys):
    import json

    from trainer.main import main

    overrides = [x for o in [*SPLASH, "eval.every_steps=2", "eval.num_batches=1",
                             "checkpoint.save_interval_steps=2", "data.worker_count=0"]
                 for x in ("--set", o)]
    assert main(["--config", "llama-tiny", "--steps", "4", "--run-dir", str(tmp_path),
                 *overrides]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in rows if r["event"] == "eval"]
    assert evals == [2, 4], rows
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 4 and np.isfinite(summary["eval_loss"])


@pytest.mark.parametrize("rope", [
    Rope(8, 100.0),
    Rope(8, 100.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_len=64),
], ids=["plain", "llama3"])
def test_rope_rotates_by_relative_position(rope):
    # RoPE's defining property: q(i) . k(j) depends on i - j only (with any frequencies).
    rng = np.random.default_rng(1)
    q = jnp.asarray(np.broadcast_to(rng.normal(size=(1, 1, 1, 8)), (1, 6, 1, 8)), jnp.float32)
    k = jnp.asarray(np.broadcast_to(rng.normal(size=(1, 1, 1, 8)), (1, 6, 1, 8)), jnp.float32)
    rq, rk = attention.apply_rope(q, rope), attention.apply_rope(k, rope)
    dots = jnp.einsum("blhk,bmhk->lm", rq, rk)
    assert float(dots[3, 1]) == pytest.approx(float(dots[4, 2]), rel=1e-5)
    # Explicit positions give the same rotation as the default 0..L-1.
    np.testing.assert_allclose(attention.apply_rope(q, rope, np.arange(6)), rq, rtol=1e-6)


def test_llama3_scaling_keeps_high_scales_low_and_interpolates_the_band_between():
    base = Rope(64, 500000.0)
    scaled = Rope(64, 500000.0, scaling="llama3", factor=32.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_len=8192)
    plain, new = base.inv_freq(), scaled.inv_freq()
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_array_equal(new[high], plain[high])
    np.testing.assert_allclose(new[low], plain[low] / 32.0)
    band = ~high & ~low
    assert band.any() and np.all((new[band] < plain[band]) & (new[band] > plain[band] / 32.0))
    assert int((new != plain).sum()) == 17  # Llama 3.2 1B's head size
