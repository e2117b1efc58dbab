"""Reading a stack file as the Pulumi engine hands it to the program: ``Pulumi.<stack>.yaml``'s
``config:`` as ``namespace:key`` strings, then one StackConfig (infra/stack_config/schema.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.stack_config.schema import (
    CONFIG_NAMESPACE,
    OTHER_NAMESPACES,
    SECRET_MARKER,
    StackConfig,
    StackConfigError,
    parse_stack,
    suggest,
)


def _decode(value: Any) -> Any:
    """Pulumi config carries structured values as JSON strings."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def parse_namespaced(
    config: Mapping[str, Any], stack: str, source: str = "stack config"
) -> StackConfig:
    """The one loader: a stack's config as the engine hands it to the program -> StackConfig.

    ``config`` maps ``namespace:key`` to values (strings, structured values as JSON), as in
    ``PULUMI_CONFIG``. Every key must be known: an unknown ``multislice:`` key, a namespace other
    than multislice/gcp/pulumi (``multislcie:slices``) or a key without one is an error naming
    it, never silently ignored. ``gcp:project``/``region``/``zone`` fill in ours when unset.
    """
    problems: list[str] = []
    raw: dict[str, Any] = {}
    fields = [f for f in StackConfig.model_fields if f != "stack"]
    namespaces = (CONFIG_NAMESPACE, *OTHER_NAMESPACES)
    for key, value in config.items():
        namespace, colon, name = str(key).partition(":")
        if not colon:
            problems.append(
                f"{key}: config key without a namespace; write {CONFIG_NAMESPACE}:{key}"
            )
        elif namespace == CONFIG_NAMESPACE:
            if name in fields:
                raw[name] = _decode(value)
            else:
                problems.append(
                    f"{key}: unknown key{suggest(name, fields)}; allowed keys of "
                    f"{CONFIG_NAMESPACE}: {', '.join(sorted(fields))}"
                )
        elif namespace not in OTHER_NAMESPACES:
            problems.append(
                f"{key}: unknown namespace {namespace!r}{suggest(namespace, list(namespaces))}; "
                f"allowed namespaces: {', '.join(namespaces)}"
            )
    for key in ("project", "region", "zone"):
        if key not in raw and f"gcp:{key}" in config:
            raw[key] = config[f"gcp:{key}"]
    try:
        cfg = parse_stack(raw, stack, source=source)
    except StackConfigError as exc:
        raise StackConfigError(problems + exc.problems, source=source) from None
    if problems:
        raise StackConfigError(problems, source=source)
    return cfg


_YAML12_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


class _UniqueKeyLoader:
    """yaml.SafeLoader that refuses duplicate mapping keys, as the Pulumi CLI's YAML reader does."""

    @staticmethod
    def build() -> Any:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        def mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (the Pulumi CLI refuses this file)",
                        key_node.start_mark)
                seen[key] = loader.construct_object(value_node, deep=deep)
            return seen

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        # The Pulumi CLI reads YAML 1.2, where `1e-3` is a float; YAML 1.1 (PyYAML) needs a dot
        # and makes it the string "1e-3", which a float setting then refuses.
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_EXPONENT_FLOAT,
                                     list("-+0123456789."))
        return Loader


def _engine_value(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"secure"}:
        return SECRET_MARKER  # encrypted: only the engine (with the stack's key) can read it
    if isinstance(value, str):
        return value
    return json.dumps(value)


def read_stack_file(path: Path, project: str = CONFIG_NAMESPACE) -> dict[str, str]:
    """A stack file's ``config:`` as the engine hands it to the program (``PULUMI_CONFIG``).

    As the Pulumi CLI does: duplicate keys are refused, a key without a namespace belongs to the
    project (``slices`` is ``multislice:slices``; both at once is a duplicate), and values become
    strings (structured ones JSON). Encrypted values read as ``[secret]``.
    """
    import yaml

    from infra.stack_config.userfile import UserFileError, load_yaml, read_text

    try:
        doc = load_yaml(read_text(path, "stack file"), str(path),
                        _UniqueKeyLoader.build()) or {}
    except UserFileError as exc:
        raise StackConfigError([str(exc).removeprefix(f"{path}: ")], source=str(path)) from None
    except yaml.YAMLError as exc:
        raise StackConfigError([f"cannot read: {exc}"], source=str(path)) from None
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise StackConfigError(["has no 'config:' mapping"], source=str(path))
    out: dict[str, str] = {}
    problems = []
    for key, value in config.items():
        key = str(key)
        parts = key.split(":")
        if len(parts) == 1:
            full = f"{project}:{key}"
        elif len(parts) == 3 and parts[1] == "config":  # the old `ns:config:name` form
            full = f"{parts[0]}:{parts[2]}"
        else:
            full = key
        if full in out:
            problems.append(f"{key}: the same key as {full} given twice; keep one")
        out[full] = _engine_value(value)
    if problems:
        raise StackConfigError(problems, source=str(path))
    return out


def stack_name_from_path(path: Path) -> str:
    name = path.name
    if not (name.startswith("Pulumi.") and name.endswith(".yaml")) or name == "Pulumi.yaml":
        raise StackConfigError(
            [f"file name {name!r} is not of the form Pulumi.<stack>.yaml"], source=str(path)
        )
    return name[len("Pulumi.") : -len(".yaml")]


def find_project_root(start: Path) -> Path:
    """The nearest directory at or above ``start`` holding Pulumi.yaml (else ``start``)."""
    start = start.resolve()
    for candidate in (start, *start.parents):
        if (candidate / "Pulumi.yaml").is_file():
            return candidate
    return start


def project_name(root: Path) -> str:
    """The ``name:`` of root/Pulumi.yaml: the namespace of un-namespaced stack keys."""
    import yaml

    from infra.stack_config.userfile import UserFileError, load_yaml, read_text

    try:
        doc = load_yaml(read_text(root / "Pulumi.yaml", "project file"),
                        str(root / "Pulumi.yaml")) or {}
    except (UserFileError, yaml.YAMLError):
        return CONFIG_NAMESPACE
    return str(doc.get("name") or CONFIG_NAMESPACE) if isinstance(doc, dict) else CONFIG_NAMESPACE
