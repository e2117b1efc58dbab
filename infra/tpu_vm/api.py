"""The single place a TPU API (v2) client is built, plus the retry policy every call shares.

``MULTISLICE_TPU_API_ENDPOINT`` (e.g. ``http://127.0.0.1:8470``) points every client at another
endpoint (a local emulator in tests) with anonymous credentials, like gcloud's endpoint overrides.
google.cloud imports stay inside functions so that importing this module is cheap for the CLI.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from infra.stack_config.names import node_ids

if TYPE_CHECKING:
    from google.api_core.retry import Retry
    from google.cloud.tpu_v2 import TpuClient

ENDPOINT_ENV = "MULTISLICE_TPU_API_ENDPOINT"

# Queued-resource states, by name; the API's integer values live in tpu_v2.QueuedResourceState.
# BROKEN: still holds quota and never recovers by itself (delete and create again).
BROKEN_STATES = frozenset({"FAILED", "SUSPENDED"})
# QUEUED: accepted, waiting for capacity (what a queueing deadline or --max-wait cancels).
QUEUED_STATES = frozenset({"ACCEPTED", "WAITING_FOR_RESOURCES"})


_ENDPOINT_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?/?$")


class TpuEndpointError(ValueError):
    """MULTISLICE_TPU_API_ENDPOINT is not an endpoint a client can talk to."""


def make_tpu_client(endpoint: str | None = None) -> TpuClient:
    """A ``TpuClient``; honours MULTISLICE_TPU_API_ENDPOINT (REST, anonymous credentials)."""
    from google.cloud import tpu_v2

    endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or None
    if not endpoint:
        return tpu_v2.TpuClient()
    if not _ENDPOINT_RE.match(endpoint):
        raise TpuEndpointError(
            f"{ENDPOINT_ENV}={endpoint!r} is not an endpoint; use http://HOST:PORT or "
            "https://HOST[:PORT] (e.g. http://127.0.0.1:8470), or unset it for the real API"
        )
    from google.auth.credentials import AnonymousCredentials

    return tpu_v2.TpuClient(
        credentials=AnonymousCredentials(),
        transport="rest",
        client_options={"api_endpoint": endpoint},
    )


def transient_retry(deadline_s: float = 300.0, initial_s: float = 1.0) -> Retry:
    """Retry 429 / 503 / 504 / connection resets with exponential backoff (jittered)."""
    from google.api_core import exceptions, retry

    transient = retry.if_exception_type(
        exceptions.TooManyRequests,
        exceptions.ServiceUnavailable,
        exceptions.GatewayTimeout,
        exceptions.DeadlineExceeded,
        exceptions.InternalServerError,
        ConnectionError,
    )

    def _is_transient(exc: Exception) -> bool:
        if transient(exc):
            return True
        # requests' own connection/timeout errors (the REST transport raises these unwrapped)
        mod = type(exc).__module__
        return mod.startswith("requests") and type(exc).__name__ in (
            "ConnectionError",
            "Timeout",
            "ReadTimeout",
            "ConnectTimeout",
        )

    return retry.Retry(
        predicate=_is_transient,
        initial=initial_s,
        maximum=min(30.0, deadline_s),
        multiplier=2.0,
        timeout=deadline_s,
    )


def node_ids_of(qr: Any, default_prefix: str = "") -> list[tuple[str, str]]:
    """(node id, accelerator type) of every node a ``QueuedResource`` message asks for.

    A multislice spec without ``node_id_prefix`` is prefixed with ``default_prefix`` (the queued
    resource id, as the API does)."""
    out: list[tuple[str, str]] = []
    for spec in qr.tpu.node_spec:
        params = spec.multislice_params
        if params and params.node_count:
            ids = node_ids(params.node_id_prefix or default_prefix, params.node_count)
        else:
            ids = [spec.node_id] if spec.node_id else []
        out += [(node_id, spec.node.accelerator_type) for node_id in ids]
    return out


def queued_resource_name(project: str, zone: str, qr_id: str) -> str:
    return f"projects/{project}/locations/{zone}/queuedResources/{qr_id}"


def node_name(project: str, zone: str, node_id: str) -> str:
    return f"projects/{project}/locations/{zone}/nodes/{node_id}"


def state_name(qr: Any) -> str:
    """The state of a ``QueuedResource`` message as a string such as ``ACTIVE``."""
    return qr.state.state.name


def failure_message(qr: Any) -> str:
    """The API's own error text for a FAILED queued resource (empty when it gave none)."""
    data = qr.state.failed_data
    if data and data.error and data.error.message:
        return f"{data.error.message} (code {data.error.code})"
    return ""


def wait_until_gone(client: Any, name: str, timeout_s: float, interval_s: float,
                    request_timeout_s: float, retry: Any,
                    on_poll: Callable[[str], None] = lambda _state: None) -> str | None:
    """Poll GET until it answers 404; returns None once gone, else the last state seen when
    `timeout_s` ran out. A done delete operation does not free the id: the queued resource
    lingers in DELETING for a while, and a create of the same id in that time is refused."""
    from google.api_core import exceptions

    deadline = time.monotonic() + timeout_s
    state = "unknown"
    while True:
        try:
            qr = client.get_queued_resource(name=name, retry=retry, timeout=request_timeout_s)
        except exceptions.NotFound:
            return None
        state = state_name(qr)
        on_poll(state)
        left = deadline - time.monotonic()
        if left <= 0:
            return state
        time.sleep(min(interval_s, left))
        interval_s = min(interval_s * 1.5, 30.0)
