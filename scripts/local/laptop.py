"""A stack's trainer at laptop scale: the model, batch and steps that a 2-core machine runs in
minutes, for `multislice local --stack-config` and `multislice rehearse`.

A stack describes a TPU job (an 85M-parameter model, 256 sequences of 1024 tokens a step, 10,000
steps), which on CPU needs tens of GB and days. Each of three things is scaled only when it is
over its budget, and each can be kept (`--keep-model`, `--keep-batch`, `--keep-steps`):

- the model: when the stack's model (its preset and overrides, counted by the experiment's own
  code) has more than MAX_PARAMS parameters, every model key of the experiment's LAPTOP_PRESET
  preset that differs is overridden, except the vocabulary (the stack's data keeps its tokens);
  the stack's optimizer, data, checkpoint and eval settings stay. `train.init_from` is dropped:
  its weights have the stack's shapes.
- the batch: at most MAX_TOKENS_PER_STEP tokens a step, the largest divisor of the stack's
  global batch that still splits over the scaled mesh's batch shards and processes; the eval
  batches follow (at most MAX_EVAL_BATCHES of at most the new batch), so the held-out split of
  the emulation's corpus holds them.
- the steps: at most MAX_STEPS, the learning-rate schedule (`train.total_steps`,
  `optim.warmup_steps`) compressed by the same factor, and the checkpoint and log intervals
  brought down so that the short run still warms up, decays, checkpoints (and resumes) and prints
  as the long one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.argtypes import UsageError

LAPTOP_PRESET = "tiny"
MAX_PARAMS = 10_000_000
MAX_TOKENS_PER_STEP = 4096
MAX_STEPS = 100
MAX_EVAL_BATCHES = 2
CHECKPOINTS_PER_RUN = 10  # at least this many saves in a scaled run
LOG_LINES_PER_RUN = 20
BATCH_AXES = ("ici_data", "ici_fsdp", "dcn_data", "dcn_fsdp")


@dataclass(frozen=True)
class Keep:
    """What the user asked to keep as the stack has it."""

    model: bool = False
    batch: bool = False
    steps: bool = False


def _millions(count: int) -> str:
    return f"{count / 1e6:.1f}M"


def _batch_for(batch: int, seq_len: int, need: int) -> int:
    """The largest divisor of `batch` that is a multiple of `need` and within the token budget;
    else the smallest such divisor; else `need` itself."""
    fits = [b for b in range(need, batch + 1, need) if batch % b == 0]
    within = [b for b in fits if b * seq_len <= MAX_TOKENS_PER_STEP]
    return max(within) if within else min(fits, default=need)


def _summary(experiment: Path, preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The experiment's own account of the model, as the trainer would build it."""
    from infra.boot.launch import toml_scalar
    from infra.packaging.experiment import ExperimentError, model_summary

    try:
        return model_summary(experiment, preset,
                             [f"{k}={toml_scalar(v)}" for k, v in overrides.items()])
    except ExperimentError as exc:
        raise UsageError(str(exc)) from None


