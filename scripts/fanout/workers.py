"""Which TPU VMs `multislice run` reaches: the Worker record, a hosts file, or the TPU API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Worker:
    """One TPU VM: worker `worker_index` of slice `slice_index`."""

    slice_index: int
    worker_index: int
    host: str
    port: int | None = None
    node: str | None = None  # TPU node name (needed by the gcloud transport)
    # Its SSH host keys as the TPU API publishes them ("TYPE BASE64": the guest agent's
    # hostkeys/ guest attributes); empty for a worker from a hosts file.
    host_keys: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        where = self.host if self.port is None else f"{self.host}:{self.port}"
        return f"slice {self.slice_index} worker {self.worker_index} ({where})"


def check_workers(workers: Sequence[Worker]) -> None:
    """Fail on an empty list or on one (slice, worker) position listed twice."""
    if not workers:
        raise ValueError("no workers to run on: the worker list is empty")
    seen: dict[tuple[int, int], Worker] = {}
    for worker in workers:
        key = (worker.slice_index, worker.worker_index)
        if key in seen:
            raise ValueError(
                f"slice {key[0]} worker {key[1]} is listed twice: {seen[key].host} and {worker.host}"
            )
        seen[key] = worker


def discover_workers(
    project: str,
    zone: str,
    queued_resource_id: str,
    client: Any | None = None,
    ssh_port: int | None = None,
    request_timeout_s: float = 30.0,
    host_keys: bool = True,
) -> list[Worker]:
    """Every worker of every slice of an ACTIVE queued resource, from the TPU API.

    The client comes from `infra.tpu_vm.api.make_tpu_client`, so MULTISLICE_TPU_API_ENDPOINT is
    honoured. Worker N of a slice is its node's Nth network endpoint (gcloud's --worker=N). An
    endpoint's port is the TPU runtime's (8470), not SSH's, so workers get `ssh_port` (None: 22).
    With `host_keys`, each worker's published SSH host keys too (one API call a worker).
    """
    from infra.tpu_vm.api import make_tpu_client, node_ids_of, node_name, queued_resource_name

    client = client or make_tpu_client()
    qr = client.get_queued_resource(name=queued_resource_name(project, zone, queued_resource_id),
                                    timeout=request_timeout_s)
    state = qr.state.state.name if qr.state else "STATE_UNSPECIFIED"
    if state != "ACTIVE":
        raise RuntimeError(
            f"queued resource {queued_resource_id!r} is {state}; its workers can be reached only "
            "when it is ACTIVE"
        )
    workers: list[Worker] = []
    ids = [node_id for node_id, _ in node_ids_of(qr, default_prefix=queued_resource_id)]
    for slice_index, node_id in enumerate(ids):
        node = client.get_node(name=node_name(project, zone, node_id), timeout=request_timeout_s)
        if not node.network_endpoints:
            raise RuntimeError(
                f"TPU node {node_id!r} has no network endpoints yet (state {node.state.name})"
            )
        for worker_index, endpoint in enumerate(node.network_endpoints):
            workers.append(
                Worker(
                    slice_index=slice_index,
                    worker_index=worker_index,
                    host=endpoint.ip_address,
                    port=ssh_port,
                    node=node_id,
                    host_keys=published_host_keys(client, node_name(project, zone, node_id),
                                                  worker_index, request_timeout_s)
                    if host_keys else (),
                )
            )
    return workers


def published_host_keys(client: Any, node: str, worker_index: int, timeout_s: float
                        ) -> tuple[str, ...]:
    """The SSH host keys worker `worker_index` of TPU node `node` published through its guest
    agent (guest attributes under hostkeys/, one per key type, the value the key's base64), as
    "TYPE BASE64" lines; none when it has published none (not booted yet, or an image without
    the guest agent)."""
    from google.api_core import exceptions
    from google.cloud import tpu_v2

    try:
        answer = client.get_guest_attributes(
            tpu_v2.GetGuestAttributesRequest(name=node, query_path="hostkeys/",
                                             worker_ids=[str(worker_index)]), timeout=timeout_s)
    except exceptions.NotFound:
        return ()
    keys = []
    for attributes in answer.guest_attributes:
        for item in attributes.query_value.items:
            value = item.value.strip()
            if item.namespace == "hostkeys" and value and " " not in value:
                keys.append(f"{item.key} {value}")
    return tuple(keys)


def known_hosts_lines(workers: Sequence[Worker]) -> list[str]:
    """known_hosts lines pinning each worker's published host keys to the address ssh reaches
    it at ([HOST]:PORT for a port other than 22, as ssh looks it up)."""
    lines = []
    for worker in workers:
        pattern = worker.host if worker.port in (None, 22) else f"[{worker.host}]:{worker.port}"
        lines += [f"{pattern} {key}" for key in worker.host_keys]
    return lines


def parse_hosts_file(text: str, source: str = "hosts file") -> list[Worker]:
    """Workers from lines `SLICE WORKER HOST [PORT]` (blank lines and # comments ignored)."""
    workers: list[Worker] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        try:
            if len(fields) not in (3, 4):
                raise ValueError
            slice_index, worker_index = int(fields[0]), int(fields[1])
            port = int(fields[3]) if len(fields) == 4 else None
            if slice_index < 0 or worker_index < 0 or (port is not None and not 0 < port < 65536):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{source} line {number}: {raw.strip()!r} is not 'SLICE WORKER HOST [PORT]' "
                "(non-negative integers, port 1-65535)"
            ) from None
        workers.append(Worker(slice_index, worker_index, fields[2], port))
    return workers
