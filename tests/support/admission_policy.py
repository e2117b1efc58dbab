"""Kubernetes' ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, "Validating Admission
Policy") applied to one request, as the API server does: a policy applies to a request its
matchConstraints' resource rules match (API group, resource, operation), in a namespace its
binding's namespaceSelector selects, when every matchCondition is true; its variables are
evaluated in order (each may use the earlier ones as `variables.NAME`); a validation that is
false denies the request with its message. CEL is evaluated by cel-python (celpy), the same
evaluator tests use for CRDs' x-kubernetes-validations. A test oracle for the guards a
capacity stack applies."""

from __future__ import annotations

from typing import Any

import celpy


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have = labels.get(e["key"])
        if (e["operator"] == "In" and have not in e["values"]) or \
                (e["operator"] == "NotIn" and have in e["values"]):
            return False
    return True


def review(policy: dict[str, Any], binding: dict[str, Any], *, operation: str, group: str,
           resource: str, namespace: str, user: str, obj: dict[str, Any],
           old: dict[str, Any] | None = None) -> str | None:
    """None when the request is admitted, else the denial's message."""
    spec = policy["spec"]
    if not any((group in rule["apiGroups"] or "*" in rule["apiGroups"])
               and resource in rule["resources"] and operation in rule["operations"]
               for rule in spec["matchConstraints"]["resourceRules"]):
        return None
    selector = binding["spec"].get("matchResources", {}).get("namespaceSelector") or {}
    if not _selects(selector, {"kubernetes.io/metadata.name": namespace}):
        return None
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel({"operation": operation, "namespace": namespace,
                                      "userInfo": {"username": user}})}
    if not all(bool(_cel(c["expression"], activation)) for c in spec.get("matchConditions", [])):
        return None
    variables = celpy.celtypes.MapType({})
    for variable in spec.get("variables", []):
        variables[celpy.celtypes.StringType(variable["name"])] = _cel(
            variable["expression"], {**activation, "variables": variables})
    activation["variables"] = variables
    for validation in spec["validations"]:
        if not bool(_cel(validation["expression"], activation)):
            return validation["message"]
    return None
