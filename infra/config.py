"""Read the stack config from ``pulumi.Config`` (the only pulumi-aware part of config loading)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi

from infra.schema import (
    CONFIG_NAMESPACE,
    StackConfig,
    namespaced_to_raw,
    parse_stack,
    validate_stack,
)


def read_pulumi_config() -> dict[str, Any]:
    """The stack's config as a namespaced mapping, like the ``config:`` block of the YAML file."""
    ns = pulumi.Config(CONFIG_NAMESPACE)
    gcp = pulumi.Config("gcp")
    config: dict[str, Any] = {}
    for field in StackConfig.model_fields:
        value = ns.get(field)
        if value is not None and field != "stack":
            config[f"{CONFIG_NAMESPACE}:{field}"] = value
    for key in ("project", "region", "zone"):
        value = gcp.get(key)
        if value is not None:
            config[f"gcp:{key}"] = value
    return config


def load_stack_config(base_dir: Path | None = None) -> tuple[StackConfig, list[str]]:
    """Parse and validate before any resource is declared. Returns (config, warnings)."""
    stack = pulumi.get_stack()
    cfg = parse_stack(namespaced_to_raw(read_pulumi_config()), stack, source=f"stack {stack!r}")
    if base_dir is None:
        base_dir = Path(pulumi.get_root_directory() or ".")
    warnings = validate_stack(cfg, base_dir=base_dir)
    return cfg, warnings
