"""How to reach one TPU worker: the argv that runs a shell command on it.

A transport only builds command lines; `scripts.fanout.engine` runs them. Two transports:

- `OpenSSHTransport`: plain `ssh` to the worker's (internal) IP, non-interactive (`BatchMode`),
  optionally through an IAP tunnel as a ProxyCommand.
- `GcloudTransport`: `gcloud compute tpus tpu-vm ssh NODE --worker=N`, which manages keys itself.

Both pass the remote command as one string that the worker's login shell runs, and both forward
stdin, so an upload is just `tar` on stdin.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Protocol

from scripts.fanout.workers import Worker


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
    # known_hosts files (space-separated, as ssh's UserKnownHostsFile takes them); None: ssh's own
    known_hosts_file: str | None = None
    # A worker's key must already be known: pinned from the TPU API, or in a file the user gave.
    strict_host_key_checking: str = "yes"
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
