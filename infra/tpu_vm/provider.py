"""Pulumi dynamic provider for a (multislice) TPU queued resource, on the official TPU v2 client.

pulumi-gcp's ``V2QueuedResource`` has no node count, spot/guaranteed, metadata or tags, so this
provider calls ``google.cloud.tpu_v2.TpuClient`` itself (built by ``infra.tpu_vm.api``). Its inputs
are the flat spec of ``infra.tpu_vm.request``; the request is built by that module's pure function.

Semantics: ``check`` validates; ``diff`` replaces on any change to the cloud resource (the API has
no update for queued resources; the VMs' metadata is fixed for a stack, so code and trainer changes,
which update the launch spec object in the bucket, never reach it) and deletes before re-creating (same id), waiting until GET
answers 404 (a deleted queued resource lingers in DELETING); ``create`` waits for
ACTIVE with backoff and cleans up on FAILED / timeout; ``read`` refreshes; ``delete`` force-deletes
and treats 404 as done. Transient errors (429/503/timeouts) are retried with backoff.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pulumi.dynamic import (
    CheckFailure,
    CheckResult,
    CreateResult,
    DiffResult,
    ReadResult,
    ResourceProvider,
    UpdateResult,
)

from infra.stack_config.names import node_ids
from infra.tpu_vm import api as tpu_api
from infra.tpu_vm.request import (
    ADDED_LATER,
    IMMUTABLE_FIELDS,
    PROVIDER_ONLY_FIELDS,
    build_queued_resource_request,
    spec_problems,
)

DEFAULT_WAIT_S = 3600.0
DEFAULT_POLL_S = 10.0
MAX_POLL_S = 60.0
DEFAULT_DELETE_TIMEOUT_S = 900.0
# How long a create refused with 403 is retried: on the first `pulumi up` the deployer's actAs on
# the VMs' new service account, and the TPU API enabled seconds ago (403 SERVICE_DISABLED), take
# minutes to propagate.
DEFAULT_PERMISSION_RETRY_S = 600.0
MAX_PERMISSION_DELAY_S = 30.0


class QueuedResourceError(RuntimeError):
    """The queued resource could not be brought to ACTIVE (and was cleaned up)."""


def _progress(message: str) -> None:
    try:
        import pulumi

        pulumi.log.info(message)
    except Exception:
        pass  # outside an engine (tests, plain scripts) there is nowhere to log to


def _to_request(spec: dict[str, Any]) -> Any:
    from google.cloud import tpu_v2
    from google.protobuf import json_format

    pb = tpu_v2.CreateQueuedResourceRequest.pb()()
    json_format.ParseDict(build_queued_resource_request(spec), pb)
    return tpu_v2.CreateQueuedResourceRequest.wrap(pb)


def _metadata_problems(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The VMs need the launch spec's location; the spec itself is a bucket object (infra/cloud/storage.py)
    that the program validated, so a change of it never reaches this resource."""
    uri = (spec.get("metadata") or {}).get("launch-spec-uri")
    if not (isinstance(uri, str) and uri.startswith("gs://") and "/" in uri[5:]):
        return [("metadata", f"metadata.launch-spec-uri {uri!r} is not a gs://BUCKET/OBJECT URI; "
                 "the VMs read their launch spec from it (infra/stack_config/manifest.py:vm_metadata)")]
    if "launch-spec" in spec["metadata"]:
        return [("metadata", "metadata.launch-spec is the old, inline launch spec: it made every "
                 "change of code or trainer settings replace the queued resource; it lives in "
                 "the bucket now (launch-spec-uri)")]
    return []


def spec_mismatch(props: dict[str, Any], qr: Any) -> str:
    """How an existing queued resource differs from the one ``props`` asks for ("" if it does
    not). Compares what identifies the request: shape, software, node names, the stack label and
    where its VMs read the launch spec (the spec itself is a bucket object that may change)."""
    request = build_queued_resource_request(props)["queued_resource"]
    want = request["tpu"]["node_spec"][0]
    have = qr.tpu.node_spec[0] if qr.tpu.node_spec else None
    if have is None:
        return "it has no node spec"
    multi = want.get("multislice_params") or {}
    checks = [
        ("accelerator_type", want["node"]["accelerator_type"], have.node.accelerator_type),
        ("runtime_version", want["node"]["runtime_version"], have.node.runtime_version),
        ("node count", multi.get("node_count", 0), have.multislice_params.node_count),
        ("node id prefix", multi.get("node_id_prefix", ""), have.multislice_params.node_id_prefix),
        ("node id", want.get("node_id", ""), have.node_id),
        ("label multislice-stack", want["node"]["labels"].get("multislice-stack"),
         have.node.labels.get("multislice-stack")),
        ("metadata launch-spec-uri", want["node"]["metadata"].get("launch-spec-uri"),
         have.node.metadata.get("launch-spec-uri")),
    ]
    for what, wanted, found in checks:
        if wanted != found:
            return f"{what} is {_shown(found)}, this stack asks for {_shown(wanted)}"
    return ""


