"""What a stack needs from its experiment directory, checked at preview (no pulumi import).

An experiment is a `multislice new` project. Before anything is created the stack's trainer
settings are checked by the experiment's *own* config code (``trainer/config.py``), with the very
``--config``/``--seed``/``--set`` arguments the VMs will pass (infra/boot/launch.py) and the stack's
topology, so a preset that does not exist, a misspelled override or a batch that does not divide
over the mesh fails at ``pulumi preview``, not an hour into provisioning.

The config code runs in a child interpreter (``python -I``): each experiment has its own
``trainer`` package, which must not be imported into the Pulumi program's process.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infra.stack_config.schema import StackConfig

EXPERIMENT_REQUIRED = ("pyproject.toml", "configs", "trainer/main.py")
CONFIG_CHECK_TIMEOUT_S = 60.0

# Runs inside the child interpreter with the experiment directory first on sys.path.
_CHECK_CODE = """
import json, sys
exp, payload = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, exp)
try:
    from trainer import config as c
    load, resolve, Topology, ConfigError = c.load_config, c.resolve, c.Topology, c.ConfigError
except (ImportError, AttributeError) as exc:
    print(json.dumps({"skipped": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
try:
    config = load(payload["config"], payload["overrides"])
    try:  # a fork whose config's resolve also built the model: not here (that imports jax)
        resolve(config, Topology(**payload["topology"]), check_parameters=False)
    except TypeError:  # the config alone; the model's checks run with its count (_MODEL_CODE)
        resolve(config, Topology(**payload["topology"]))
except ConfigError as exc:
    print(json.dumps({"problem": str(exc)}))
else:
    data, train = getattr(config, "data", None), getattr(config, "train", None)
    print(json.dumps({"ok": True, "paths": {
        "data.path": str(getattr(data, "path", "") or ""),
        "train.init_from": str(getattr(train, "init_from", "") or "")}}))
"""


# The model a preset describes, counted by the experiment's own code (what the trainer logs).
_MODEL_CODE = """
import dataclasses, json, sys
exp, payload = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, exp)
from trainer import config as c
try:
    config = c.load_config(payload["config"], payload["overrides"])
except c.ConfigError as exc:
    print(json.dumps({"problem": str(exc)}))
    raise SystemExit(0)
flops_per_token = None
try:
    from trainer.model.registry import flops_per_token, param_count  # the preset's model.kind
except ModuleNotFoundError:  # a fork from before model variants: the one transformer
    try:
        from trainer.model.transformer import param_count
    except ModuleNotFoundError:  # a fork rendered before trainer/ had folders: trainer/model.py
        from trainer.model import param_count
try:
    count = param_count(config.model)
    work = flops_per_token(config.model) if flops_per_token else None
except c.ConfigError as exc:  # say, a model.kind no module registers
    print(json.dumps({"problem": str(exc)}))
    raise SystemExit(0)
try:  # the checks that ask the model variant (its stack over the stages, its parameters)
    from trainer.model.checks import resolve
    from trainer.model.registry import describe
except ModuleNotFoundError:  # a fork from before them: the config's resolve checked both
    resolve, describe = c.resolve, None
stack = {}
if describe is not None:
    try:
        layout = describe(config.model)
        stack = {"units": layout.units, "layers_per_unit": layout.layers_per_unit}
    except c.ConfigError as exc:
        print(json.dumps({"problem": str(exc)}))
        raise SystemExit(0)
mesh_problem = None
if payload.get("topology"):  # every parameter divides over the mesh (the trainer's own check)
    try:
        topology = c.Topology(**payload["topology"])
        resolve(config, topology)
        try:  # every size an elastic job may shrink to (elastic.min_slices)
            from trainer.runtime import elastic
        except ModuleNotFoundError:  # a fork from before elastic slices
            elastic = None
        if elastic is not None:
            elastic.check_every_size(config, topology.num_slices, topology, resolve)
    except c.ConfigError as exc:
        mesh_problem = str(exc)
sections = {name: dataclasses.asdict(getattr(config, name))
            for name in ("model", "train", "optim", "eval", "checkpoint", "metrics")
            if dataclasses.is_dataclass(getattr(config, name, None))}
print(json.dumps({**sections, "param_count": count, "flops_per_token": work,
                  "mesh_problem": mesh_problem, **stack}))
"""


def _last_json_line(stdout: str) -> dict:
    """The child's answer: its last line of output, a JSON object ({} when it printed none)."""
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}
    return result if isinstance(result, dict) else {}


class ExperimentError(ValueError):
    """An experiment or preset that cannot be read; the message names it."""


def _code_fingerprint(experiment: Path) -> tuple[tuple[str, int, int], ...]:
    """What a model summary depends on: every preset and trainer module, by path, size and
    modification time (a stat each: no file is read)."""
    found = []
    for folder, pattern in (("configs", "*.toml"), ("trainer", "*.py")):
        for path in sorted((experiment / folder).rglob(pattern)):
            with contextlib.suppress(OSError):
                info = path.stat()
                found.append((str(path.relative_to(experiment)), info.st_size, info.st_mtime_ns))
    return tuple(found)


# One process asks the same many times (the render of two manifests, then the rehearsal's
# scaling of the stack): each answer is a child interpreter importing jax.
_SUMMARIES: dict[tuple[Any, ...], dict] = {}
_MAX_SUMMARIES = 64


def model_summary(experiment: Path, preset: str, overrides: list[str],
                  topology: dict[str, int] | None = None) -> dict:
    """{model, train, param_count} of `preset` with `overrides` (and its optim, eval, checkpoint
    and metrics sections where the fork has them), from the experiment's own
    trainer/config.py and trainer/model/transformer.py, run in a child interpreter. Answers are
    kept per process while the experiment's presets and trainer modules are unchanged. With
    `topology` (Topology's fields) `mesh_problem` is the trainer's resolve's refusal, or None."""
    problems = check_experiment_dir(experiment)
    if problems:
        raise ExperimentError(problems[0])
    key = (str(experiment.resolve()), preset, tuple(overrides), _code_fingerprint(experiment),
           tuple(sorted((topology or {}).items())))
    if key not in _SUMMARIES:
        if len(_SUMMARIES) >= _MAX_SUMMARIES:
            _SUMMARIES.clear()
        _SUMMARIES[key] = _ask_model_summary(experiment, preset, overrides, topology)
    return json.loads(json.dumps(_SUMMARIES[key]))  # a copy the caller may change


def _ask_model_summary(experiment: Path, preset: str, overrides: list[str],
                       topology: dict[str, int] | None = None) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _MODEL_CODE, str(experiment),
             json.dumps({"config": preset, "overrides": overrides, "topology": topology})],
            capture_output=True, text=True, timeout=CONFIG_CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ExperimentError(f"{experiment}: reading preset {preset!r} took over "
                              f"{CONFIG_CHECK_TIMEOUT_S:.0f}s") from None
    result = _last_json_line(done.stdout)
    if "problem" in result:
        raise ExperimentError(f"{experiment.name} --config {preset}: {result['problem']}")
    if "param_count" not in result:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExperimentError(f"{experiment}: its trainer/config.py and "
                              f"trainer/model/transformer.py could not describe preset "
                              f"{preset!r} (exit {done.returncode}): {tail}")
    return result


