"""The environment of the experiment's lock, published by the deployer and pinned in the launch
spec: what the hosts install, and the only environment they install that they did not build.

`EnvCheck` is a dynamic resource (infra/preview/check_only.py) with one output the launch spec is made
of, `sha256`: the digest of `envs/KEY.tar.gz` (the hosts' key: the lock's sha256, its CPython,
x86_64) as a deployer published it. Only deployers write `envs/` (the hosts' write grant is
conditioned on their run directory: infra/stack_config/manifest.py host_write_prefixes), so the `.sha256` a
deployer wrote beside the archive is what `pulumi up` pins; a host never reads that object, and
installs the archive only when its bytes match the spec (infra/boot/startup.sh fetch_env).

- `pulumi up` (create, update): the digest of the published archive; where there is none and
  this machine can build what a host would (infra/packaging/env_build.py: Linux x86_64 with the package
  index), it builds and publishes it first. Otherwise the digest is empty, and each host builds
  its own environment (when it reaches a package index) and installs nothing another host built.
- `pulumi preview` (check): a stack whose hosts cannot build (`egress: none` with no
  `package_index`) is refused when the bucket exists, holds no environment for the key, and this
  machine cannot build it, naming the command to run where it can (`multislice env-publish`).
- diff: a new key (a new lock), or a digest in the bucket other than the pinned one (`multislice
  env-publish --force` published again), is a change; an unchanged environment is none, so a
  preview shows the spec unchanged.
"""

from __future__ import annotations

import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult, CreateResult, DiffResult, UpdateResult

from infra.packaging.env_build import (
    FORMAT,
    Index,
    build_and_publish,
    env_key,
    legacy_record,
    machine_problem,
    published_sha256,
)
from infra.preview.check_only import CheckOnlyProvider

__all__ = ["EnvCheck", "EnvCheckProvider", "env_key"]
OUTPUTS = ("environment", "sha256")


def missing_line(props: dict[str, Any], client: Any, cannot_build: str | None) -> str | None:
    """The one-line refusal when the hosts cannot build, the bucket exists and holds no
    environment for the key, and this machine cannot build it (`cannot_build` says why; None:
    `pulumi up` builds it)."""
    from google.api_core import exceptions

    if props.get("hosts_build"):
        return None
    bucket = client.bucket(props["bucket"])
    try:
        if not bucket.exists():
            return None  # the first `pulumi up` creates it, then builds or the hosts wait
        if published_sha256(bucket, props["key"]) is not None:
            return None  # an archive and its record, the record describing it
    except (exceptions.Forbidden, exceptions.Unauthorized):
        return None  # the deployer may not read it: the hosts check again
    if cannot_build is None:
        return None  # `pulumi up` builds and publishes it (EnvCheckProvider.create)
    why = props.get("hosts_cannot_build") or ("egress: 'none'", "without internet")
    legacy = legacy_record(bucket, props["key"])
    return (f"{why[0]}, and gs://{props['bucket']}/envs/ has no environment "
            f"{props['key']} for the experiment's lock"
            + (" that a deployer of this toolkit published (its .sha256 record has no crc32c "
               "line: it predates this toolkit's records, when hosts could write envs/ too, so "
               "it is not pinned; publishing again replaces it)" if legacy else "")
            + f", which the hosts cannot build {why[1]}, "
            f"nor this machine ({cannot_build}): run `multislice env-publish "
            f"--stack-config {props['stack_file']}` on a Linux x86_64 machine that reaches the "
            "package index, then pulumi up again")


def stack_index(url: str | None, python_mirror: str | None) -> Index:
    """The stack's package index as the deployer's build reaches it: for Artifact Registry
    (*.pkg.dev) with the deployer's own access token, as the hosts send theirs (its pip docs)."""
    token = None
    if url and (urllib.parse.urlsplit(url).hostname or "").endswith(".pkg.dev"):
        from infra.cloud.credentials import deployer_credentials

        token = deployer_credentials().token
    return Index(url or None, python_mirror or None, token)


def ensure_published(props: dict[str, Any], client: Any) -> tuple[str, str]:
    """(what `pulumi up` did about the environment in one line, the archive's digest the spec
    pins or "")."""
    bucket = client.bucket(props["bucket"])
    uri = f"gs://{props['bucket']}/envs/{props['key']}.{FORMAT}"
    digest = published_sha256(bucket, props["key"])
    if digest is not None:
        return f"{uri}: published, sha256 {digest} (pinned in the launch spec)", digest
    problem = machine_problem()
    if problem is not None:
        fallback = ("each host builds its own" if props.get("hosts_build")
                    else "the hosts wait for it")
        return (f"not in gs://{props['bucket']}/envs/, and this machine cannot build it "
                f"({problem}): {fallback}; `multislice env-publish --stack-config "
                f"{props['stack_file']}` on one that can, then pulumi up, pins one"), ""
    interpreter = props["key"].split("-cpython", 1)[1].rsplit("-", 1)[0]
    done = build_and_publish(bucket, Path(props["lock"]), props["key"], interpreter,
                             Path(tempfile.gettempdir()) / f"env-publish-{props['key'][:12]}.log",
                             stack_index(props.get("package_index"),
                                         props.get("python_mirror")))
    return (f"built by this pulumi up in {done.build_s:.0f}s and published to {done.uri} "
            f"({done.size_mib:.0f} MiB in {done.upload_s:.0f}s), sha256 {done.sha256} (pinned "
            "in the launch spec)"), done.sha256


class EnvCheckProvider(CheckOnlyProvider):
    """check: refuses what neither the bucket has nor this machine can build, for hosts that
    cannot build. create and update (`pulumi up` only): the published digest, building and
    publishing it first where it is missing and this machine can."""

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        from infra.preview.run_check import storage_client

        try:
            problem = missing_line(news, storage_client(news["project"]), machine_problem())
        except Exception:  # noqa: BLE001 - no credentials, no network: the hosts check too
            problem = None
        return CheckResult(news, [CheckFailure("key", problem)] if problem else [])

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        inputs = [k for k in news if k not in OUTPUTS]
        changed = any(olds.get(k) != news[k] for k in inputs)
        if not changed and olds.get("sha256") is not None:
            try:
                from infra.preview.run_check import storage_client

                bucket = storage_client(news["project"]).bucket(news["bucket"])
                changed = (published_sha256(bucket, news["key"]) or "") != olds["sha256"]
            except Exception:  # noqa: BLE001 - no credentials, no network: keep the pin
                changed = False
        return DiffResult(changes=changed, replaces=[], delete_before_replace=False)

    def _outs(self, props: dict[str, Any]) -> dict[str, Any]:
        from infra.preview.run_check import storage_client

        outs = {k: v for k, v in props.items() if k not in OUTPUTS}
        try:
            outs["environment"], outs["sha256"] = ensure_published(
                props, storage_client(props["project"]))
        except RuntimeError as exc:  # the build failed: the hosts build or wait; say why
            outs["environment"], outs["sha256"] = (
                f"the build here failed ({exc}); nothing is pinned in the launch spec", "")
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
    sha256: pulumi.Output[str]
    """The digest of the deployer's environment archive the launch spec pins ("" for none)."""

    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(EnvCheckProvider(), name, {**props, **dict.fromkeys(OUTPUTS)}, opts)
