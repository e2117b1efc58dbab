"""The cluster-wide controllers a stack may install: JobSet's always, Kueue's for queues.

Their release manifests are kept in the repo (infra/k8s/README.md: each built from its tag by
the release's own recipe), so a PR shows every object `pulumi up` applies and nothing is fetched
from the network then. The paths are relative to the project root (Pulumi.yaml sets no `main`),
the working directory Pulumi's engine starts providers in (pulumi/pulumi pkg/engine/project.go
getPwdMain), so the inputs read the same on every machine.

Their CRDs hold every JobSet (and Kueue workload) of the cluster, not only this stack's, so
every object of them is retained on `pulumi destroy`: one team's teardown never deletes another
team's jobs (a created cluster takes them with it). The retention is set on each object
explicitly, by a transform the engine runs on every child of the manifest's component
(`retain_on_delete_everywhere`), not left to the engine's inheritance from the parent, which an
open upstream issue calls a bug. They are applied through the `shared` provider
(infra/gke/kube.py), which updates what exists already instead of failing AlreadyExists: the
manifests of a retained install, or another stack's.
"""

from __future__ import annotations

from pathlib import Path

import pulumi
import pulumi_kubernetes as k8s

JOBSET_VERSION = "v0.12.0"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
JOBSET_MANIFEST = f"infra/k8s/jobset-{JOBSET_VERSION}.yaml"
KUEUE_VERSION = "v0.19.2"  # serves kueue.x-k8s.io/v1beta2
KUEUE_MANIFEST = f"infra/k8s/kueue-{KUEUE_VERSION}.yaml"


def manifests(install_jobset: bool, install_kueue: bool) -> dict[str, str]:
    """The kept release manifests a stack applies to its cluster, by controller."""
    return {**({"jobset": JOBSET_MANIFEST} if install_jobset else {}),
            **({"kueue": KUEUE_MANIFEST} if install_kueue else {})}


def retain_on_delete_everywhere(
        args: pulumi.ResourceTransformArgs) -> pulumi.ResourceTransformResult:
    """A transform: the resource is retained on delete, whatever its parent says."""
    return pulumi.ResourceTransformResult(
        props=args.props,
        opts=pulumi.ResourceOptions.merge(args.opts,
                                          pulumi.ResourceOptions(retain_on_delete=True)))


def install(name: str, chosen: dict[str, str], provider: k8s.Provider,
            parent: pulumi.Resource) -> list[pulumi.Resource]:
    """One ConfigFile per controller, every object of it retained (module docstring)."""
    return [
        k8s.yaml.v2.ConfigFile(
            f"{name}-{controller}-controller", file=manifest,
            opts=pulumi.ResourceOptions(parent=parent, provider=provider, retain_on_delete=True,
                                        transforms=[retain_on_delete_everywhere]))
        for controller, manifest in chosen.items()]
