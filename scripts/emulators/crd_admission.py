"""A create of a custom resource as the Kubernetes API server admits it, from the pinned CRDs.

Test support, never production. There is no API server on these machines; this follows what the
Kubernetes docs say the server does with a custom resource on create ("Extend the Kubernetes API
with CustomResourceDefinitions": structural schemas, pruning, defaulting, validation rules;
"Field validation": strict) against the CRD files pinned in tests/infra/crds:

1. strict field validation: a field the schema does not declare is refused (pulumi-kubernetes
   and kubectl would otherwise see it silently pruned, which is worse: a setting that vanishes);
2. structural defaulting: a schema `default` fills a field that is missing;
3. OpenAPI validation: types (with int-or-string, nullable, anyOf), required,
   enum, pattern, lengths, item counts, ranges, int32/int64 formats, list-type set/map keys;
   ObjectMeta's own rules for names and labels; the CEL rules of x-kubernetes-validations that
   apply on create (rules that read oldSelf apply to updates only), evaluated with cel-python;
4. the controller's mutating webhook (JobSet's: scripts/emulators/jobset_webhook.py), then
   defaulting and validation again, then its validating webhook. An object the schema refuses
   never reaches the webhooks (their typed decoding would refuse it too).

`admit(obj)` returns the object as it would be stored and every problem that refuses it.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import celpy
import yaml

from infra.gke.k8s_names import DNS1123_LABEL, DNS1123_SUBDOMAIN, LABEL_NAME
from scripts.emulators import jobset_webhook

CRD_DIR = Path(__file__).resolve().parents[2] / "tests" / "infra" / "crds"
KEPT_MANIFESTS = Path(__file__).resolve().parents[2] / "infra" / "k8s"

_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_ANNOTATIONS_MAX_BYTES = 256 * 1024


@functools.cache
def schemas() -> dict[tuple[str, str], tuple[dict[str, Any], str]]:
    """(apiVersion, kind) -> (the served version's openAPIV3Schema, scope) of every pinned CRD."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crds = [yaml.load(path.read_text(), Loader=loader) for path in sorted(CRD_DIR.glob("*.yaml"))]
    # Kinds no pinned file has (Kueue's WorkloadPriorityClass): the CRDs of the controllers'
    # release manifests kept in infra/k8s, the same releases.
    crds += [doc for path in sorted(KEPT_MANIFESTS.glob("*.yaml"))
             for doc in yaml.load_all(path.read_text(), Loader=loader)
             if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"]
    found: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
            if version.get("served") and key not in found:
                found[key] = (version["schema"]["openAPIV3Schema"], spec["scope"])
    return found


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The object a create of `obj` stores, and the problems for which the server refuses it."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in schemas():
        return obj, [f"no pinned CRD serves {key[0]} {key[1]} (have: {sorted(schemas())})"]
    schema, scope = schemas()[key]
    namespaced = scope == "Namespaced"
    stored = copy.deepcopy(obj)
    apply_defaults(stored, schema)
    problems = [f"{p}: unknown field" for p in unknown_fields(obj, schema, "", top=True)]
    problems += object_meta_problems(stored.get("metadata"), "metadata", namespaced)
    problems += schema_problems(stored, schema, "", top=True)
    webhook = {"JobSet": jobset_webhook}.get(key[1])
    if problems or webhook is None:
        return stored, problems  # a webhook never sees what its typed decoding would refuse
    webhook.default(stored)
    apply_defaults(stored, schema)
    problems = schema_problems(stored, schema, "", top=True) or webhook.validate_create(stored)
    return stored, problems


# ---- strict field validation and defaulting --------------------------------------------------


def _declared(schema: dict[str, Any], top: bool) -> set[str] | None:
    """The field names an object node declares, or None when it takes any (a map, or a node that
    preserves unknown fields)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
        return None
    declared = set(schema.get("properties", {}))
    if top or schema.get("x-kubernetes-embedded-resource"):
        declared |= {"apiVersion", "kind", "metadata"}
    return declared


def unknown_fields(value: Any, schema: dict[str, Any], path: str, top: bool = False) -> list[str]:
    """The paths of fields the schema does not declare (what strict field validation refuses)."""
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        declared = _declared(schema, top)
        for name, item in value.items():
            child = f"{path}.{name}" if path else name
            if declared is not None and name not in declared:
                found.append(child)
            elif (top or schema.get("x-kubernetes-embedded-resource")) and name == "metadata":
                continue  # ObjectMeta: validated by object_meta_problems
            elif name in schema.get("properties", {}):
                found += unknown_fields(item, schema["properties"][name], child)
            elif isinstance(schema.get("additionalProperties"), dict):
                found += unknown_fields(item, schema["additionalProperties"], child)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Fill every missing field that has a schema default, at every level, in place."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(value[name], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for name, item in value.items():
                if name not in schema.get("properties", {}):
                    apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(item, schema["items"])


# ---- validation -------------------------------------------------------------------------------


def _type_problem(value: Any, schema: dict[str, Any]) -> str | None:
    if value is None:
        return None if schema.get("nullable") else "null is not allowed"
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return None if ok else f"must be an integer or a string, got {value!r}"
    expected = schema.get("type")
    ok = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        None: lambda v: True,
    }[expected](value)
    return None if ok else f"must be of type {expected}, got {type(value).__name__} {value!r}"


def schema_problems(value: Any, schema: dict[str, Any], path: str, top: bool = False) -> list[str]:
    """Every way `value` breaks `schema` (OpenAPI v3 as the API server applies it)."""
    where = path or "<root>"
    problem = _type_problem(value, schema)
    if problem or value is None:
        return [f"{where}: {problem}"] if problem else []
    problems: list[str] = []
    if "anyOf" in schema and not any(
            not schema_problems(value, {**branch, "nullable": True}, path)
            for branch in schema["anyOf"]):
        problems.append(f"{where}: matches none of {schema['anyOf']}")
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            problems.append(f"{where}: {value!r} does not match {schema['pattern']!r}")
        if len(value) > schema.get("maxLength", len(value)):
            problems.append(f"{where}: longer than {schema['maxLength']} characters")
        if len(value) < schema.get("minLength", 0):
            problems.append(f"{where}: shorter than {schema['minLength']} characters")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = _INT_RANGES.get(schema.get("format", ""), (None, None))
        if low is not None and not low <= value <= high:
            problems.append(f"{where}: {value} is out of range for {schema['format']}")
        if "minimum" in schema and (value < schema["minimum"] or (
                schema.get("exclusiveMinimum") and value == schema["minimum"])):
            problems.append(f"{where}: {value} is less than the minimum {schema['minimum']}")
        if "maximum" in schema and (value > schema["maximum"] or (
                schema.get("exclusiveMaximum") and value == schema["maximum"])):
            problems.append(f"{where}: {value} is more than the maximum {schema['maximum']}")
    if isinstance(value, dict):
        problems += _object_problems(value, schema, path, top)
    if isinstance(value, list):
        problems += _array_problems(value, schema, path)
    problems += cel_problems(value, schema, where)
    return problems


def _object_problems(value: dict[str, Any], schema: dict[str, Any], path: str,
                     top: bool) -> list[str]:
    problems = [f"{path + '.' if path else ''}{name}: required"
                for name in schema.get("required", []) if name not in value]
    if len(value) > schema.get("maxProperties", len(value)):
        problems.append(f"{path}: more than {schema['maxProperties']} properties")
    embedded = top or schema.get("x-kubernetes-embedded-resource")
    for name, item in value.items():
        child = f"{path}.{name}" if path else name
        if embedded and name == "metadata":
            if not top:
                problems += object_meta_problems(item, child, namespaced=True, embedded=True)
            continue
        if name in schema.get("properties", {}):
            sub = schema["properties"][name]
            if name == "metadata" and isinstance(item, dict):
                problems += object_meta_problems(item, child, namespaced=True, embedded=True)
            problems += schema_problems(item, sub, child)
        elif isinstance(schema.get("additionalProperties"), dict):
            problems += schema_problems(item, schema["additionalProperties"], child)
    return problems


def _array_problems(value: list[Any], schema: dict[str, Any], path: str) -> list[str]:
    problems = []
    if len(value) > schema.get("maxItems", len(value)):
        problems.append(f"{path}: more than {schema['maxItems']} items")
    if len(value) < schema.get("minItems", 0):
        problems.append(f"{path}: fewer than {schema['minItems']} items")
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "set" and len({repr(v) for v in value}) != len(value):
        problems.append(f"{path}: duplicate items in a set")
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
        if len(set(seen)) != len(seen):
            problems.append(f"{path}: duplicate map keys {keys}")
    for i, item in enumerate(value):
        problems += schema_problems(item, schema.get("items", {}), f"{path}[{i}]")
    return problems


def object_meta_problems(meta: Any, path: str, namespaced: bool,
                         embedded: bool = False) -> list[str]:
    """ObjectMeta's rules that the CRD schema does not carry: a name (a DNS-1123 subdomain) on
    a stored object, a namespace that is a DNS-1123 label, and label keys and values."""
    if not isinstance(meta, dict):
        return [] if embedded and meta is None else [f"{path}: must be an object"]
    problems = []
    if not embedded:
        name = meta.get("name") or ""
        if not meta.get("generateName") and not DNS1123_SUBDOMAIN.match(name):
            problems.append(f"{path}.name: {name!r} is not a DNS-1123 subdomain")
        if namespaced and not DNS1123_LABEL.match(meta.get("namespace") or ""):
            problems.append(f"{path}.namespace: {meta.get('namespace')!r} is not a DNS-1123 label")
        if not namespaced and "namespace" in meta:
            problems.append(f"{path}.namespace: a cluster-scoped object takes no namespace")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))) \
                or len(name) > 63 or not LABEL_NAME.match(name):
            problems.append(f"{path}.labels: {key!r} is not a qualified label name")
        if not isinstance(value, str) or len(value) > 63 or (
                value and not LABEL_NAME.match(value)):
            problems.append(f"{path}.labels[{key!r}]: {value!r} is not a valid label value")
    annotations = meta.get("annotations") or {}
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > _ANNOTATIONS_MAX_BYTES:
        problems.append(f"{path}.annotations: more than 256 KiB in all")
    return problems


# ---- CEL validation rules ----------------------------------------------------------------------


@functools.cache
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_problems(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """The x-kubernetes-validations rules of this node that `value` breaks on create."""
    problems = []
    for validation in schema.get("x-kubernetes-validations", []):
        rule = validation["rule"]
        if re.search(r"\boldSelf\b", rule):
            continue  # a transition rule: evaluated on update only
        try:
            result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as error:  # noqa: BLE001 - a rule that errors refuses the object too
            result = error
        if not (isinstance(result, celpy.celtypes.BoolType) and result):
            message = validation.get("message") or f"failed rule: {rule}"
            problems.append(f"{where}: {message}")
    return problems
