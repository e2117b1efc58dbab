"""`multislice plan`: the command line, and where its inputs come from (flags, an
experiment's preset, a stack)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.stack_config.mesh import MESH_KEYS
from infra.stack_config.topology import MAX_SLICES
from scripts.argtypes import fraction, int_range, mesh_axis, positive_int, report_error
from scripts.plan.formulas import DTYPE_BYTES, PlanError, transformer_params
from scripts.plan.output import format_plan, plan_to_json
from scripts.plan.pipeline import BUBBLE_TARGET
from scripts.plan.planner import Plan, make_plan, parse_count


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="DCN arithmetic, HBM fit and a parallelism recommendation for a multislice job",
        description="Check a Multislice job before paying for it: is data parallelism across "
        "slices compute-bound over the data-center network, does the training state fit in HBM, "
        "and which parallelism to use. The per-slice batch must be large enough that the "
        "backward pass does more FLOPs per bit of DCN traffic than a host can send. The model "
        "and batch come from a stack file (--stack-config), an experiment's preset "
        "(--experiment DIR --config NAME), or the size flags.",
    )
    source = parser.add_argument_group("what to plan (a stack, an experiment, or sizes)")
    source.add_argument("--stack-config", type=Path, metavar="FILE",
                        help="a stacks/Pulumi.STACK.yaml: accelerator, slices, mesh and the "
                        "experiment's preset with the stack's trainer settings")
    source.add_argument("--experiment", type=Path, metavar="DIR",
                        help="an experiment directory (multislice new): its preset gives the "
                        "model and the batch")
    source.add_argument("--config", default=None, metavar="NAME",
                        help="with --experiment: the preset (default: default)")
    source.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="with --experiment: a config override")
    parser.add_argument("--accelerator-type", help="e.g. v4-8, v5litepod-16")
    parser.add_argument("--slices", type=int_range(2, MAX_SLICES), help=f"2 to {MAX_SLICES}")
    parser.add_argument("--tokens-per-batch", type=parse_count,
                        help="global tokens per step (default with an experiment: "
                        "train.global_batch_size x model.seq_len)")
    size = parser.add_argument_group("model size (--params, or the model's dimensions)")
    size.add_argument("--params", type=parse_count, help="parameter count, e.g. 8e9 or 8B")
    size.add_argument("--d-model", type=positive_int)
    size.add_argument("--n-layers", type=positive_int)
    size.add_argument("--vocab-size", type=positive_int, default=None,
                      help="default 256 (bytes)")
    size.add_argument("--d-ff", type=positive_int, help="default 4 x d-model")
    size.add_argument("--untied-embeddings", action="store_true")
    mesh = parser.add_argument_group("a mesh to check (optional; -1 fills the rest of a group)")
    for key in MESH_KEYS:
        mesh.add_argument(f"--{key.replace('_', '-')}", type=mesh_axis, default=None)
    parser.add_argument("--pipeline-microbatches", type=positive_int, default=None, metavar="M",
                        help="GPipe micro-batches for a pipeline (default: the fewest that "
                        f"split the batch with a bubble of at most {BUBBLE_TARGET * 100:.0f}%%)")
    parser.add_argument("--pipeline-repeats", type=positive_int, default=None, metavar="R",
                        help="laps of a circular pipeline (default: 1 when enough micro-batches "
                        "split the batch, else the fewest that reach the bubble target)")
    parser.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default=None,
                        help="default float32 (with an experiment: its model.param_dtype)")
    parser.add_argument(
        "--hbm-budget",
        type=fraction(allow_zero=False, allow_one=True),
        default=0.75,
        help="share of HBM the training state may use (default 0.75; activations need the rest)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=main)


SIZE_FLAGS = ("params", "d_model", "n_layers", "vocab_size", "d_ff", "untied_embeddings")


@dataclass
class Inputs:
    """What the plan is made of, from the flags, an experiment or a stack."""
    accelerator_type: str
    slices: int
    params: float
    tokens_per_batch: float
    mesh_args: dict[str, int | None]
    param_dtype: str
    d_model: int | None
    n_layers: int | None
    embedding_params: int
    batch_sequences: int | None = None
    model_source: str | None = None
    stack_file: str | None = None
    stack_trainer: dict[str, Any] | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    flops_per_token: float | None = None  # the experiment's own arithmetic, when it has one
    layers_text: str | None = None  # n_layers in the messages, when it counts a variant's units
    # where the model came from, so the recommendation can be put to its own resolve
    experiment: Path | None = None
    preset: str | None = None
    overrides: tuple[str, ...] = ()


def _params_from_args(args: argparse.Namespace) -> float:
    dims = {"--d-model": args.d_model, "--n-layers": args.n_layers}
    if args.params is not None:
        if any(v is not None for v in dims.values()):
            raise PlanError("give either --params or --d-model/--n-layers, not both")
        return args.params
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise PlanError(f"model size missing: give --params, or {' and '.join(missing)}, or "
                        "--experiment DIR --config NAME, or --stack-config FILE")
    return transformer_params(
        args.d_model, args.n_layers, args.vocab_size or 256, args.d_ff,
        tied=not args.untied_embeddings
    )


def _inputs_from_flags(args: argparse.Namespace) -> Inputs:
    missing = [flag for flag, value in (("--accelerator-type", args.accelerator_type),
                                        ("--slices", args.slices),
                                        ("--tokens-per-batch", args.tokens_per_batch))
               if value is None]
    if missing:
        raise PlanError(f"give {', '.join(missing)} (or --stack-config FILE, which has them)")
    vocab = args.vocab_size or 256
    return Inputs(
        accelerator_type=args.accelerator_type, slices=args.slices,
        params=_params_from_args(args), tokens_per_batch=args.tokens_per_batch,
        mesh_args={k: getattr(args, k) for k in MESH_KEYS},
        param_dtype=args.param_dtype or "float32", d_model=args.d_model,
        n_layers=args.n_layers,
        embedding_params=(vocab * args.d_model * (2 if args.untied_embeddings else 1)
                          if args.params is None else 0))


def _inputs_from_experiment(args: argparse.Namespace, experiment: Path, preset: str,
                            overrides: list[str], accelerator_type: str | None,
                            slices: int | None, mesh_args: dict[str, int | None]) -> Inputs:
    from infra.packaging.experiment import ExperimentError, model_summary

    given = [f"--{k.replace('_', '-')}" for k in SIZE_FLAGS if getattr(args, k)]
    if given:
        raise PlanError(f"{', '.join(given)}: the model comes from {experiment} --config "
                        f"{preset}; drop the size flags (or use --set model.KEY=VALUE)")
    missing = [flag for flag, value in (("--accelerator-type", accelerator_type),
                                        ("--slices", slices)) if value is None]
    if missing:
        raise PlanError(f"give {' and '.join(missing)} (or --stack-config FILE, which has them)")
    try:
        summary = model_summary(experiment, preset, overrides)
    except ExperimentError as exc:
        raise PlanError(str(exc)) from None
    model, train = summary["model"], summary["train"]
    # The stages split the variant's stack: model.n_layers, or its units of several layers.
    units, per_unit = int(summary.get("units") or model["n_layers"]), summary.get("layers_per_unit")
    layers_text = (f"model.n_layers = {model['n_layers']} ({units} units of {per_unit} layers: "
                   f"model.kind = {model.get('kind')!r} repeats its layers in units of "
                   f"{per_unit})" if per_unit and per_unit > 1 else None)
    seq_len, batch = int(model["seq_len"]), int(train["global_batch_size"])
    tokens = args.tokens_per_batch or batch * seq_len
    accum = max(int(train.get("grad_accum_steps") or 1), 1)
    block = {"config": preset, "overrides": _override_values(overrides)}
    if args.tokens_per_batch and args.tokens_per_batch != batch * seq_len:
        # The plan is for this batch: the paste trains it (train.global_batch_size).
        if args.tokens_per_batch % seq_len:
            raise PlanError(f"--tokens-per-batch {args.tokens_per_batch:,.0f} is not a whole "
                            f"number of {seq_len:,}-token sequences (model.seq_len of {preset}); "
                            f"use a multiple of {seq_len:,}")
        batch = int(args.tokens_per_batch // seq_len)
        block["overrides"]["train.global_batch_size"] = batch
    if not block["overrides"]:
        del block["overrides"]
    return Inputs(
        accelerator_type=accelerator_type, slices=slices, params=summary["param_count"],
        tokens_per_batch=tokens, mesh_args=mesh_args,
        param_dtype=args.param_dtype or ("bfloat16" if model["param_dtype"] == "bfloat16"
                                         else "float32"),
        d_model=model["d_model"], n_layers=units, layers_text=layers_text,
        embedding_params=model["vocab_size"] * model["d_model"]
        * (1 if model["tie_embeddings"] else 2),
        batch_sequences=batch // accum,
        model_source=f"{experiment} --config {preset}"
        + "".join(f" --set {o}" for o in overrides if not o.startswith("mesh.")),
        stack_trainer=block, seq_len=seq_len, grad_accum=accum,
        flops_per_token=summary.get("flops_per_token"), experiment=experiment, preset=preset,
        overrides=tuple(o for o in overrides if not o.startswith("mesh."))
        + tuple(f"{k}={v}" for k, v in block.get("overrides", {}).items()
                if k == "train.global_batch_size"))


def _added_axes(overrides: list[str]) -> dict[str, int | None]:
    """`--set mesh.ici_NAME=N` (or dcn_NAME) of an axis the experiment adds: kept as given, the
    plan choosing the built-in axes around it."""
    from infra.stack_config.mesh import FORK_AXIS_KEY

    added: dict[str, int | None] = {}
    for item in overrides:
        key, _, text = item.partition("=")
        name = key.removeprefix("mesh.")
        if key.startswith("mesh.") and name not in MESH_KEYS and FORK_AXIS_KEY.match(name):
            try:
                added[name] = int(text)
            except ValueError:
                raise PlanError(f"--set {item}: the size of a mesh axis is an integer") from None
    return added


def _override_values(overrides: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` overrides (not the mesh: the plan chooses it) as the mapping a stack's
    trainer.overrides holds, each value read as the trainer reads it (TOML; a bare word is a
    string)."""
    import tomllib

    values: dict[str, Any] = {}
    for item in overrides:
        key, _, text = item.partition("=")
        if key.startswith("mesh."):
            continue
        try:
            values[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = text
    return values


def _inputs_from_stack(args: argparse.Namespace) -> Inputs:
    from infra.packaging.experiment import trainer_overrides
    from infra.stack_config.schema import StackConfigError
    from infra.stack_config.stack_file import find_project_root, project_name, read_stack_file
    from infra.stack_config.validation import load_stack_file

    given = [flag for flag, value in (("--experiment", args.experiment),
                                      ("--config", args.config),
                                      ("--set", args.overrides),
                                      ("--accelerator-type", args.accelerator_type),
                                      ("--slices", args.slices),
                                      *((f"--{k.replace('_', '-')}", getattr(args, k))
                                        for k in MESH_KEYS)) if value]
    if given:
        raise PlanError(f"{', '.join(given)}: --stack-config {args.stack_config} already says "
                        "that; change the stack file instead")
    path = args.stack_config
    if not path.is_file():
        raise PlanError(f"--stack-config {path}: no such file (a stacks/Pulumi.STACK.yaml)")
    try:
        root = find_project_root(path.parent)
        cfg = load_stack_file(path, base_dir=root, check_files=False)
        raw = read_stack_file(path, project_name(root))
    except StackConfigError as exc:
        raise PlanError(str(exc)) from None
    if cfg.trains_nothing():
        raise PlanError(f"--stack-config {path}: {cfg.trains_nothing()}")
    if cfg.slices < 2:
        raise PlanError(f"--stack-config {path}: slices {cfg.slices}: a single slice sends "
                        "nothing over DCN, so there is nothing to plan (Multislice is 2 to "
                        f"{MAX_SLICES} slices)")
    preset, overrides = trainer_overrides(cfg)
    trainer = json.loads(next((v for k, v in raw.items() if k.endswith(":trainer")), "{}"))
    experiment = Path(cfg.experiment_dir)
    inputs = _inputs_from_experiment(
        args, experiment if experiment.is_absolute() else root / experiment, preset, overrides,
        cfg.accelerator_type, cfg.slices,
        mesh_args=dict(cfg.resolved_mesh()))
    inputs.stack_file = str(path)
    inputs.stack_trainer = trainer if isinstance(trainer, dict) else {}
    return inputs


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    if args.stack_config is not None:
        return _inputs_from_stack(args)
    if args.experiment is not None:
        return _inputs_from_experiment(
            args, args.experiment, args.config or "default", list(args.overrides),
            args.accelerator_type, args.slices,
            {**{k: getattr(args, k) for k in MESH_KEYS}, **_added_axes(args.overrides)})
    if args.config or args.overrides:
        raise PlanError("--config and --set go with --experiment DIR")
    return _inputs_from_flags(args)


def experiment_refusal(inputs: Inputs, plan: Plan) -> str | None:
    """Why the experiment's own config and model refuse the recommendation (the trainer's
    load_config and resolve, parameters included, in its interpreter), or None."""
    from infra.packaging.experiment import ExperimentError, model_summary
    from infra.stack_config.topology import parse_accelerator_type

    assert inputs.experiment is not None and inputs.preset is not None
    rec = plan.recommendation
    keys = {**rec.assessment.mesh.trainer_keys(), **plan.added_axes}
    settings = [f"mesh.{k}={v}" for k, v in keys.items()]
    if rec.global_batch_size is not None:
        settings.append(f"train.global_batch_size={rec.global_batch_size}")
    if rec.assessment.pipeline is not None:
        settings += [f"train.pipeline_microbatches={rec.assessment.pipeline.microbatches}",
                     f"train.pipeline_repeats={rec.assessment.pipeline.repeats}"]
    topo = parse_accelerator_type(inputs.accelerator_type)
    topology = {"num_slices": inputs.slices, "devices_per_slice": topo.devices,
                "num_processes": topo.hosts * inputs.slices}
    try:
        summary = model_summary(inputs.experiment, inputs.preset,
                                [*inputs.overrides, *settings], topology)
    except ExperimentError as exc:
        return str(exc)
    return summary.get("mesh_problem")


def _make(inputs: Inputs, args: argparse.Namespace,
          default_ici: dict[str, int] | None = None) -> Plan:
    return make_plan(
        accelerator_type=inputs.accelerator_type,
        slices=inputs.slices,
        params=inputs.params,
        tokens_per_batch=inputs.tokens_per_batch,
        mesh_args=inputs.mesh_args,
        param_dtype=inputs.param_dtype,
        hbm_budget=args.hbm_budget,
        d_model=inputs.d_model,
        n_layers=inputs.n_layers,
        embedding_params=inputs.embedding_params,
        microbatches=args.pipeline_microbatches,
        batch_sequences=inputs.batch_sequences,
        repeats=args.pipeline_repeats,
        seq_len=inputs.seq_len,
        grad_accum=inputs.grad_accum,
        flops_per_token=inputs.flops_per_token,
        default_ici=default_ici,
        layers_text=inputs.layers_text,
    )


def plan_for_experiment(inputs: Inputs, args: argparse.Namespace) -> Plan:
    """The plan, its recommendation accepted by the experiment: when the model refuses FSDP
    over the whole slice (a dimension it does not divide), the largest FSDP it accepts, the
    rest of the slice data parallel; a mesh the user gave is checked, never changed."""
    plan = _make(inputs, args)
    if inputs.experiment is None or plan.recommendation.strategy == "does_not_fit":
        return plan
    refused = experiment_refusal(inputs, plan)
    if refused is None:
        return plan
    first = " ".join(f"{k}={v}" for k, v in plan.recommendation.assessment.mesh.trainer_keys()
                     .items() if v != 1)
    devices = plan.recommendation.assessment.mesh.ici_fsdp
    user_ici = any(inputs.mesh_args.get(k) is not None for k in MESH_KEYS if k.startswith("ici_"))
    if not user_ici:
        for fsdp in sorted((d for d in range(1, devices) if devices % d == 0), reverse=True):
            other = _make(inputs, args, {"ici_fsdp": fsdp, "ici_data": devices // fsdp})
            if other.recommendation.strategy != "does_not_fit" and (
                    experiment_refusal(inputs, other) is None):
                other.recommendation.reasons.insert(0, (
                    f"{inputs.model_source} refuses {first}: {refused}. ici_fsdp={fsdp} with "
                    f"ici_data={devices // fsdp} is the largest FSDP inside a slice it accepts."))
                return other
    raise PlanError(f"the recommended mesh ({first}) is refused by {inputs.model_source}: "
                    f"{refused}")


def main(args: argparse.Namespace) -> int:
    try:
        inputs = inputs_from_args(args)
        plan = plan_for_experiment(inputs, args)
    except PlanError as exc:
        report_error("plan", exc)
        return 2
    plan.model_source = inputs.model_source
    plan.stack_file, plan.stack_trainer = inputs.stack_file, inputs.stack_trainer
    print(json.dumps(plan_to_json(plan), indent=2) if args.json else format_plan(plan))
    return 0
