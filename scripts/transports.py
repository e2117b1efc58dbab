"""How to reach one TPU worker: the argv that runs a shell command on it.

A transport only builds command lines; `scripts.fanout` runs them. Two transports:

- `OpenSSHTransport`: plain `ssh` to the worker's (internal) IP, non-interactive (`BatchMode`),
  optionally through an IAP tunnel as a ProxyCommand.
- `GcloudTransport`: `gcloud compute tpus tpu-vm ssh NODE --worker=N`, which manages keys itself.

Both pass the remote command as one string that the worker's login shell runs, and both forward
stdin, so an upload is just `tar` on stdin.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Worker:
    """One TPU VM: worker `worker_index` of slice `slice_index`."""

    slice_index: int
    worker_index: int
    host: str
    port: int | None = None
    node: str | None = None  # TPU node name (needed by the gcloud transport)

    @property
    def label(self) -> str:
        where = self.host if self.port is None else f"{self.host}:{self.port}"
        return f"slice {self.slice_index} worker {self.worker_index} ({where})"


class Transport(Protocol):
    def argv(self, worker: Worker, remote_command: str) -> list[str]:
        """The local command line that runs `remote_command` in a shell on `worker`."""
        ...


# ssh exits with 255 when it could not connect or authenticate (gcloud passes that through).
TRANSPORT_FAILURE_EXIT_CODE = 255


@dataclass(frozen=True)
class IapTunnel:
    """Reach workers through Identity-Aware Proxy (no external IP, SSH only from the IAP range)."""

    project: str
    zone: str

    def proxy_command(self) -> str:
        # %h and %p are expanded by ssh to the worker's host and port.
        return (
            "gcloud compute start-iap-tunnel %h %p --listen-on-stdin"
            f" --project={shlex.quote(self.project)} --zone={shlex.quote(self.zone)} --verbosity=warning"
        )


@dataclass(frozen=True)
class OpenSSHTransport:
    user: str | None = None
    identity_file: str | None = None
    known_hosts_file: str | None = None
    # accept-new trusts a worker's key the first time and refuses a changed one later.
    strict_host_key_checking: str = "accept-new"
    connect_timeout_s: int = 10
    iap: IapTunnel | None = None
    extra_options: tuple[str, ...] = field(default_factory=tuple)
    ssh_binary: str = "ssh"

    def argv(self, worker: Worker, remote_command: str) -> list[str]:
        cmd = [
            self.ssh_binary,
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={self.connect_timeout_s}",
            "-o", f"StrictHostKeyChecking={self.strict_host_key_checking}",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if self.known_hosts_file:
            cmd += ["-o", f"UserKnownHostsFile={self.known_hosts_file}"]
        if self.identity_file:
            cmd += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        if self.iap is not None:
            cmd += ["-o", f"ProxyCommand={self.iap.proxy_command()}"]
        if worker.port is not None:
            cmd += ["-p", str(worker.port)]
        for option in self.extra_options:
            cmd += ["-o", option]
        destination = worker.host if self.user is None else f"{self.user}@{worker.host}"
        return [*cmd, destination, "--", remote_command]


@dataclass(frozen=True)
class GcloudTransport:
    project: str
    zone: str
    internal_ip: bool = False
    tunnel_through_iap: bool = False

    def argv(self, worker: Worker, remote_command: str) -> list[str]:
        if not worker.node:
            raise ValueError(
                f"{worker.label} has no TPU node name; the gcloud transport needs one "
                "(discover workers from the queued resource, or use --transport ssh)"
            )
        cmd = [
            "gcloud", "compute", "tpus", "tpu-vm", "ssh", worker.node,
            f"--project={self.project}",
            f"--zone={self.zone}",
            f"--worker={worker.worker_index}",
            "--quiet",
        ]  # fmt: skip
        if self.internal_ip:
            cmd.append("--internal-ip")
        if self.tunnel_through_iap:
            cmd.append("--tunnel-through-iap")
        cmd.append(f"--command={remote_command}")
        return [*cmd, "--", "-o", "BatchMode=yes"]


def node_ids_of(queued_resource: Any, queued_resource_id: str) -> list[str]:
    """Node ids of a queued resource, in slice order (multislice nodes are PREFIX-0, PREFIX-1, ...)."""
    ids: list[str] = []
    for spec in queued_resource.tpu.node_spec:
        params = spec.multislice_params
        if params and params.node_count:
            prefix = params.node_id_prefix or queued_resource_id
            ids += [f"{prefix}-{i}" for i in range(params.node_count)]
        elif spec.node_id:
            ids.append(spec.node_id)
    return ids


def discover_workers(
    project: str,
    zone: str,
    queued_resource_id: str,
    client: Any | None = None,
    ssh_port: int | None = None,
) -> list[Worker]:
    """Every worker of every slice of an ACTIVE queued resource, from the TPU API.

    The client comes from `infra.tpu_api.make_tpu_client`, so MULTISLICE_TPU_API_ENDPOINT is
    honoured. Worker N of a slice is its node's Nth network endpoint (gcloud's --worker=N). An
    endpoint's port is the TPU runtime's (8470), not SSH's, so workers get `ssh_port` (None: 22).
    """
    from infra.tpu_api import make_tpu_client, node_name, queued_resource_name

    client = client or make_tpu_client()
    qr = client.get_queued_resource(name=queued_resource_name(project, zone, queued_resource_id))
    state = qr.state.state.name if qr.state else "STATE_UNSPECIFIED"
    if state != "ACTIVE":
        raise RuntimeError(
            f"queued resource {queued_resource_id!r} is {state}; its workers can be reached only "
            "when it is ACTIVE"
        )
    workers: list[Worker] = []
    for slice_index, node_id in enumerate(node_ids_of(qr, queued_resource_id)):
        node = client.get_node(name=node_name(project, zone, node_id))
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
                )
            )
    return workers


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
