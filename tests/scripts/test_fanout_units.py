"""`multislice run` pieces that need no SSH server: command lines, worker lists, discovery."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from infra.tpu_vm.api import node_ids_of
from scripts.fanout import engine as fanout_engine
from scripts.fanout.options import RunOptions
from scripts.fanout.remote import (
    launch_script,
    make_archive,
    poll_script,
    remote_path,
    stop_script,
)
from scripts.fanout.transports import GcloudTransport, IapTunnel, OpenSSHTransport
from scripts.fanout.workers import Worker, discover_workers, known_hosts_lines, parse_hosts_file

W = Worker(slice_index=1, worker_index=3, host="10.0.0.7", port=2222, node="qr-1")


def test_openssh_argv_is_non_interactive_and_ends_with_the_remote_command() -> None:
    argv = OpenSSHTransport(user="tpu", identity_file="/k", known_hosts_file="/kh").argv(
        W, "echo hi"
    )
    assert argv[0] == "ssh"
    assert argv[-3:] == ["tpu@10.0.0.7", "--", "echo hi"]
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert "BatchMode=yes" in options
    assert "StrictHostKeyChecking=yes" in options  # a key must be known: never accepted new
    assert "UserKnownHostsFile=/kh" in options
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/k"
    assert not any(o.startswith("ProxyCommand") for o in options)


def test_openssh_argv_tunnels_through_iap_when_asked() -> None:
    transport = OpenSSHTransport(iap=IapTunnel(project="my-proj", zone="us-central2-b"))
    argv = transport.argv(Worker(0, 0, "10.0.0.2"), "true")
    proxy = next(a for a in argv if a.startswith("ProxyCommand="))
    assert proxy.startswith("ProxyCommand=gcloud compute start-iap-tunnel %h %p --listen-on-stdin")
    assert "--project=my-proj" in proxy and "--zone=us-central2-b" in proxy
    assert "-p" not in argv  # no port: ssh's default
    assert argv[-3:] == ["10.0.0.2", "--", "true"]


def test_gcloud_argv_addresses_node_and_worker_index() -> None:
    argv = GcloudTransport(project="p", zone="z", internal_ip=True).argv(W, "echo 'a b'")
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "qr-1"]
    assert "--worker=3" in argv and "--project=p" in argv and "--zone=z" in argv
    assert "--internal-ip" in argv and "--tunnel-through-iap" not in argv
    assert "--command=echo 'a b'" in argv
    assert argv[-3:] == ["--", "-o", "BatchMode=yes"]


def test_gcloud_transport_refuses_a_worker_without_node_name() -> None:
    with pytest.raises(ValueError, match=r"slice 0 worker 2 \(10.0.0.9\) has no TPU node name"):
        GcloudTransport(project="p", zone="z").argv(Worker(0, 2, "10.0.0.9"), "true")


def test_gcloud_transport_with_a_static_host_list_is_refused_before_any_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scripts.cli import main

    hosts = tmp_path / "hosts"
    hosts.write_text("0 0 10.0.0.1\n")
    argv = ["run", "--hosts", str(hosts), "--transport", "gcloud", "--project", "p", "--zone", "z",
            "--log-dir", str(tmp_path / "logs"), "--", "true"]  # fmt: skip
    assert main(argv) == 2
    assert "slice 0 worker 0 (10.0.0.1) has no TPU node name" in capsys.readouterr().err


def test_hosts_file_parses_ports_and_comments() -> None:
    text = "# slice worker host port\n0 0 10.0.0.1\n0 1 10.0.0.2 2200  # second\n\n1 0 tpu-b\n"
    assert parse_hosts_file(text) == [
        Worker(0, 0, "10.0.0.1"),
        Worker(0, 1, "10.0.0.2", 2200),
        Worker(1, 0, "tpu-b"),
    ]


@pytest.mark.parametrize("line", ["0 10.0.0.1", "a 0 h", "0 0 h 70000", "-1 0 h"])
def test_hosts_file_errors_name_the_line(line: str) -> None:
    with pytest.raises(
        ValueError, match=rf"hosts line 2: '{line}' is not 'SLICE WORKER HOST \[PORT\]'"
    ):
        parse_hosts_file(f"0 0 ok\n{line}\n", source="hosts")


def test_duplicate_workers_are_rejected_before_any_connection(tmp_path: Path) -> None:
    options = RunOptions(command="true", run_id="r", log_dir=tmp_path)
    with pytest.raises(ValueError, match="slice 0 worker 1 is listed twice: a and b"):
        fanout_engine.FanOut([Worker(0, 1, "a"), Worker(0, 1, "b")], OpenSSHTransport(), options)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("run_id", "../etc", "run id '../etc' is not allowed"),
        ("max_concurrency", 0, "max concurrency must be at least 1, got 0"),
        ("env", (("BAD-NAME", "1"),), "'BAD-NAME' is not a valid shell name"),
    ],
)
def test_run_options_reject_bad_values(tmp_path: Path, field: str, value, message: str) -> None:
    values = {"command": "true", "run_id": "r", "log_dir": tmp_path, field: value}
    with pytest.raises(ValueError, match=message):
        RunOptions(**values)


def test_remote_path_expands_home_but_quotes_everything_else() -> None:
    assert remote_path("~/code dir") == "\"$HOME\"/'code dir'"
    assert remote_path("/opt/$x") == "'/opt/$x'"


def run_sh(script: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """Run a remote snippet the way a worker's login shell would (POSIX sh, HOME set)."""
    return subprocess.run(
        ["sh", "-c", script],
        cwd=cwd,
        capture_output=True,
        env={"HOME": str(cwd), "PATH": "/usr/bin:/bin"},
        timeout=30,
    )