def check_experiment_dir(path: Path) -> list[str]:
    if not path.is_dir():
        return [f"experiment_dir: {str(path)!r} does not exist or is not a directory"]
    missing = [rel for rel in EXPERIMENT_REQUIRED if not (path / rel).exists()]
    if missing:
        return [
            f"experiment_dir: {str(path)!r} is not a template-shaped project: missing "
            f"{', '.join(missing)} (needs {', '.join(EXPERIMENT_REQUIRED)})"
        ]
    return []


def presets(experiment: Path) -> list[str]:
    return sorted(p.stem for p in (experiment / "configs").glob("*.toml"))


def _preset_problems(cfg: StackConfig, experiment: Path) -> list[str]:
    name = cfg.trainer.config
    path = experiment / name if name.endswith(".toml") else experiment / "configs" / f"{name}.toml"
    if path.is_file():
        return []
    return [
        f"trainer.config: {name!r} is not a preset of {experiment.name} (no {path.name} in "
        f"{path.parent}); presets there: {', '.join(presets(experiment)) or 'none'}"
    ]


def _python_problems(cfg: StackConfig, experiment: Path) -> list[str]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        project = tomllib.loads((experiment / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [f"experiment_dir: {experiment / 'pyproject.toml'} does not parse ({exc})"]
    required = project.get("requires-python")
    if not required:
        return []
    try:
        spec = SpecifierSet(required)
    except InvalidSpecifier:
        return [f"experiment_dir: requires-python {required!r} in its pyproject.toml is invalid"]
    if spec.contains(f"{cfg.python_version}.0") or spec.contains(f"{cfg.python_version}.99"):
        return []
    return [
        f"python_version: {cfg.python_version!r} cannot run {experiment.name}, whose "
        f"pyproject.toml requires Python {required}; pick a version it allows"
    ]


def trainer_overrides(cfg: StackConfig) -> tuple[str, list[str]]:
    """(preset, ``section.key=value`` overrides) exactly as the VMs pass them to the trainer."""
    from infra.boot.launch import trainer_argv
    from infra.stack_config import manifest

    argv = trainer_argv(manifest.launch_spec(cfg, "0" * 64))
    preset, overrides = "", []
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--config":
            preset = value
        elif flag == "--set":
            overrides.append(value)
        elif flag == "--seed":
            overrides.append(f"train.seed={value}")  # what trainer/main.py does with --seed
    return preset, overrides


def _trainer_config_problems(cfg: StackConfig, experiment: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) from running the experiment's own config checks."""
    preset, overrides = trainer_overrides(cfg)
    payload = {"config": preset, "overrides": overrides, "topology": stack_topology(cfg)}
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CHECK_CODE, str(experiment), json.dumps(payload)],
            capture_output=True, text=True, timeout=CONFIG_CHECK_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        return [], [f"trainer: the config check of {experiment.name} took over "
                    f"{CONFIG_CHECK_TIMEOUT_S:.0f}s and was skipped"]
    result = _last_json_line(done.stdout)
    if "problem" in result:
        return [f"trainer: {experiment.name}'s config rejects these settings: "
                f"{result['problem']}"], []
    if "skipped" in result:
        return [], [f"trainer: {experiment.name} has no trainer/config.py with load_config and "
                    f"resolve ({result['skipped']}); trainer settings were not checked"]
    if not result.get("ok"):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"trainer: the config check of {experiment.name} crashed (exit "
                f"{done.returncode}): {tail}"], []
    from infra.stack_config.checks import readable_path_problems

    return readable_path_problems(cfg, result.get("paths") or {}), []


