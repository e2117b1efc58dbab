"""A dynamic resource that only checks: its provider's `check` runs on every `pulumi preview` and
`up`, before the engine steps any resource that waits for it, and refuses a stack the cloud
would fail later (infra/preview/run_check.py, infra/gke/cluster_check.py). It holds nothing: create and
update record the inputs, and no input replaces it."""

from __future__ import annotations

from typing import Any

from pulumi.dynamic import CreateResult, DiffResult, ResourceProvider, UpdateResult


class CheckOnlyProvider(ResourceProvider):
    """Subclasses implement `check` (pulumi.dynamic's) and name the resource's id."""

    serialize_as_secret_always = False

    def resource_id(self, props: dict[str, Any]) -> str:
        raise NotImplementedError

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        return DiffResult(changes=olds != news, replaces=[], delete_before_replace=False)

    def create(self, props: dict[str, Any]) -> CreateResult:
        return CreateResult(id_=self.resource_id(props), outs=props)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        return UpdateResult(outs=news)
