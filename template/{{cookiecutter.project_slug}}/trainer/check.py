"""`python -m trainer.main --config NAME --check [--run-dir R]`: everything but the training.

Validates the config, resolves the mesh against the devices this process sees, checks the data
set (when it exists already) against the model, and reports sizes, without compiling anything:
the model is traced with `jax.eval_shape`, so even a 1B-parameter preset is checked in seconds
on a laptop. The per-device memory of the train state is exact (each array's shard shape under
its sharding); activations are an estimate from the shapes and the remat policy.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import numpy as np
from etils import epath

from .config import Config, ConfigError
from .dataset.input_pipeline import eval_batches, open_dataset, rows_for_sharding
from .dataset.loader import data_dir, may_prepare
from .mesh import build_mesh, current_topology
from .model.checks import resolve
from .model.registry import ModelLayout, describe, flops_per_token, model_kind, param_count
from .runtime.storage import check_reachable

GIB = 2**30


def _state_bytes_per_device(abstract_state: Any) -> dict[str, int]:
    """Bytes of each part of the train state that one device holds (the largest shard)."""
    out = {}
    for part in ("params", "opt_state"):
        total = 0
        for leaf in jax.tree.leaves(abstract_state[part]):
            shard = leaf.sharding.shard_shape(leaf.shape)
            total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
        out[part] = total
    return out


def activation_bytes_estimate(config: Config, batch_shards: int, tensor: int,
                              stages: int = 1, rows: int | None = None) -> int:
    """Rough bytes of activations one device keeps for the backward pass of one micro-batch.

    Per layer and token: the tensors saved under the remat policy (block input only for `full`;
    the matmul outputs for `save_matmuls`; for `none` also norms, the MLP's nonlinearity and the
    L x L attention probabilities of the dense and dot_product implementations), plus the float32
    logits of the loss (one chunk's worth with model.loss_chunk_size).

    In a pipeline of S stages and R repeats a device runs n_layers / (S R) layers on one
    micro-batch of B / M rows at each of the R M + S - 1 ticks and keeps every tick for the
    backward pass: (R M + S - 1) / (R M) times the activations of n_layers / S layers for its
    rows; plus the embedded input and the final outputs of every micro-batch, stage 0's delay
    line between laps (M - S micro-batches), and the logits of all its rows (the loss runs on
    the last stage).
    """
    m = config.model
    bytes_per = np.dtype(m.dtype).itemsize
    if rows is None:  # else: the rows of one device's micro-batch, given
        rows = config.train.global_batch_size // config.train.grad_accum_steps // batch_shards
    tokens = rows * m.seq_len
    d, f = m.d_model, m.d_ff // tensor
    q = m.n_heads * m.head_size // tensor
    kv = m.kv_heads * m.head_size // tensor
    mlp_outputs = (3 if m.mlp == "swiglu" else 2) * f
    if m.remat == "full":
        per_token = d
    else:
        per_token = d + q + 2 * kv + d + mlp_outputs + d
        if m.remat == "none":
            per_token += 3 * d + mlp_outputs
            if m.attention in ("dense", "dot_product"):
                per_token += 2 * (m.n_heads // tensor) * m.seq_len * 4 // bytes_per
    layers = m.n_layers * tokens * per_token * bytes_per
    if stages > 1:
        from .pipeline import Schedule

        schedule = Schedule.of(config, stages)
        laps = schedule.repeats * schedule.microbatches
        buffers = (2 + schedule.delay / schedule.microbatches) * tokens * d * bytes_per
        layers = layers / stages * schedule.ticks / laps + 2 * buffers  # and their gradients
    logit_tokens = rows * (m.loss_chunk_size or m.seq_len)
    return int(layers + 2 * logit_tokens * (m.vocab_size // tensor) * 4)


def device_memory_bytes() -> tuple[int | None, str]:
    """(bytes one device has, where that comes from): the runtime's own limit where it reports
    one (TPU, GPU); None on CPU, whose host memory is not the accelerator's."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    return (int(limit), "the device runtime") if limit else (None, "unknown on this backend")


def host_share_bytes() -> int:
    """On CPU: the share of this host's memory one of its CPU devices has."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count()


def check_shard_records(info: Any, meta_shards: dict[str, int]) -> None:
    """Every local shard opens and holds the records metadata.json lists (a truncated copy
    opens with fewer); gs:// shards are checked for presence and size by open_dataset."""
    from .dataset.input_pipeline import DataError, shard_problem

    for shard in (*info.shards, *info.eval_shards):
        problem = shard_problem(shard, meta_shards.get(epath.Path(shard).name))
        if problem is not None:
            raise DataError(problem)


def _data_report(config: Config, run_dir: str | None, batch_sharding: Any) -> dict[str, Any]:
    if not config.data.path and run_dir is None:
        return {"status": "not checked (data.path is empty: give --run-dir to check RUN_DIR/data)"}
    where = data_dir(config, run_dir or "")
    check_reachable(where)  # gs:// storage that does not answer: one line, not gcsfs's retries
    path = epath.Path(where)
    if not path.exists() and may_prepare(config):
        return {"path": str(path), "status": "missing: the built-in corpus will be prepared"}
    info = open_dataset(path, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    import json

    meta = json.loads((path / "metadata.json").read_text())
    check_shard_records(info, {e["file"]: int(e["num_records"])
                               for key in ("shards", "eval_shards") for e in meta.get(key, [])})
    if config.eval.num_batches:
        rows = rows_for_sharding(batch_sharding, (config.eval_batch_size,
                                                  config.model.seq_len + 1))
        eval_batches(info, batch_size=config.eval_batch_size,
                     num_batches=config.eval.num_batches, rows=rows)
    return {"path": info.data_dir, "status": "ok", "num_records": info.num_records,
            "eval_num_records": info.eval_num_records, "vocab_size": info.vocab_size,
            "tokenizer": info.tokenizer, "token_dtype": info.token_dtype}


def _pipeline_report(config: Config, stages: int, abstract_params: Any, layout: ModelLayout
                     ) -> dict[str, Any] | None:
    if stages == 1:
        return None
    from .pipeline import Schedule

    schedule = Schedule.of(config, stages)
    size = layout.layers_per_unit
    return {"stages": stages, "microbatches": schedule.microbatches,
            "repeats": schedule.repeats,
            "layers_per_stage": layout.units // stages * size,
            "layers_per_block": schedule.block_layers(layout.units) * size,
            "block_unrolled": schedule.unrolled(layout.units),
            "bubble_fraction": round(schedule.bubble, 4),
            "permutes_per_step": 2 * schedule.permutes_per_pass
            * config.train.grad_accum_steps,
            # Summed over the stages once a step (pipeline.py): the gradients of the embedding,
            # the head (tied or not) and the final norm; a layer's never crosses the stage axis.
            "reduced_across_stages_bytes": sum(
                int(np.prod(leaf.shape)) * leaf.dtype.itemsize
                for key, part in abstract_params.items() if key != "blocks"
                for leaf in jax.tree.leaves(part))}


@functools.lru_cache(maxsize=4)  # --check asks twice (its estimate, one sequence's)
def traced_activation_bytes(m: Any, rows: int) -> int:
    """Bytes the model's own loss saves for its backward pass on `rows` sequences on one
    device, under its remat policy: the residuals of an abstract trace (no arrays, nothing
    compiled), whatever the variant computes."""
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint prints

    from .model.loss import next_token_loss
    from .model.registry import build_model

    abstract = nnx.eval_shape(lambda: build_model(m, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        return next_token_loss(model, tokens[:, :-1], tokens[:, 1:], m.loss_chunk_size)[0]

    saved = saved_residuals(loss, state, jax.ShapeDtypeStruct((rows, m.seq_len + 1), "int32"))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in saved
               if "argument" not in why)  # a parameter is not an activation


def model_activation_bytes(config: Config, batch_shards: int, tensor: int, stages: int = 1,
                           rows: int | None = None) -> int:
    """The variant's own estimate (its `activation_bytes` hook, model/registry.py), else the
    dense block's arithmetic for this mesh and schedule scaled by what the variant's own loss
    saves against what that arithmetic says on one device (traced_activation_bytes): a variant
    that keeps more (experts, extra projections) or less than the dense block counts as itself."""
    hook = model_kind(config.model).activation_bytes
    if hook is not None:
        return int(hook(config, batch_shards, tensor, stages, rows))
    dense = activation_bytes_estimate(config, batch_shards, tensor, stages, rows)
    one = 1 if rows is None else rows  # the ratio is per sequence: one suffices
    ratio = (traced_activation_bytes(config.model, one)
             / activation_bytes_estimate(config, 1, 1, 1, one))
    return int(dense * ratio)


def check_report(config: Config, run_dir: str | None,
                 device_memory_gib: float | None = None) -> dict[str, Any]:
    """The --check JSON: raises ConfigError or DataError (exit 2) on what would fail later,
    including a memory estimate beyond what one device has (`device_memory_gib`, else the
    runtime's own limit where it reports one)."""
    from .train_step import build_program

    topology = current_topology()
    resolved = resolve(config, topology)
    layout = describe(m := config.model)
    mesh = build_mesh(resolved)
    program = build_program(config, mesh)  # traces only: jit compiles on first call
    data = _data_report(config, run_dir, program.batch_sharding)
    init_from = _init_from_report(config)
    state = _state_bytes_per_device(program.abstract_state)
    activations = model_activation_bytes(config, resolved.batch_shards, resolved.tensor,
                                         resolved.pipeline)
    gradients = state["params"]  # same shapes and shardings as the parameters
    total = state["params"] + state["opt_state"] + gradients + activations
    if device_memory_gib is not None:
        limit, source = int(device_memory_gib * GIB), "--device-memory-gib"
    else:
        limit, source = device_memory_bytes()
    if limit is not None and total > limit:
        parts = (f"parameters {state['params'] / GIB:.2f}, optimizer state "
                 f"{state['opt_state'] / GIB:.2f}, gradients {gradients / GIB:.2f}, activations "
                 f"about {activations / GIB:.2f}")
        raise ConfigError(
            f"the train step needs about {total / GIB:.2f} GiB per device ({parts}) but a device "
            f"has {limit / GIB:.2f} GiB ({source}); shard more (mesh.ici_fsdp), recompute more "
            "(model.remat), split the batch (train.grad_accum_steps), chunk the loss "
            "(model.loss_chunk_size) or split the layers into stages (mesh.ici_pipeline)")
    one_sequence = model_activation_bytes(config, resolved.batch_shards, resolved.tensor,
                                          resolved.pipeline, rows=1)
    if limit is None and jax.devices()[0].platform == "cpu" and one_sequence > host_share_bytes():
        # The batch may be a TPU's to hold (this check is how a laptop checks a TPU config), but
        # when one sequence's activations and logits exceed this host, no batch, accumulation
        # or mesh runs it here: the sequence length or the vocabulary is the problem.
        share = host_share_bytes()
        raise ConfigError(
            f"one sequence's activations and logits need about {one_sequence / GIB:.2f} GiB "
            f"(model.seq_len {m.seq_len}, model.vocab_size {m.vocab_size}) but this host has "
            f"{share / GIB:.2f} GiB per CPU device ({jax.local_device_count()} devices); lower "
            "model.seq_len, set model.loss_chunk_size (logits) or model.remat (activations), or "
            "give --device-memory-gib to check a TPU's fit instead")
    return {
        "status": "ok",
        "param_count": param_count(m),
        "flops_per_token": flops_per_token(m),
        "mesh": {"pipeline": resolved.pipeline, "data": resolved.data, "fsdp": resolved.fsdp,
                 "tensor": resolved.tensor, "ici": list(resolved.ici), "dcn": list(resolved.dcn),
                 "axes": list(resolved.axes),
                 **{axis: resolved.size(axis) for axis in resolved.axes}},
        "devices": mesh.size,
        "num_slices": topology.num_slices,
        "device_kind": jax.devices()[0].device_kind,
        "tokens_per_step": config.train.global_batch_size * m.seq_len,
        "memory_per_device_gib": {
            "params": round(state["params"] / GIB, 4),
            "optimizer_state": round(state["opt_state"] / GIB, 4),
            "gradients": round(gradients / GIB, 4),
            "activations_estimate": round(activations / GIB, 4),
            "total_estimate": round(total / GIB, 4),
            "device_limit": round(limit / GIB, 4) if limit is not None else None,
            "device_limit_source": source,
        },
        "model": model_report(m, layout),
        "grad_accum_steps": config.train.grad_accum_steps,
        "pipeline": _pipeline_report(config, resolved.pipeline,
                                     program.abstract_state["params"], layout),
        "data": data,
        "init_from": init_from,
    }


# Keys only a model's own code reads: --check shows those the variant read while it was built.
ARCHITECTURE_KEYS = ("attention", "mlp", "n_kv_heads", "head_dim", "d_ff", "norm_eps",
                     "tie_embeddings", "rope_theta")


def model_report(m: Any, layout: ModelLayout) -> dict[str, Any]:
    """--check's model summary: what the toolkit reads of every variant, its layer stack, and
    the architecture keys this variant read (a key it ignores is not shown as if it held)."""
    derived = {"n_kv_heads": m.kv_heads, "head_dim": m.head_size}
    shown = {key: derived.get(key, getattr(m, key)) for key in ARCHITECTURE_KEYS
             if key in layout.reads}
    return {"kind": layout.kind, "n_layers": m.n_layers, "stacked_units": layout.units,
            "layers_per_unit": layout.layers_per_unit, **shown, "remat": m.remat,
            "scan_layers": m.scan_layers, "loss_chunk_size": m.loss_chunk_size}


def _init_from_report(config: Config) -> dict[str, Any] | None:
    """train.init_from opens as a weights directory (or a run's checkpoint) whose shapes are the
    model's: what a fresh run would refuse after compiling, refused here (WeightsError)."""
    if not config.train.init_from:
        return None
    from .hf.weights import open_params

    check_reachable(config.train.init_from)
    source = open_params(config.train.init_from)
    source.what = f"train.init_from={config.train.init_from}"
    source.check_shapes(config.model, "convert the checkpoint for this model or use the preset "
                                      "it was converted for")
    return {"path": config.train.init_from, "status": "ok"}
