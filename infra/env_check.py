"""A stack whose hosts have no public internet (`multislice:egress: none`) needs the environment
of its experiment's lock in its bucket before they boot: preview refuses it otherwise.

`EnvCheck` is a dynamic resource whose provider's `check` runs on every `pulumi preview` and `up`
(infra/preview_check.py): it asks the bucket for `envs/KEY.tar.zst.sha256` or
`envs/KEY.tar.gz.sha256` (the hosts' key: the lock's sha256, its CPython, x86_64; the `.sha256`
object is written last, so it says the archive is whole). Where it is missing, a deployer's
machine that can build it (infra/env_build.py: Linux x86_64, with the package index) makes
`pulumi up` build and publish it before the launch spec is written, and the stack's
`environment` output says so; any other machine is refused at preview, naming the command to run
where it can (`multislice env-publish`). A bucket that does not exist yet is a first `pulumi up`:
it passes, and the hosts wait for the environment with one line naming that command.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult, CreateResult, UpdateResult

from infra.env_build import FORMATS, build_and_publish, env_key, machine_problem, published
from infra.preview_check import CheckOnlyProvider

__all__ = ["EnvCheck", "EnvCheckProvider", "env_key"]


def missing_line(props: dict[str, Any], client: Any, cannot_build: str | None) -> str | None:
    """The one-line refusal when the bucket exists, holds no environment for the key, and this
    machine cannot build it (`cannot_build` says why; None: `pulumi up` builds it)."""
    from google.api_core import exceptions

    bucket = client.bucket(props["bucket"])
    try:
        if not bucket.exists():
            return None  # the first `pulumi up` creates it, then builds or the hosts wait
        if any(bucket.blob(f"envs/{props['key']}.{ext}.sha256").exists() for ext in FORMATS):
            return None
    except (exceptions.Forbidden, exceptions.Unauthorized):
        return None  # the deployer may not read it: the hosts check again
    if cannot_build is None:
        return None  # `pulumi up` builds and publishes it (EnvCheckProvider.create)
    return (f"egress: 'none', and gs://{props['bucket']}/envs/ has no environment "
            f"{props['key']} for the experiment's lock, which the hosts cannot build without "
            f"internet, nor this machine ({cannot_build}): run `multislice env-publish "
            f"--stack-config {props['stack_file']}` on a Linux x86_64 machine that reaches the "
            "package index, then pulumi up again")


def ensure_published(props: dict[str, Any], client: Any) -> str:
    """What `pulumi up` did about the environment, in one line: found it, built and published it
    here, or could not (the hosts then wait for `multislice env-publish`)."""
    bucket = client.bucket(props["bucket"])
    found = published(bucket, props["key"])
    if found is not None:
        return f"gs://{props['bucket']}/{found}: in the bucket already"
    problem = machine_problem()
    if problem is not None:
        return (f"not in gs://{props['bucket']}/envs/, and this machine cannot build it "
                f"({problem}): run `multislice env-publish --stack-config {props['stack_file']}` "
                "on one that can; the hosts wait for it")
    interpreter = props["key"].split("-cpython", 1)[1].rsplit("-", 1)[0]
    done = build_and_publish(bucket, Path(props["lock"]), props["key"], interpreter,
                             Path(tempfile.gettempdir()) / f"env-publish-{props['key'][:12]}.log")
    return (f"built by this pulumi up in {done.build_s:.0f}s and published to {done.uri} "
            f"({done.size_mib:.0f} MiB in {done.upload_s:.0f}s)")


class EnvCheckProvider(CheckOnlyProvider):
    """check: refuses what neither the bucket has nor this machine can build. create and update
    (`pulumi up` only): build and publish it when it is missing and this machine can."""

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        from infra.run_check import storage_client

        try:
            problem = missing_line(news, storage_client(news["project"]), machine_problem())
        except Exception:  # noqa: BLE001 - no credentials, no network: the hosts check too
            problem = None
        return CheckResult(news, [CheckFailure("key", problem)] if problem else [])

    def _outs(self, props: dict[str, Any]) -> dict[str, Any]:
        from infra.run_check import storage_client

        outs = {k: v for k, v in props.items() if k != "environment"}
        try:
            outs["environment"] = ensure_published(props, storage_client(props["project"]))
        except RuntimeError as exc:  # the build failed: the hosts wait; say why
            outs["environment"] = f"the build here failed ({exc}); the hosts wait for it"
        return outs

    def create(self, props: dict[str, Any]) -> CreateResult:
        return CreateResult(id_=self.resource_id(props), outs=self._outs(props))

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        return UpdateResult(outs=self._outs(news))

    def resource_id(self, props: dict[str, Any]) -> str:
        return f"{props['bucket']}/envs/{props['key']}"


class EnvCheck(pulumi.dynamic.Resource):
    environment: pulumi.Output[str]
    """What `pulumi up` did about the environment (a stack output)."""

    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(EnvCheckProvider(), name, {**props, "environment": None}, opts)
