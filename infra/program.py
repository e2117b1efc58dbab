"""The Pulumi program for one multislice experiment: validate the stack config, then wire components.

Pulumi runs ``__main__.py`` at the project root (next to Pulumi.yaml), which calls ``run``. The
program lives at the root, not in ``infra/``, because the CLI starts the program *and* the dynamic
provider in the program's directory and the provider resolves the ``virtualenv`` of Pulumi.yaml
against that directory, not the project root (pulumi/pulumi#7061): with ``main: infra/`` the
queued-resource provider would look for ``infra/.venv`` and never start.
"""

from __future__ import annotations

from pathlib import Path

import pulumi

from infra import PROJECT_ROOT
from infra.stack import create_stack
from infra.stack_config.pulumi_config import load_stack_config
from infra.stack_config.schema import StackConfigError


def run(root: Path = PROJECT_ROOT) -> None:
    try:
        config, warnings = load_stack_config(base_dir=root)
    except StackConfigError as exc:
        raise pulumi.RunError(str(exc)) from None  # a clean message, not a traceback
    for warning in warnings:
        pulumi.log.warn(warning)
    for key, value in create_stack(config, root).items():
        pulumi.export(key, value)
