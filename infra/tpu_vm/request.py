"""Build the TPU v2 ``CreateQueuedResource`` request from a plain spec (pure, no cloud imports).

The spec is the dynamic resource's inputs: a flat JSON-able dict. The result uses the proto's
snake_case field names, so ``tpu_v2.CreateQueuedResourceRequest(result)`` accepts it as is, and the
offline render can print it.
"""

from __future__ import annotations

from typing import Any

from infra.stack_config.topology import MAX_SLICES
from infra.tpu_vm.checks import queueing_window_to_api

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)

# Inputs that the API cannot change in place: any change replaces the queued resource.
IMMUTABLE_FIELDS = (
    "project",
    "zone",
    "queued_resource_id",
    "accelerator_type",
    "runtime_version",
    "slices",
    "node_prefix",
    "network",
    "subnetwork",
    "enable_external_ips",
    "secure_boot",
    "tags",
    "labels",
    "service_account_email",
    "metadata",
    "capacity",
    "reservation_name",
    "valid_until",
    "valid_after",
)

# Inputs a queued resource made by an older toolkit does not record: a new value for one is
# taken at the next creation, never a reason to give up the slices it holds (its queue place,
# its capacity). Secure Boot turned on by an upgrade must not re-queue every running stack.
ADDED_LATER = ("secure_boot",)

# Inputs that only steer the provider (waiting), not the cloud resource.
PROVIDER_ONLY_FIELDS = ("wait_for_active_s", "poll_interval_s", "delete_timeout_s",
                        "permission_retry_s")

REQUIRED_FIELDS = (
    "project",
    "zone",
    "queued_resource_id",
    "accelerator_type",
    "runtime_version",
    "slices",
    "node_prefix",
    "network",
    "subnetwork",
    "service_account_email",
)


def spec_problems(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, reason) pairs for a spec the builder cannot turn into a valid request."""
    out = [
        (f, f"{f} is required but missing") for f in REQUIRED_FIELDS if spec.get(f) in (None, "")
    ]
    slices = spec.get("slices")
    if slices is not None and (not isinstance(slices, int | float)
                               or not 1 <= int(slices) <= MAX_SLICES):
        out.append(("slices", f"slices: value {slices!r} is out of range; allowed 1..{MAX_SLICES}"))
    capacity = spec.get("capacity", "on-demand")
    if capacity not in ("on-demand", "spot", "reserved", "guaranteed"):
        out.append(
            (
                "capacity",
                f"capacity: value {capacity!r} is not allowed; "
                "use on-demand, spot, reserved or guaranteed",
            )
        )
    if spec.get("reservation_name") and capacity != "reserved":
        out.append(
            (
                "reservation_name",
                f"reservation_name: {spec['reservation_name']!r} needs capacity 'reserved', "
                f"got {capacity!r}",
            )
        )
    return out


def reservation_resource_name(project: str, zone: str, name: str | None) -> str:
    """The full reservation name the API takes; ``-`` (any reservation) when none is named.

    gcloud's ``--reserved`` sends ``projects/P/locations/Z/reservations/-``; a short name ``r1``
    becomes ``projects/P/locations/Z/reservations/r1``; a full name is kept as given.
    """
    if name and name.startswith("projects/"):
        return name
    return f"projects/{project}/locations/{zone}/reservations/{name or '-'}"


def build_queued_resource_request(spec: dict[str, Any]) -> dict[str, Any]:
    """The full CreateQueuedResourceRequest for ``spec`` as a dict."""
    parent = f"projects/{spec['project']}/locations/{spec['zone']}"
    slices = int(spec["slices"])
    capacity = spec.get("capacity", "on-demand")

    node: dict[str, Any] = {
        "accelerator_type": spec["accelerator_type"],
        "runtime_version": spec["runtime_version"],
        "network_config": {
            "network": spec["network"],
            "subnetwork": spec["subnetwork"],
            "enable_external_ips": bool(spec.get("enable_external_ips", False)),
        },
        "service_account": {
            "email": spec["service_account_email"],
            "scope": list(SCOPES),
        },
        "tags": list(spec.get("tags") or []),
        "labels": dict(spec.get("labels") or {}),
        "metadata": dict(spec.get("metadata") or {}),
    }
    if spec.get("secure_boot"):
        node["shielded_instance_config"] = {"enable_secure_boot": True}
    node_spec: dict[str, Any] = {"parent": parent, "node": node}
    if slices > 1:
        node_spec["multislice_params"] = {
            "node_count": slices,
            "node_id_prefix": spec["node_prefix"],
        }
    else:
        node_spec["node_id"] = spec["node_prefix"]

    queued: dict[str, Any] = {"tpu": {"node_spec": [node_spec]}}
    if capacity == "spot":
        queued["spot"] = {}
    elif capacity == "guaranteed":
        queued["guaranteed"] = {}
    if capacity == "reserved":
        queued["reservation_name"] = reservation_resource_name(
            spec["project"], spec["zone"], spec.get("reservation_name"))

    policy: dict[str, Any] = {}
    until, after = spec.get("valid_until"), spec.get("valid_after")
    if until and after:
        # The API holds these in one oneof; together they form an interval of two timestamps.
        policy["valid_interval"] = {
            "start_time": queueing_window_to_api(after)["time"],
            "end_time": queueing_window_to_api(until)["time"],
        }
    else:
        for key, value in (("valid_until", until), ("valid_after", after)):
            if value:
                for kind, api_value in queueing_window_to_api(value).items():
                    policy[f"{key}_{kind}"] = api_value
    if policy:
        queued["queueing_policy"] = policy

    return {
        "parent": parent,
        "queued_resource_id": spec["queued_resource_id"],
        "queued_resource": queued,
    }
