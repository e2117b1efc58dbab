"""Pulumi program for one multislice experiment: validate the stack config, then wire components.

Config keys are ``multislice:<field>`` of infra/schema.py's StackConfig (see stacks/ for examples).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `pulumi` runs this directory as a script
    sys.path.insert(0, str(ROOT))

import pulumi  # noqa: E402

from infra.config import load_stack_config  # noqa: E402
from infra.schema import StackConfigError  # noqa: E402
from infra.stack import create_stack  # noqa: E402

try:
    config, warnings = load_stack_config(base_dir=ROOT)
except StackConfigError as exc:
    raise pulumi.RunError(str(exc)) from None  # a clean message, not a traceback
for warning in warnings:
    pulumi.log.warn(warning)
for key, value in create_stack(config, ROOT).items():
    pulumi.export(key, value)
