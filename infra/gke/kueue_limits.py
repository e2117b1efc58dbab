"""Kueue as this toolkit applies it: only the JobSet integration and Kueue's own objects.

Kueue's release manifest enables a dozen integrations (batch Jobs, plain pods, Deployments,
StatefulSets, Ray, Kubeflow...) and registers a webhook for each, with failurePolicy Fail, over
every namespace but kube-system and kueue-system. On a cluster the stack installs Kueue into,
that puts Kueue in the path of every pod and Deployment other teams create: while its controller
is down (an upgrade, a node drain) none of them can be created. The toolkit queues one JobSet, so
the kept manifest keeps the JobSet integration and the webhooks of Kueue's own kinds
(ClusterQueue, ResourceFlavor, Workload, Cohort) and drops the rest.

`python -m infra.gke.kueue_limits FILE` rewrites a release build in place (infra/k8s/README.md
says how the kept file was built); tests/infra/test_gke.py checks the kept file is limited.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

KEPT_FRAMEWORKS = ("jobset.x-k8s.io/jobset",)
KEPT_WEBHOOKS = frozenset({
    "mjobset.kb.io", "vjobset.kb.io",  # the integration the toolkit uses
    "mclusterqueue.kb.io", "vclusterqueue.kb.io", "mresourceflavor.kb.io",
    "vresourceflavor.kb.io", "mworkload.kb.io", "vworkload.kb.io", "vcohort.kb.io",
})
CONFIG_MAP, CONFIG_KEY = "kueue-manager-config", "controller_manager_config.yaml"
WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def limit(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's objects with the integrations and webhooks limited (a new list)."""
    out = []
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == CONFIG_MAP:
            config = yaml.safe_load(doc["data"][CONFIG_KEY])
            config["integrations"]["frameworks"] = list(KEPT_FRAMEWORKS)
            doc = {**doc, "data": {**doc["data"], CONFIG_KEY: yaml.safe_dump(
                config, sort_keys=False)}}
        elif doc.get("kind") in WEBHOOK_KINDS:
            doc = {**doc, "webhooks": [w for w in doc["webhooks"] if w["name"] in KEPT_WEBHOOKS]}
        out.append(doc)
    return out


def frameworks(docs: list[dict[str, Any]]) -> list[str]:
    """The integrations the manifest's Kueue configuration enables."""
    (config_map,) = [d for d in docs if d.get("kind") == "ConfigMap"
                     and d["metadata"]["name"] == CONFIG_MAP]
    return list(yaml.safe_load(config_map["data"][CONFIG_KEY])["integrations"]["frameworks"])


def webhook_names(docs: list[dict[str, Any]]) -> set[str]:
    return {w["name"] for d in docs if d.get("kind") in WEBHOOK_KINDS for w in d["webhooks"]}


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m infra.gke.kueue_limits KUEUE_MANIFEST.yaml", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(dump(limit(load(path))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
