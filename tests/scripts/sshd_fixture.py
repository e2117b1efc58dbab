"""Real SSH servers on loopback, one per emulated TPU worker, for the fan-out tests.

OpenSSH's `sshd` is the first choice: it is what the TPU VMs run, so session teardown, process
groups and exit codes behave as they will there. When it is missing and we may install packages
(root, apt-get), Debian's openssh-server is installed on the spot, since CI starts from a fresh
machine. Only when that is impossible does an asyncssh server stand in; it still runs each
command through a real shell in a subprocess, so launch/poll/stop are exercised end to end. The
client is always OpenSSH's `ssh` (the transport under test).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


def _apt_install(package: str) -> bool:
    """Install a Debian package as root, or through passwordless sudo (CI runners)."""
    if shutil.which("apt-get") is None:
        return False
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif (
        shutil.which("sudo")
        and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
    ):
        prefix = ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    else:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*prefix, "apt-get", "install", "-y", "--no-install-recommends", package]
    for attempt in range(2):
        if attempt:
            update = [*prefix, "apt-get", "update"]
            subprocess.run(update, env=env, capture_output=True, timeout=300)
        proc = subprocess.run(install, env=env, capture_output=True, timeout=600)
        if proc.returncode == 0:
            return True
    return False


def find_sshd(install: bool = True) -> str | None:
    found = shutil.which("sshd") or next((p for p in SSHD_CANDIDATES if os.path.exists(p)), None)
    if found is None and install and _apt_install("openssh-server"):
        found = shutil.which("sshd") or next(
            (p for p in SSHD_CANDIDATES if os.path.exists(p)), None
        )
    return found


def ensure_ssh_client() -> str | None:
    if shutil.which("ssh") is None:
        _apt_install("openssh-client")
    return shutil.which("ssh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, host: str = "127.0.0.1", timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no SSH server came up on {host}:{port} within {timeout_s}s")


@dataclass
class SshCluster:
    """N SSH servers on loopback sharing one host key and one authorized client key.

    By default each listens on its own port of 127.0.0.1; with `addresses`, each listens on its
    own loopback address (127.0.1.1, ...) and all share one port, like real VMs on port 22.
    """

    root: Path
    ports: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    kind: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @property
    def client_key(self) -> Path:
        return self.root / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    def _keys(self) -> None:
        for name in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / name)],
                check=True,
            )
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        os.chmod(self.root / "authorized_keys", 0o600)

    def start(self, n: int, addresses: list[str] | None = None) -> SshCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self._keys()
        # MULTISLICE_TEST_SSH_SERVER=asyncssh forces the stand-in (to test it where sshd exists).
        forced = os.environ.get("MULTISLICE_TEST_SSH_SERVER", "")
        sshd = None if forced == "asyncssh" else find_sshd()
        if addresses is not None:
            assert len(addresses) == n
            shared = free_port()
            self.hosts, self.ports = list(addresses), [shared] * n
        else:
            self.hosts = ["127.0.0.1"] * n
            ports: set[int] = set()
            while len(ports) < n:
                ports.add(free_port())
            self.ports = sorted(ports)
        if sshd is not None:
            self.kind = "openssh"
            self._start_openssh(sshd)
        else:
            self.kind = "asyncssh"
            self._start_asyncssh()
        for host, port in zip(self.hosts, self.ports, strict=True):
            wait_for_port(port, host)
        # What a user who checked the servers' key would trust (ssh refuses unknown keys)
        key = self.host_public_key
        self.known_hosts.write_text("".join(f"[{host}]:{port} {key}\n"
                                            for host, port in zip(self.hosts, self.ports,
                                                                  strict=True)))
        return self

    @property
    def host_public_key(self) -> str:
        """The servers' host key as "TYPE BASE64"."""
        return " ".join((self.root / "host_key.pub").read_text().split()[:2])

    def _start_openssh(self, sshd: str) -> None:
        if os.geteuid() == 0:
            # sshd running as root chroots its unprivileged child into this directory.
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        (self.root / "home").mkdir(exist_ok=True)
        for i, (host, port) in enumerate(zip(self.hosts, self.ports, strict=True)):
            config = self.root / f"sshd_{i}.conf"
            config.write_text(
                "\n".join(
                    [
                        f"Port {port}",
                        f"ListenAddress {host}",
                        f"HostKey {self.root / 'host_key'}",
                        f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                        f"PidFile {self.root / f'sshd_{i}.pid'}",
                        "StrictModes no",
                        "UsePAM no",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "PermitRootLogin prohibit-password",
                        "MaxStartups 100",
                        "MaxSessions 100",
                        "LogLevel ERROR",
                        # A worker's own home, as a TPU VM user has: not this machine's /root,
                        # whose ~/.bashrc (which bash reads under sshd) runs `pyenv rehash`,
                        # racing with the other sessions ("pyenv: cannot rehash" in the log).
                        f"SetEnv HOME={self.root / 'home'}",
                    ]
                )
                + "\n"
            )
            log = open(self.root / f"sshd_{i}.log", "wb")  # noqa: SIM115 (kept open for sshd)
            self._procs.append(
                subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
            )

    def _start_asyncssh(self) -> None:
        import asyncssh

        async def handle(process: asyncssh.SSHServerProcess) -> None:
            peer = process.get_extra_info("peername")
            sock = process.get_extra_info("sockname")
            env = {**os.environ, "SSH_CONNECTION": f"{peer[0]} {peer[1]} {sock[0]} {sock[1]}"}
            local = await asyncio.create_subprocess_shell(
                process.command or "true",
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            await process.redirect(stdin=local.stdin, stdout=local.stdout, stderr=local.stderr)
            process.exit(await local.wait())
            await process.wait_closed()

        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._thread.start()
        for host, port in zip(self.hosts, self.ports, strict=True):

            async def serve(host: str = host, port: int = port) -> None:
                await asyncssh.create_server(
                    asyncssh.SSHServer,
                    host,
                    port,
                    server_host_keys=[str(self.root / "host_key")],
                    authorized_client_keys=str(self.root / "authorized_keys"),
                    process_factory=handle,
                    encoding=None,
                )

            asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=30)

    def stop(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
