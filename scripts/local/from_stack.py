"""`multislice local --stack-config FILE`: a stack's trainer, scaled to this machine's CPUs.

The stack file is read and validated as `pulumi preview` does (infra/stack_config/validation.py), and the
trainer's arguments are the ones a TPU VM runs (infra/boot/launch.py `trainer_argv` of the stack's
launch spec), so a local rehearsal and the job cannot drift apart. The mesh is scaled: each
axis larger than the target is divided by its smallest prime factor, the largest axis first, until
the slice (ICI axes) fits the CPU devices per process and the job (DCN axes) fits the emulated
slices. Every axis shrinks by a factor of itself, so a global batch that divides over the stack's
batch shards still divides over the scaled ones. The model, batch and steps are brought to laptop
scale (scripts/local/laptop.py) unless kept. What was scaled is said in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.stack_config.mesh import group_values
from scripts.argtypes import UsageError
from scripts.local.laptop import Keep, laptop_trainer

DEFAULT_MAX_SLICES = 2
DEFAULT_MAX_DEVICES = 4
LAUNCHER_FLAGS = ("--run-dir", "--expect-slices", "--expect-devices-per-slice")


@dataclass(frozen=True)
class LocalPlan:
    experiment: Path
    slices: int
    devices_per_slice: int
    trainer_args: tuple[str, ...]
    scaled: str  # the one line that says what changed from the stack


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


def scale_axes(axes: dict[str, int], limit: int) -> dict[str, int]:
    """Shrink the largest axis by its smallest prime factor until the product is <= limit."""
    out = dict(axes)
    while math.prod(out.values()) > limit:
        name = max(out, key=lambda k: (out[k], k))
        out[name] //= _smallest_factor(out[name])
    return out


def _exact(axes: dict[str, int], want: int | None, limit: int, what: str, flag: str,
           original: int) -> dict[str, int]:
    scaled = scale_axes(axes, want if want is not None else limit)
    if want is not None and math.prod(scaled.values()) != want:
        raise UsageError(f"{flag} {want}: the stack's {what} ({original}, mesh "
                         f"{_show(axes)}) cannot be scaled to exactly {want}; give a divisor "
                         f"of {original} such as {math.prod(scale_axes(axes, want).values())}")
    return scaled


def _show(axes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in axes.items() if v != 1) or "all 1"


def _drop(argv: list[str], flag_takes: Callable[[str, str], bool]) -> list[str]:
    """The arguments without each (flag, value) pair that `flag_takes(flag, value)` picks."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        if index + 1 < len(argv) and flag_takes(argv[index], argv[index + 1]):
            index += 2
            continue
        out.append(argv[index])
        index += 1
    return out


def load_stack(stack_file: Path, check_files: bool = True) -> tuple[Any, Path]:
    """The stack file validated as `pulumi preview` does (without its experiment's files when
    not `check_files`: a command that only reads the stack's bucket), and the experiment
    directory it names (relative to the project root, the directory holding Pulumi.yaml); a
    stack that trains nothing (a GKE capacity stack) is refused. Raises UsageError."""
    from infra.stack_config.schema import StackConfigError
    from infra.stack_config.userfile import UserFileError, resolve
    from infra.stack_config.validation import find_project_root, load_stack_file

    try:
        path = resolve(stack_file, "--stack-config")
    except UserFileError as exc:
        raise UsageError(str(exc)) from None
    if not path.is_file():
        raise UsageError(f"--stack-config {stack_file}: no such file")
    try:
        cfg = load_stack_file(path, check_files=check_files)
    except StackConfigError as exc:
        raise UsageError(f"--stack-config {stack_file}: {exc}") from None
    if cfg.trains_nothing():
        raise UsageError(f"--stack-config {stack_file}: {cfg.trains_nothing()}")
    experiment = Path(cfg.experiment_dir)
    if not experiment.is_absolute():
        experiment = find_project_root(path.parent) / experiment
    return cfg, experiment


def plan_from_stack(stack_file: Path, slices: int | None, devices_per_slice: int | None,
                    keep: Keep | None = None) -> LocalPlan:
    """The local run of the stack's trainer (raises UsageError with one line)."""
    from infra.boot.launch import trainer_argv
    from infra.stack_config import manifest
    from infra.stack_config.schema import Trainer

    cfg, experiment = load_stack(stack_file)
    mesh = cfg.resolved_mesh()
    topo = cfg.topology
    ici, dcn = group_values(mesh, "ici"), group_values(mesh, "dcn")  # an added axis too
    new_ici = _exact(ici, devices_per_slice, DEFAULT_MAX_DEVICES, "devices per slice",
                     "--devices-per-slice", topo.devices)
    new_dcn = _exact(dcn, slices, DEFAULT_MAX_SLICES, "slice count", "--slices", cfg.slices)
    trainer, said = laptop_trainer(cfg.trainer.model_dump(mode="json"), experiment,
                                   {**new_ici, **new_dcn}, math.prod(new_dcn.values()),
                                   keep or Keep())
    stack_steps = cfg.trainer.steps
    cfg = cfg.model_copy(update={"trainer": Trainer.model_validate(trainer)})
    argv = _drop(trainer_argv(manifest.launch_spec(cfg, "0" * 64)),
                 lambda flag, value: flag in LAUNCHER_FLAGS
                 or (flag == "--set" and value.startswith("mesh.")))
    for key, value in {**new_ici, **new_dcn}.items():  # the scaled mesh, whole
        argv += ["--set", f"mesh.{key}={value}"]
    slices_n, devices_n = math.prod(new_dcn.values()), math.prod(new_ici.values())
    changed = [f"{k} {(ici | dcn)[k]} -> {(new_ici | new_dcn)[k]}"
               for k in (*ici, *dcn) if (ici | dcn)[k] != (new_ici | new_dcn)[k]]
    scaled = (f"stack {cfg.stack} ({cfg.slices} x {cfg.accelerator_type}, {topo.devices} devices "
              f"a slice) as {slices_n} emulated slice(s) x {devices_n} CPU "
              f"devices: " + (f"mesh {', '.join(changed)}" if changed else "mesh unchanged")
              + "".join(f"; {phrase}" for phrase in said)
              + f"; trainer otherwise as on the VMs (--config {cfg.trainer.config}, --steps "
              f"{cfg.trainer.steps}"
              + (f" of the stack's {stack_steps}" if stack_steps != cfg.trainer.steps else "")
              + "; arguments after -- come last and win)")
    return LocalPlan(experiment, slices_n, devices_n, tuple(argv), scaled)
