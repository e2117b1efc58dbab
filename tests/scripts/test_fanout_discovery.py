"""`multislice run QR`: workers found through the TPU API emulator, reached by SSH.

Each emulated TPU VM is an sshd on its own loopback address (127.0.1.N, one shared port), and the
emulator reports those addresses as the nodes' network endpoints, so the whole path runs: TPU API
(via MULTISLICE_TPU_API_ENDPOINT) -> worker list -> detached launch -> poll -> per-worker logs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sshd_fixture import SshCluster, ensure_ssh_client

from scripts.cli import main
from scripts.emulators.tpu_emulator import TpuEmulator
from scripts.fanout.engine import EXIT_OK

pytestmark = pytest.mark.slow

PROJECT, ZONE = "my-proj", "us-central2-b"
SLICES, HOSTS = 2, 2  # v4-16: 8 chips, 2 hosts per slice


def address(slice_index: int, host_index: int) -> str:
    return f"127.0.1.{slice_index * HOSTS + host_index + 1}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    if ensure_ssh_client() is None:
        pytest.fail("OpenSSH's ssh client is missing and could not be installed (openssh-client)")
    addresses = [address(s, h) for s in range(SLICES) for h in range(HOSTS)]
    servers = SshCluster(tmp_path_factory.mktemp("sshd")).start(len(addresses), addresses)
    yield servers
    servers.stop()


@pytest.fixture
def published(cluster: SshCluster) -> dict[tuple[int, int], str]:
    """The host key each worker's guest agent publishes ((slice, worker) -> "TYPE BASE64"; a
    worker left out publishes none): by default the key its sshd shows."""
    return {(s, h): cluster.host_public_key for s in range(SLICES) for h in range(HOSTS)}


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch, published: dict[tuple[int, int], str]
             ) -> Iterator[TpuEmulator]:
    def guest_attributes(qr: str, s: int, h: int) -> dict[str, str]:
        if (s, h) not in published:
            return {}
        kind, blob = published[(s, h)].split()
        return {f"hostkeys/{kind}": blob}

    # The API reports the TPU runtime port (8470); SSH must not use it.
    emu = TpuEmulator(port=0, endpoint_fn=lambda qr, s, h: (address(s, h), 8470),
                      guest_attributes_fn=guest_attributes)
    with emu:
        monkeypatch.setenv("MULTISLICE_TPU_API_ENDPOINT", emu.url)
        yield emu


def create_multislice(qr_id: str) -> None:
    from google.cloud import tpu_v2

    from infra.tpu_vm.api import make_tpu_client

    parent = f"projects/{PROJECT}/locations/{ZONE}"
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=parent,
        multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
            node_count=SLICES, node_id_prefix=f"{qr_id}-n"
        ),
        node=tpu_v2.Node(accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base"),
    )
    request = tpu_v2.CreateQueuedResourceRequest(
        parent=parent,
        queued_resource_id=qr_id,
        queued_resource=tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec])),
    )
    make_tpu_client().create_queued_resource(request).result(timeout=30)


def cli_args(cluster: SshCluster, tmp_path: Path, qr_id: str, run_id: str) -> list[str]:
    return [
        "run", qr_id, "--project", PROJECT, "--zone", ZONE,
        "--ssh-port", str(cluster.ports[0]),
        "--identity-file", str(cluster.client_key),
        "--max-concurrency", "2", "--interval", "0.3", "--run-id", run_id,
        "--remote-root", str(tmp_path / "remote"), "--log-dir", str(tmp_path / run_id),
    ]  # fmt: skip


def test_workers_come_from_the_queued_resource_and_each_runs_on_its_own_vm(
    cluster: SshCluster, emulator: TpuEmulator, tmp_path: Path
) -> None:
    create_multislice("qr-run")
    emulator.set_state("qr-run", "ACTIVE")
    # SSH_CONNECTION's third field is the address the worker's sshd was reached on.
    command = 'set -- $SSH_CONNECTION; echo "$MULTISLICE_SLICE_INDEX $MULTISLICE_WORKER_INDEX $3"'
    assert main([*cli_args(cluster, tmp_path, "qr-run", "r1"), "--", command]) == EXIT_OK
    for s in range(SLICES):
        for h in range(HOSTS):
            log = (tmp_path / "r1" / f"slice-{s}-worker-{h}.log").read_text()
            assert log == f"{s} {h} {address(s, h)}\n"
    assert emulator.count_requests("GET", "/nodes/qr-run-n-1") >= 1
    # ssh trusted exactly the keys the TPU API published (no --known-hosts, no key accepted new)
    pinned = (tmp_path / "r1" / "known_hosts").read_text().splitlines()
    assert sorted(pinned) == sorted(f"[{address(s, h)}]:{cluster.ports[0]} "
                                    f"{cluster.host_public_key}"
                                    for s in range(SLICES) for h in range(HOSTS))


def test_a_worker_showing_a_key_the_api_did_not_publish_is_refused_and_runs_nothing(
    cluster: SshCluster, emulator: TpuEmulator, published: dict[tuple[int, int], str],
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Slice 1 worker 0's guest agent published another key than the one its address answers
    # with: a VM re-created since, or a machine posing as it.
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    published[(1, 0)] = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    create_multislice("qr-mitm")
    emulator.set_state("qr-mitm", "ACTIVE")
    marker = tmp_path / "ran"
    started = time.monotonic()
    code = main([*cli_args(cluster, tmp_path, "qr-mitm", "r3"), "--",
                 f"set -- $SSH_CONNECTION; touch {marker}-$3"])
    err = capsys.readouterr().err
    assert code != EXIT_OK
    assert f"slice 1 worker 0 ({address(1, 0)}:{cluster.ports[0]})" in err, err
    assert "ssh refused its host key" in err and "not one the TPU API publishes" in err, err
    assert not Path(f"{marker}-{address(1, 0)}").exists()
    assert time.monotonic() - started < 60  # refused at once, not retried as unreachable


def test_a_worker_that_published_no_host_key_needs_known_hosts_in_one_line(
    cluster: SshCluster, emulator: TpuEmulator, published: dict[tuple[int, int], str],
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    del published[(0, 1)]
    create_multislice("qr-nokey")
    emulator.set_state("qr-nokey", "ACTIVE")
    assert main([*cli_args(cluster, tmp_path, "qr-nokey", "r4"), "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "slice 0 worker 1" in err, err
    assert "published no SSH host key" in err and "--known-hosts FILE" in err, err
    assert not (tmp_path / "r4").exists()
    # the user's own file of keys they checked lets it through
    assert main([*cli_args(cluster, tmp_path, "qr-nokey", "r5"), "--known-hosts",
                 str(cluster.known_hosts), "--", "true"]) == EXIT_OK


def test_run_refuses_a_queued_resource_that_is_not_active(
    cluster: SshCluster, emulator: TpuEmulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    create_multislice("qr-wait")
    emulator.set_state("qr-wait", "WAITING_FOR_RESOURCES")
    assert main([*cli_args(cluster, tmp_path, "qr-wait", "r2"), "--", "true"]) == 2
    assert "queued resource 'qr-wait' is WAITING_FOR_RESOURCES" in capsys.readouterr().err