def test_launch_returns_at_once_and_poll_reports_the_exit_code_and_log(tmp_path: Path) -> None:
    options = RunOptions(
        command='echo "$GREETING from $MULTISLICE_SLICE_INDEX/$MULTISLICE_WORKER_INDEX"; sleep 1; exit 5',
        run_id="r1",
        log_dir=tmp_path / "logs",
        env=(("GREETING", "it's me"),),
    )
    launched = run_sh(launch_script(options, W), tmp_path)
    assert launched.returncode == 0 and b"MULTISLICE_LAUNCHED" in launched.stdout
    running = run_sh(poll_script(options, W, 0), tmp_path).stdout
    assert running.startswith(b"MULTISLICE_STATUS running")
    again = run_sh(launch_script(options, W), tmp_path).stdout
    assert b"MULTISLICE_LAUNCHED again" in again  # a retried launch does not start a second copy
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = run_sh(poll_script(options, W, 0), tmp_path).stdout
        if b"exited" in out:
            break
        time.sleep(0.2)
    header, _, body = out.partition(b"\n")
    fields = header.split()
    assert fields[1:3] == [b"exited", b"5"]
    assert body == b"it's me from 1/3\n"
    assert int(fields[-1]) == len(body)
    assert (tmp_path / ".multislice/runs/r1/s1-w3/log").read_bytes() == body
    # An offset skips what was already fetched.
    assert run_sh(poll_script(options, W, len(body)), tmp_path).stdout.partition(b"\n")[2] == b""


def test_reusing_a_run_id_is_refused_instead_of_reading_old_results(tmp_path: Path) -> None:
    options = RunOptions(command="true", run_id="r2", log_dir=tmp_path / "logs")
    assert b"MULTISLICE_LAUNCHED" in run_sh(launch_script(options, W, "first"), tmp_path).stdout
    again = run_sh(launch_script(options, W, "second"), tmp_path)
    assert again.returncode == 17
    assert b"already holds an earlier run; choose another --run-id" in again.stderr


def test_stop_kills_the_whole_process_group_and_poll_sees_it_gone(tmp_path: Path) -> None:
    options = RunOptions(
        command=f"sleep 60 & echo $! > {tmp_path}/child; wait",
        run_id="r3",
        log_dir=tmp_path / "logs",
        stop_grace_s=2.0,
    )
    assert run_sh(launch_script(options, W), tmp_path).returncode == 0
    deadline = time.monotonic() + 10
    while not (tmp_path / "child").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    started = time.monotonic()
    stopped = run_sh(stop_script(options, W), tmp_path)
    assert b"MULTISLICE_STOPPED killed" in stopped.stdout
    assert time.monotonic() - started < 1.9  # did not sit out the grace period on zombies
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    status = run_sh(poll_script(options, W, 0), tmp_path).stdout.split(b"\n", 1)[0]
    assert status.split()[1] == b"vanished"