def _api_message(exc: Any) -> str:
    """The first line of the API's own error message (the REST transport prefixes the URL)."""
    text = exc.message or ""
    with contextlib.suppress(Exception):  # no JSON body (gRPC, a proxy's HTML page)
        text = exc.response.json()["error"]["message"]
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def _permission_reason(exc: Any, props: dict[str, Any]) -> str:
    """What a 403 on create most likely means, and what fixes it."""
    if getattr(exc, "reason", None) == "SERVICE_DISABLED" or "SERVICE_DISABLED" in str(exc):
        return ("the TPU API is not usable in this project yet (enabled minutes ago, or "
                "disabled): the program enables tpu.googleapis.com and a new enablement takes a "
                "few minutes to propagate")
    account = props.get("service_account_email", "the VMs' service account")
    return (f"whoever runs `pulumi up` needs roles/iam.serviceAccountUser (actAs) on {account} "
            "and roles/tpu.admin; a grant made minutes ago may still be propagating "
            "(multislice:deployer makes the actAs grant itself)")


def _shown(value: Any) -> str:
    return f"{str(value)[:40]}..." if len(str(value)) > 40 else repr(value)


class QueuedResourceProvider(ResourceProvider):
    """CRUD for one queued resource. Instances are pickled into the stack state: keep it small."""

    # Nothing secret is captured, so the serialized provider need not be a secret.
    serialize_as_secret_always = False

    def __init__(
        self,
        retry_deadline_s: float = 300.0,
        retry_initial_s: float = 1.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.retry_deadline_s = retry_deadline_s
        self.retry_initial_s = retry_initial_s
        self.request_timeout_s = request_timeout_s  # one HTTP call; a slower answer is retried

    # ---- helpers ---------------------------------------------------------------------------
    def _client(self) -> Any:
        return tpu_api.make_tpu_client()

    def _retry(self) -> Any:
        return tpu_api.transient_retry(self.retry_deadline_s, self.retry_initial_s)

    @staticmethod
    def _name(props: dict[str, Any]) -> str:
        return tpu_api.queued_resource_name(
            props["project"], props["zone"], props["queued_resource_id"]
        )

    def _outputs(self, props: dict[str, Any], qr: Any) -> dict[str, Any]:
        ids = node_ids(props["node_prefix"], int(props["slices"]))
        return {
            **props,
            "name": qr.name or self._name(props),
            "state": tpu_api.state_name(qr),
            "node_ids": ids,
            "node_names": [tpu_api.node_name(props["project"], props["zone"], i) for i in ids],
        }

    # ---- check / diff ----------------------------------------------------------------------
    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        problems = spec_problems(news)
        if not problems:
            problems = _metadata_problems(news)
        if not problems:
            try:
                _to_request(news)
            except Exception as exc:  # the proto itself rejects the shape
                problems = [("queued_resource_id", f"request does not build: {exc}")]
        return CheckResult(news, [CheckFailure(prop, reason) for prop, reason in problems])

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        replaces = [f for f in IMMUTABLE_FIELDS if olds.get(f) != news.get(f)
                    and not (f in ADDED_LATER and f not in olds)]
        if olds.get("state") in tpu_api.BROKEN_STATES:
            # Refreshed as FAILED/SUSPENDED: it still holds quota and will not recover by itself,
            # so `pulumi refresh && pulumi up` deletes and re-creates it.
            replaces.append("state")
        soft = [f for f in PROVIDER_ONLY_FIELDS if olds.get(f) != news.get(f)]
        return DiffResult(
            changes=bool(replaces or soft),
            replaces=replaces,
            stables=["project", "zone", "queued_resource_id"],
            delete_before_replace=True,
        )

    # ---- create / read / update / delete ---------------------------------------------------
    def create(self, props: dict[str, Any]) -> CreateResult:
        from google.api_core import exceptions

        client = self._client()
        name = self._name(props)
        try:
            self._submit(client, props)
        except exceptions.Conflict:  # HTTP 409 (AlreadyExists is a subclass)
            self._adopt_or_refuse(client, props)
        qr = self.wait_for_active(client, props)
        return CreateResult(name, self._outputs(props, qr))

    def _submit(self, client: Any, props: dict[str, Any]) -> None:
        """Send the create and wait for its operation; a 403 is retried for permission_retry_s
        with one line per retry (IAM grants and a just-enabled API take minutes to be seen)."""
        from google.api_core import exceptions

        name = self._name(props)
        budget = float(props.get("permission_retry_s", DEFAULT_PERMISSION_RETRY_S))
        deadline = time.monotonic() + budget
        delay = 5.0 * self.retry_initial_s
        attempt = 0
        while True:
            attempt += 1
            try:
                op = client.create_queued_resource(
                    request=_to_request(props), retry=self._retry(),
                    timeout=self.request_timeout_s)
                op.result(timeout=self.retry_deadline_s, retry=self._retry())
                return
            except exceptions.Forbidden as exc:  # HTTP 403 (PermissionDenied is its gRPC twin)
                why = _permission_reason(exc, props)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueuedResourceError(
                        f"creating queued resource {name} was refused with HTTP 403 for "
                        f"{budget:.0f}s ({attempt} attempts): {why}. API said: "
                        f"{_api_message(exc)}"
                    ) from None
                wait = min(delay, left)
                _progress(f"creating {name}: HTTP 403, {why}; retry {attempt} in {wait:.0f}s "
                          f"(for up to {budget:.0f}s)")
                time.sleep(wait)
                delay = min(delay * 2, MAX_PERMISSION_DELAY_S)

    def _adopt_or_refuse(self, client: Any, props: dict[str, Any]) -> None:
        """A queued resource with our id exists but Pulumi has no record of it (an interrupted
        create; dynamic resources cannot be imported). Adopt it when it is this stack's request,
        else fail naming it and the command that deletes it."""
        name = self._name(props)
        existing = client.get_queued_resource(
            name=name, retry=self._retry(), timeout=self.request_timeout_s
        )
        mismatch = spec_mismatch(props, existing)
        if mismatch:
            raise QueuedResourceError(
                f"queued resource {name} already exists and is not this stack's request "
                f"({mismatch}); Pulumi does not track it. Delete it with `gcloud compute tpus "
                f"queued-resources delete {props['queued_resource_id']} --project "
                f"{props['project']} --zone {props['zone']} --force`, then run `pulumi up` again."
            )
        _progress(f"{name} already exists with this stack's spec (left by an interrupted "
                  f"create): adopting it, state {tpu_api.state_name(existing)}")

    def wait_for_active(self, client: Any, props: dict[str, Any]) -> Any:
        """Poll until ACTIVE with backoff; on FAILED/SUSPENDED or timeout, delete and raise."""
        name = self._name(props)
        wait_s = float(props.get("wait_for_active_s") or DEFAULT_WAIT_S)
        interval = float(props.get("poll_interval_s") or DEFAULT_POLL_S)
        start = time.monotonic()
        last_state = ""
        while True:
            qr = client.get_queued_resource(
                name=name, retry=self._retry(), timeout=self.request_timeout_s
            )
            state = tpu_api.state_name(qr)
            elapsed = time.monotonic() - start
            if state != last_state:
                _progress(f"{name}: {state} after {elapsed:.0f}s")
                last_state = state
            if state == "ACTIVE":
                return qr
            if state in tpu_api.BROKEN_STATES:
                detail = tpu_api.failure_message(qr) or "the API gave no error message"
                self._cleanup(client, props)
                raise QueuedResourceError(
                    f"queued resource {name} went {state} before becoming ACTIVE: {detail}. "
                    "It was deleted so it holds no quota; fix the cause and run `pulumi up` again."
                )
            if elapsed >= wait_s:
                self._cleanup(client, props)
                hint = (
                    " (no capacity yet: try another zone, spot/reserved capacity, a queueing "
                    "window, or raise multislice:wait_for_active_s)"
                    if state == "WAITING_FOR_RESOURCES"
                    else ""
                )
                raise QueuedResourceError(
                    f"timed out after {wait_s:.0f}s waiting for queued resource {name} to become "
                    f"ACTIVE; it was still {state}{hint}. The request was deleted."
                )
            time.sleep(min(interval, max(0.0, wait_s - elapsed)))
            interval = min(interval * 1.5, MAX_POLL_S)

    def _cleanup(self, client: Any, props: dict[str, Any]) -> None:
        try:
            self._delete(client, props)
        except Exception as exc:  # report the original failure, mention the leftover
            _progress(f"cleanup of {self._name(props)} failed: {exc}; delete it by hand")

    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        from google.api_core import exceptions

        try:
            qr = self._client().get_queued_resource(
                name=id_, retry=self._retry(), timeout=self.request_timeout_s
            )
        except exceptions.NotFound:
            return ReadResult(None, {})
        return ReadResult(id_, self._outputs(props, qr))

    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        # Only provider-only inputs reach here (everything else replaces): nothing to call.
        carried = {k: olds[k] for k in ("name", "state", "node_ids", "node_names") if k in olds}
        return UpdateResult({**news, **carried})

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        self._delete(self._client(), props)

    def _delete(self, client: Any, props: dict[str, Any]) -> None:
        from google.api_core import exceptions
        from google.cloud import tpu_v2

        name = self._name(props)
        timeout = float(props.get("delete_timeout_s") or DEFAULT_DELETE_TIMEOUT_S)
        request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)
        try:
            op = client.delete_queued_resource(
                request=request, retry=self._retry(), timeout=self.request_timeout_s
            )
            op.result(timeout=timeout, retry=self._retry())
        except exceptions.NotFound:
            return
        left = tpu_api.wait_until_gone(
            client, name, timeout, float(props.get("poll_interval_s") or DEFAULT_POLL_S),
            self.request_timeout_s, self._retry(),
            on_poll=lambda state: _progress(f"{name}: {state}, waiting for the delete to finish"))
        if left is not None:
            raise QueuedResourceError(
                f"queued resource {name} was still {left} when delete_timeout_s "
                f"({timeout:.0f}s) ran out, so its id is not free for the replacement. Check it "
                f"with `gcloud compute tpus queued-resources describe "
                f"{props['queued_resource_id']} --project {props['project']} --zone "
                f"{props['zone']}` and run `pulumi up` again once it is gone."
            )