def laptop_trainer(trainer: dict[str, Any], experiment: Path, mesh: dict[str, int],
                   processes: int, keep: Keep, steps: int | None = None,
                   ) -> tuple[dict[str, Any], list[str]]:
    """The stack's `trainer` section (as JSON, `StackConfig.model_dump(mode="json")`) scaled for
    the emulated `mesh` of `processes` processes, and one phrase for each thing scaled. `steps`:
    the run's steps the user asked for (else at most MAX_STEPS, unless kept)."""
    out = {**trainer, "overrides": dict(trainer.get("overrides") or {})}
    overrides: dict[str, Any] = out["overrides"]
    stack_steps = int(out.get("steps") or 1)
    target = steps if steps is not None else None if keep.steps else min(stack_steps, MAX_STEPS)
    if keep.model and keep.batch and target in (None, stack_steps):
        return out, []  # nothing to scale: the experiment need not be asked
    preset = str(out.get("config") or "default")
    stack = _summary(experiment, preset, overrides)
    said: list[str] = []

    model = dict(stack["model"])
    if not keep.model and stack["param_count"] > MAX_PARAMS:
        from infra.packaging.experiment import presets

        if LAPTOP_PRESET not in presets(experiment):
            said.append(f"model {preset} kept ({_millions(stack['param_count'])} parameters; "
                        f"the experiment has no {LAPTOP_PRESET} preset to scale it to)")
        else:
            small = _summary(experiment, LAPTOP_PRESET, {})["model"]
            for key, value in small.items():
                if (key != "vocab_size" and model.get(key) != value
                        and isinstance(value, str | int | float | bool)):
                    overrides[f"model.{key}"] = value
                    model[key] = value
            scaled = _summary(experiment, preset, overrides)["param_count"]
            said.append(f"model {preset} {_millions(stack['param_count'])} -> the "
                        f"{LAPTOP_PRESET} preset's shape ({_millions(scaled)} parameters; "
                        "--keep-model keeps it)")
            if stack["train"].get("init_from"):
                overrides["train.init_from"] = ""
                said.append(f"train.init_from {stack['train']['init_from']} dropped (weights "
                            "of the stack's model)")

    seq_len = int(model.get("seq_len", 1))
    batch = int(stack["train"]["global_batch_size"])
    accum = int(stack["train"].get("grad_accum_steps", 1) or 1)
    shards = math.prod(int(mesh.get(k, 1)) for k in BATCH_AXES)
    need = math.lcm(accum * shards, processes)
    evaluation = stack.get("eval") or {}
    if not keep.batch and batch * seq_len > MAX_TOKENS_PER_STEP:
        new_batch = _batch_for(batch, seq_len, need)
        if new_batch != batch:
            overrides["train.global_batch_size"] = new_batch
            said.append(f"batch {batch} -> {new_batch} sequences of {seq_len} tokens "
                        "(--keep-batch keeps it)")
            batch = new_batch
    if not keep.batch and evaluation.get("num_batches"):
        eval_batch = int(evaluation.get("batch_size") or 0)
        num = int(evaluation["num_batches"])
        if eval_batch > batch:
            overrides["eval.batch_size"] = 0  # the (scaled) train batch
        if num > MAX_EVAL_BATCHES:
            overrides["eval.num_batches"] = MAX_EVAL_BATCHES
        if eval_batch > batch or num > MAX_EVAL_BATCHES:
            said.append(f"eval {num} x {eval_batch or batch} -> "
                        f"{min(num, MAX_EVAL_BATCHES)} x {min(eval_batch or batch, batch)} "
                        "sequences")

    if target is not None and target != stack_steps:
        out["steps"] = target
        said.append(_scale_schedule(stack, stack_steps, target, overrides)
                    + ("" if steps is not None else " (--keep-steps keeps them)"))
    return out, said


def _scale_schedule(stack: dict[str, Any], steps: int, target: int,
                    overrides: dict[str, Any]) -> str:
    """Steps `steps` -> `target`; a shorter run also compresses the learning-rate schedule and
    brings its checkpoint and log intervals down. Returns the phrase that says so."""
    phrase = f"steps {steps} -> {target}"
    if target > steps:
        return phrase
    ratio = target / steps
    horizon = int(stack["train"].get("total_steps") or 0)
    warmup = int((stack.get("optim") or {}).get("warmup_steps") or 0)
    if horizon > target:
        overrides["train.total_steps"] = max(target, round(horizon * ratio))
        if warmup:
            overrides["optim.warmup_steps"] = max(1, round(warmup * ratio))
        phrase += (f", the schedule with them (total_steps {horizon} -> "
                   f"{overrides['train.total_steps']}, warmup {warmup} -> "
                   f"{overrides.get('optim.warmup_steps', 0)})")
    every = int((stack.get("checkpoint") or {}).get("save_interval_steps") or 0)
    if every > max(1, target // CHECKPOINTS_PER_RUN):
        overrides["checkpoint.save_interval_steps"] = max(1, target // CHECKPOINTS_PER_RUN)
        phrase += (f", a checkpoint every {every} -> "
                   f"{overrides['checkpoint.save_interval_steps']}")
    log_every = int((stack.get("metrics") or {}).get("log_every") or 0)
    if log_every > max(1, target // LOG_LINES_PER_RUN):
        overrides["metrics.log_every"] = max(1, target // LOG_LINES_PER_RUN)
    return phrase


def add_keep_arguments(parser: Any) -> None:
    """--keep-model, --keep-batch, --keep-steps: run that part of the stack as it is."""
    parser.add_argument("--keep-model", action="store_true",
                        help=f"run the stack's model as it is (default: over {_millions(MAX_PARAMS)}"
                        f" parameters it takes the experiment's {LAPTOP_PRESET} preset's shape)")
    parser.add_argument("--keep-batch", action="store_true",
                        help="run the stack's global batch and eval batches as they are "
                        f"(default: at most {MAX_TOKENS_PER_STEP} tokens a step, "
                        f"{MAX_EVAL_BATCHES} eval batches)")
    parser.add_argument("--keep-steps", action="store_true",
                        help=f"run the stack's steps (default: at most {MAX_STEPS}, with "
                        "checkpoints and logs at least as often as in the stack's run)")


def kept_suffix(keep: Keep) -> str:
    """What a default run directory adds for a run that kept part of the stack: a run at another
    scale is another run (its checkpoints and data have other shapes)."""
    return "".join(f"-keep-{name}" for name in ("model", "batch", "steps")
                   if getattr(keep, name))


def keep_from(args: Any) -> Keep:
    return Keep(model=args.keep_model, batch=args.keep_batch, steps=args.keep_steps)