def test_archive_leaves_out_caches_venvs_and_git(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "main.py").write_text("print(1)\n")
    for junk in (".git", ".venv", "trainer/__pycache__"):
        (tmp_path / junk).mkdir(parents=True)
        (tmp_path / junk / "x").write_text("junk")
    (tmp_path / "trainer" / "old.pyc").write_bytes(b"\0")
    with tarfile.open(fileobj=io.BytesIO(make_archive(tmp_path))) as tar:
        names = sorted(tar.getnames())
    assert names == ["trainer", "trainer/main.py"]


# --- discovery from the TPU API (real proto messages, a minimal in-memory client) -------------


class FakeTpuApi:
    def __init__(self, qr, nodes) -> None:
        self.qr, self.nodes, self.calls = qr, nodes, []

    def get_queued_resource(self, name: str, **_: object):
        self.calls.append(name)
        return self.qr

    def get_node(self, name: str, **_: object):
        self.calls.append(name)
        return self.nodes[name.rsplit("/", 1)[1]]

    def get_guest_attributes(self, request, **_: object):
        from google.cloud import tpu_v2

        self.calls.append(f"{request.name}:{request.query_path}{list(request.worker_ids)}")
        return tpu_v2.GetGuestAttributesResponse(guest_attributes=[tpu_v2.GuestAttributes(
            query_path="hostkeys/", query_value=tpu_v2.GuestAttributesValue(items=[
                tpu_v2.GuestAttributesEntry(namespace="hostkeys", key="ssh-ed25519",
                                            value=f"KEY{request.worker_ids[0]}")]))])


def multislice_qr(state: str = "ACTIVE", prefix: str = ""):
    from google.cloud import tpu_v2

    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent="projects/p/locations/z",
        multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
            node_count=2, node_id_prefix=prefix
        ),
        node=tpu_v2.Node(accelerator_type="v4-16"),
    )
    return tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]),
        state=tpu_v2.QueuedResourceState(state=state),
    )


def node_with(*ips: str):
    from google.cloud import tpu_v2

    return tpu_v2.Node(network_endpoints=[tpu_v2.NetworkEndpoint(ip_address=ip) for ip in ips])


def test_multislice_node_ids_default_to_the_queued_resource_id() -> None:
    ids = [node_id for node_id, _ in node_ids_of(multislice_qr(), "myqr")]
    assert ids == ["myqr-0", "myqr-1"]
    ids = [node_id for node_id, _ in node_ids_of(multislice_qr(prefix="np"), "myqr")]
    assert ids == ["np-0", "np-1"]


def test_discovery_lists_every_worker_of_every_slice_in_order() -> None:
    api = FakeTpuApi(
        multislice_qr(),
        {"qr-0": node_with("10.0.0.1", "10.0.0.2"), "qr-1": node_with("10.0.1.1", "10.0.1.2")},
    )
    workers = discover_workers("p", "z", "qr", client=api)
    assert [(w.slice_index, w.worker_index, w.host, w.node) for w in workers] == [
        (0, 0, "10.0.0.1", "qr-0"),
        (0, 1, "10.0.0.2", "qr-0"),
        (1, 0, "10.0.1.1", "qr-1"),
        (1, 1, "10.0.1.2", "qr-1"),
    ]
    assert api.calls[0] == "projects/p/locations/z/queuedResources/qr"
    assert all(w.port is None for w in workers)
    # each worker's own published key, pinned to the address ssh reaches it at
    assert [w.host_keys for w in workers] == [("ssh-ed25519 KEY0",), ("ssh-ed25519 KEY1",)] * 2
    assert known_hosts_lines([workers[1], dataclasses.replace(workers[2], port=2222)]) == [
        "10.0.0.2 ssh-ed25519 KEY1", "[10.0.1.1]:2222 ssh-ed25519 KEY0"]


def test_discovery_refuses_a_queued_resource_that_is_not_active() -> None:
    api = FakeTpuApi(multislice_qr(state="SUSPENDED"), {})
    with pytest.raises(RuntimeError, match="queued resource 'qr' is SUSPENDED"):
        discover_workers("p", "z", "qr", client=api)


def test_unreadable_hosts_file_names_the_flag_and_the_path(tmp_path, capsys) -> None:
    from scripts.cli import main

    missing = tmp_path / "no-such-hosts"
    assert main(["run", "--hosts", str(missing), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert f"--hosts {missing}" in err
    assert "SLICE WORKER HOST" in err
