"""Read the stack config from the Pulumi runtime (the only pulumi-aware part of config loading).

The engine hands a program its stack config as one JSON object (``PULUMI_CONFIG``), which the
language host's exec shim loads into ``pulumi.runtime.config``; under the mock runtime
``set_all_config`` fills the same place. Every key is read, so an unknown or misspelled one is an
error from ``infra.stack_config.schema.parse_namespaced``, the one loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import config as runtime_config

from infra.stack_config.schema import StackConfig
from infra.stack_config.stack_file import parse_namespaced
from infra.stack_config.validation import validate_stack


def read_pulumi_config() -> dict[str, Any]:
    """Every ``namespace:key`` the engine set for this stack, with its (string) value."""
    config = dict(runtime_config.get_config_env())
    config.update(runtime_config.CONFIG.get())
    return config


def load_stack_config(base_dir: Path | None = None) -> tuple[StackConfig, list[str]]:
    """Parse and validate before any resource is declared. Returns (config, warnings)."""
    stack = pulumi.get_stack()
    cfg = parse_namespaced(read_pulumi_config(), stack, source=f"stack {stack!r}")
    if base_dir is None:
        base_dir = Path(pulumi.get_root_directory() or ".")
    warnings = validate_stack(cfg, base_dir=base_dir)
    return cfg, warnings
