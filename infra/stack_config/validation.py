"""All of a stack's checks, in order, before any resource is declared or any cloud call is made.

`infra.stack_config.schema` types the stack config; `infra.stack_config.checks` holds the rules both orchestrations share,
`infra.tpu_vm.checks` and `infra.gke.checks` each orchestration's own; `infra.packaging.experiment` checks
the experiment it trains (layout, preset, overrides and mesh by the experiment's own config
code, its Pythons, its lock). This module runs them and raises one StackConfigError listing
every problem, so none of them imports another.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from infra.gke.checks import gke_problems
from infra.packaging.experiment import experiment_problems
from infra.stack_config.checks import shared_problems
from infra.stack_config.schema import StackConfig, StackConfigError
from infra.stack_config.stack_file import (
    find_project_root,
    parse_namespaced,
    project_name,
    read_stack_file,
    stack_name_from_path,
)
from infra.tpu_vm.checks import tpu_vm_problems


def stack_problems(cfg: StackConfig, now: datetime | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of every rule that needs more than one key of the stack config: the
    shared ones, then the orchestration's. The experiment's are validate_stack's."""
    problems, warnings, topo = shared_problems(cfg)
    capacity_stack = cfg.gke is not None and cfg.gke.kind == "capacity"
    if not cfg.experiment_dir and not capacity_stack:
        problems.append("experiment_dir: required but not set; the directory `multislice new` "
                        "made, relative to the project root")
    if cfg.orchestration == "gke":
        problems += gke_problems(cfg, topo)
    else:
        found, cautions = tpu_vm_problems(cfg, topo, now=now)
        problems += found
        warnings += cautions
    return problems, warnings


def validate_stack(
    cfg: StackConfig,
    base_dir: Path | None = None,
    check_files: bool = True,
    now: datetime | None = None,
) -> list[str]:
    """Check every rule that needs more than one field. Raises StackConfigError; returns warnings.

    ``base_dir`` resolves a relative ``experiment_dir`` (the directory holding Pulumi.yaml).
    With ``check_files`` the experiment directory is checked too: its layout, the trainer preset,
    the overrides and seed (by the experiment's own config code) and its supported Pythons. Those
    run only when everything else passed, since they need a valid mesh and topology.
    """
    problems, warnings = stack_problems(cfg, now=now)
    if check_files and not problems and cfg.experiment_dir:
        exp = Path(cfg.experiment_dir)
        if not exp.is_absolute() and base_dir is not None:
            exp = base_dir / exp
        found, cautions = experiment_problems(cfg, exp)
        problems += found
        warnings += cautions
    if problems:
        raise StackConfigError(problems, source=f"stack {cfg.stack!r}")
    return warnings


def load_stack_file(
    path: str | Path,
    base_dir: Path | None = None,
    check_files: bool = True,
    validate: bool = True,
) -> StackConfig:
    """Read ``Pulumi.<stack>.yaml`` (its ``config:`` mapping) the way the Pulumi program would.

    ``base_dir`` (which a relative ``experiment_dir`` is resolved against) defaults to the
    nearest directory at or above the file that holds ``Pulumi.yaml``, as in the Pulumi program.
    """
    path = Path(path)
    if base_dir is None:
        base_dir = find_project_root(path.parent)
    stack = stack_name_from_path(path)
    cfg = parse_namespaced(read_stack_file(path, project_name(base_dir)), stack, source=str(path))
    if validate:
        validate_stack(cfg, base_dir=base_dir, check_files=check_files)
    return cfg

