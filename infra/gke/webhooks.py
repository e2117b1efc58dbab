"""The ports on which the API server calls what a stack installs: from the kept manifests.

A private GKE cluster's control plane reaches its nodes on 443 and 10250 only (the firewall rule
GKE creates, `gke-CLUSTER-...-master`). Admission webhooks and aggregated APIs are served by pods
on other ports: the API server calls the Service's targetPort on the pod directly (GKE's
"Adding firewall rules for specific use cases" for private clusters). Without a rule for them,
JobSet's webhook refuses every JobSet and, with Kueue's Fail-policy webhooks, nothing else can
be created. So the ports are read from the manifests this toolkit applies (infra/k8s/), never
typed: every webhook configuration's and APIService's Service, its port (443 when unnamed),
and that port's targetPort, a number or the name of a container port of the pods the Service
selects.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

WEBHOOK_KINDS = ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")


class ManifestError(ValueError):
    """A kept manifest names a Service or port it does not define."""


def control_plane_ports(manifests: Iterable[str | Path]) -> tuple[int, ...]:
    """Every pod port the API server calls for the objects in `manifests`, sorted."""
    docs: list[dict[str, Any]] = []
    for manifest in manifests:
        docs += [d for d in yaml.safe_load_all(Path(manifest).read_text()) if d]
    services = {(d["metadata"].get("namespace"), d["metadata"]["name"]): d
                for d in docs if d["kind"] == "Service"}
    called: list[dict[str, Any]] = []
    for doc in docs:
        if doc["kind"] in WEBHOOK_KINDS:
            called += [w["clientConfig"]["service"] for w in doc.get("webhooks", [])
                       if "service" in w.get("clientConfig", {})]
        elif doc["kind"] == "APIService" and doc["spec"].get("service"):
            called.append(doc["spec"]["service"])
    ports = set()
    for ref in called:
        key = (ref["namespace"], ref["name"])
        if key not in services:
            raise ManifestError(f"a webhook calls Service {key[0]}/{key[1]}, which the "
                                "manifests do not define")
        ports.add(_target_port(services[key], ref.get("port", 443), docs))
    return tuple(sorted(ports))


def _target_port(service: dict[str, Any], port: int, docs: list[dict[str, Any]]) -> int:
    name = f"{service['metadata'].get('namespace')}/{service['metadata']['name']}"
    entry = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    if entry is None:
        raise ManifestError(f"Service {name} has no port {port}")
    target = entry.get("targetPort", port)
    if isinstance(target, int):
        return target
    selector = service["spec"].get("selector", {})
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        template = doc["spec"]["template"]
        labels = template.get("metadata", {}).get("labels", {})
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            continue
        for container in template["spec"]["containers"]:
            for p in container.get("ports", []):
                if p.get("name") == target:
                    return int(p["containerPort"])
    raise ManifestError(f"Service {name} targets port {target!r}, which no pod it selects names")