def experiment_problems(cfg: StackConfig, experiment: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) for the experiment directory this stack trains."""
    problems = check_experiment_dir(experiment)
    if problems:
        return problems, []
    problems = _preset_problems(cfg, experiment) + _python_problems(cfg, experiment)
    if problems:
        return problems, []
    problems, warnings = _trainer_config_problems(cfg, experiment)
    if not problems:
        problems = model_problems(cfg, experiment)
    return problems + _lock_problems(cfg, experiment), warnings + _archive_warnings(experiment)


# "A TPU VM includes a 100 GiB boot disk" (Cloud TPU docs, attach durable block storage); a GKE
# node's boot disk is 100 GB unless the pool says otherwise, and the stack's pools do not.
HOST_BOOT_DISK_GIB = 100.0
LOCAL_TIER_DISK_SHARE = 0.5  # the rest: the OS image, the environment, the compile cache, logs
ADAM_MOMENT_BYTES = 8  # optax.adamw's two moments, float32, per parameter
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def stack_topology(cfg: StackConfig) -> dict[str, int]:
    """The trainer's Topology fields for the stack's slices."""
    return {"num_slices": cfg.slices, "devices_per_slice": cfg.topology.devices,
            "num_processes": cfg.topology.hosts * cfg.slices}


def model_problems(cfg: StackConfig, experiment: Path) -> list[str]:
    """What the experiment's model refuses on this stack's mesh (a parameter dimension that
    does not divide over its axes: the trainer's own resolve), else the local tier's fit."""
    try:
        summary = model_summary(experiment, *trainer_overrides(cfg), stack_topology(cfg))
    except ExperimentError:
        return []  # the trainer config check reported it
    if summary.get("mesh_problem"):
        return [f"trainer: {experiment.name}'s model does not fit this mesh: "
                f"{summary['mesh_problem']}"]
    return local_tier_problems(cfg, experiment, summary)


def local_tier_problems(cfg: StackConfig, experiment: Path,
                        summary: dict | None = None) -> list[str]:
    """checkpoint.local_every > 0 whose parts cannot fit a host's boot disk: each host keeps
    local_max_to_keep parts plus the one being written, each its share of the train state
    (parameters and Adam's two moments, split over the slice's hosts)."""
    if summary is None:
        try:
            summary = model_summary(experiment, *trainer_overrides(cfg))
        except ExperimentError:
            return []  # the trainer config check reported it
    checkpoint = summary.get("checkpoint") or {}
    every, keep = checkpoint.get("local_every") or 0, checkpoint.get("local_max_to_keep") or 1
    if not every:
        return []
    param_bytes = _DTYPE_BYTES.get(str((summary.get("model") or {}).get("param_dtype")), 4)
    state_gib = summary["param_count"] * (param_bytes + ADAM_MOMENT_BYTES) / 2**30
    part_gib = state_gib / cfg.topology.hosts
    need_gib = (keep + 1) * part_gib
    room_gib = HOST_BOOT_DISK_GIB * LOCAL_TIER_DISK_SHARE
    if need_gib <= room_gib:
        return []
    fits = max(0, int(room_gib // part_gib) - 1)
    return [
        f"trainer: checkpoint.local_every = {every} keeps {keep} + 1 local part(s) of "
        f"{part_gib:.1f} GiB on each host of {cfg.accelerator_type} ({summary['param_count']:,} "
        f"parameters x {param_bytes + ADAM_MOMENT_BYTES} bytes with Adam's moments = "
        f"{state_gib:.1f} GiB a slice, over its {cfg.topology.hosts} host(s)): {need_gib:.1f} GiB, "
        f"over the {room_gib:.0f} GiB the tier may take of a host's {HOST_BOOT_DISK_GIB:.0f} GiB "
        f"boot disk (half of it); lower checkpoint.local_max_to_keep"
        + (f" to {fits}" if fits else "") + ", use a larger accelerator type (more hosts a "
        "slice), or set checkpoint.local_every = 0"]


def _archive_warnings(experiment: Path) -> list[str]:
    from infra.packaging.archive import IGNORE_FILE, large_files

    return [f"experiment_dir: {rel} ({size / 2**20:.0f} MiB) goes into the code archive every VM "
            f"fetches; list it in {experiment / IGNORE_FILE} if the VMs do not need it"
            for rel, size in large_files(experiment)]


def _lock_problems(cfg: StackConfig, experiment: Path) -> list[str]:
    from infra.packaging.lock import LockError, check_lock

    try:
        check_lock(experiment, cfg.python_version)
    except LockError as exc:
        return [f"experiment_dir: {exc}"]
    return []
