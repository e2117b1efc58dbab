"""`multislice run` against real SSH servers on loopback (8 emulated workers, 2 connections at once)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sshd_fixture import SshCluster, ensure_ssh_client

from scripts.fanout import engine as fanout_engine
from scripts.fanout.engine import EXIT_OK, EXIT_UNREACHABLE, EXIT_WORKER_FAILED
from scripts.fanout.options import RunOptions
from scripts.fanout.transports import OpenSSHTransport
from scripts.fanout.workers import Worker

pytestmark = pytest.mark.slow

SLICES, WORKERS_PER_SLICE = 4, 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    if ensure_ssh_client() is None:
        pytest.fail("OpenSSH's ssh client is missing and could not be installed (openssh-client)")
    servers = SshCluster(tmp_path_factory.mktemp("sshd")).start(SLICES * WORKERS_PER_SLICE)
    yield servers
    servers.stop()


def workers_of(cluster: SshCluster) -> list[Worker]:
    return [
        Worker(i // WORKERS_PER_SLICE, i % WORKERS_PER_SLICE, "127.0.0.1", port)
        for i, port in enumerate(cluster.ports)
    ]


def transport_for(cluster: SshCluster, connect_timeout_s: int = 5) -> OpenSSHTransport:
    return OpenSSHTransport(
        identity_file=str(cluster.client_key),
        known_hosts_file=str(cluster.known_hosts),
        connect_timeout_s=connect_timeout_s,
    )


def options(tmp_path: Path, command: str, **overrides) -> RunOptions:
    values = dict(
        command=command,
        run_id=f"t{time.monotonic_ns()}",
        log_dir=tmp_path / "logs",
        max_concurrency=2,
        poll_interval_s=0.3,
        unreachable_timeout_s=20.0,
        call_timeout_s=20.0,
        stop_grace_s=2.0,
        run_timeout_s=90.0,
        remote_root=str(tmp_path / "remote"),
    )
    values.update(overrides)
    return RunOptions(**values)


def is_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (nothing may reap it in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ConcurrencyProbe:
    """Wraps fanout_engine._call to record how many SSH processes run at the same time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self._real = fanout_engine._call

    def __call__(self, argv, timeout_s, stdin=None):
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            return self._real(argv, timeout_s, stdin)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_every_worker_starts_before_any_finishes_with_fewer_connections_than_workers(
    cluster: SshCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    n = len(cluster.ports)
    # Like a multislice job, no worker can finish until all have started: a batch-and-wait
    # fan-out with 2 connections would never get past the first batch (exit 9 after 30 s).
    command = (
        f"m={marks}; w=$MULTISLICE_SLICE_INDEX-$MULTISLICE_WORKER_INDEX; "
        'date +%s.%N > "$m/start-$w"; '
        "i=0; while [ $(ls $m | grep -c '^start-') -lt " + str(n) + " ]; do "
        "i=$((i+1)); [ $i -gt 300 ] && exit 9; sleep 0.1; done; "
        'sleep 1; echo "hello from $w"; date +%s.%N > "$m/end-$w"'
    )
    probe = ConcurrencyProbe()
    monkeypatch.setattr(fanout_engine, "_call", probe)

    result = fanout_engine.run_on_workers(
        workers_of(cluster), transport_for(cluster), options(tmp_path, command)
    )

    assert result.exit_code == EXIT_OK, fanout_engine.format_result(result)
    assert result.exit_codes == {(w.slice_index, w.worker_index): 0 for w in workers_of(cluster)}
    starts = [float(p.read_text()) for p in marks.glob("start-*")]
    ends = [float(p.read_text()) for p in marks.glob("end-*")]
    assert len(starts) == len(ends) == n
    assert max(starts) < min(ends)
    assert probe.peak == 2, f"expected exactly 2 SSH connections at once, saw {probe.peak}"
    for w in workers_of(cluster):
        log = (tmp_path / "logs" / f"slice-{w.slice_index}-worker-{w.worker_index}.log").read_text()
        # Only the worker's own output, once and last: whatever the host's login shell prints
        # before it (this machine's ~/.bashrc runs `pyenv init`, whose rehash two concurrent
        # sessions can race on) is the host's, not the fan-out's.
        lines = log.strip().splitlines()
        want = f"hello from {w.slice_index}-{w.worker_index}"
        assert lines[-1] == want and lines.count(want) == 1, log


def test_first_failure_is_reported_with_its_log_and_the_other_workers_are_killed(
    cluster: SshCluster, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    command = (
        'if [ "$MULTISLICE_SLICE_INDEX-$MULTISLICE_WORKER_INDEX" = 2-1 ]; then '
        "sleep 1; echo step 1; echo step 2; echo 'boom: out of memory' >&2; exit 7; fi; "
        f"sleep 120 & echo $! > {pids}/$MULTISLICE_SLICE_INDEX-$MULTISLICE_WORKER_INDEX; wait"
    )
    started = time.monotonic()
    result = fanout_engine.run_on_workers(
        workers_of(cluster), transport_for(cluster), options(tmp_path, command)
    )
    elapsed = time.monotonic() - started

    assert result.exit_code == EXIT_WORKER_FAILED
    failure = result.failure
    assert failure is not None
    assert (failure.worker.slice_index, failure.worker.worker_index) == (2, 1)
    assert failure.exit_code == 7
    assert failure.last_lines[-3:] == ["step 1", "step 2", "boom: out of memory"]
    report = fanout_engine.format_result(result)
    assert "slice 2 worker 1" in report and "exit code 7" in report and "boom" in report
    assert len(result.stopped) == len(cluster.ports) - 1
    sleepers = [int(p.read_text()) for p in pids.iterdir()]
    assert len(sleepers) == len(cluster.ports) - 1
    deadline = time.monotonic() + 5
    while any(is_alive(pid) for pid in sleepers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in sleepers if is_alive(pid)], "stopped workers' processes survived"
    assert elapsed < 60


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections but never speaks SSH (a hung or firewalled VM)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def test_unreachable_worker_times_out_naming_it_and_the_others_are_stopped(
    cluster: SshCluster, tmp_path: Path, silent_listener: int
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    reachable = workers_of(cluster)[:3]
    dead = Worker(1, 1, "127.0.0.1", silent_listener)
    command = f"sleep 120 & echo $! > {pids}/$MULTISLICE_SLICE_INDEX-$MULTISLICE_WORKER_INDEX; wait"
    started = time.monotonic()
    result = fanout_engine.run_on_workers(
        [*reachable, dead],
        transport_for(cluster, connect_timeout_s=1),
        options(tmp_path, command, unreachable_timeout_s=3.0),
    )
    elapsed = time.monotonic() - started

    assert result.exit_code == EXIT_UNREACHABLE
    assert [w for w, _ in result.unreachable] == [dead]
    report = fanout_engine.format_result(result)
    assert f"slice 1 worker 1 (127.0.0.1:{silent_listener})" in report
    assert "unreachable" in report
    assert sorted(result.stopped, key=lambda w: w.port or 0) == sorted(
        reachable, key=lambda w: w.port or 0
    )
    sleepers = [int(p.read_text()) for p in pids.iterdir()]
    deadline = time.monotonic() + 5
    while any(is_alive(pid) for pid in sleepers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in sleepers if is_alive(pid)]
    assert elapsed < 30


def test_upload_copies_the_directory_and_the_command_runs_inside_it(
    cluster: SshCluster, tmp_path: Path
) -> None:
    code = tmp_path / "experiment"
    (code / "trainer").mkdir(parents=True)
    (code / "trainer" / "data.txt").write_text("payload-42\n")
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "junk.pyc").write_bytes(b"x")
    remote_code = tmp_path / "remote-code"
    command = "cat trainer/data.txt; ls -a | tr '\\n' ' '; echo"
    workers = workers_of(cluster)[:2]
    result = fanout_engine.run_on_workers(
        workers,
        transport_for(cluster),
        options(tmp_path, command, upload=code, workdir=str(remote_code)),
    )
    assert result.exit_code == EXIT_OK, fanout_engine.format_result(result)
    log = (tmp_path / "logs" / "slice-0-worker-1.log").read_text().splitlines()
    assert log[0] == "payload-42"
    assert "__pycache__" not in log[1]


def test_cli_runs_a_hosts_file_and_returns_the_failure_exit_code(
    cluster: SshCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scripts.cli import main

    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# slice worker host port\n"
        + "".join(
            f"{w.slice_index} {w.worker_index} 127.0.0.1 {w.port}\n"
            for w in workers_of(cluster)[:2]
        )
    )
    common = [
        "run", "--hosts", str(hosts),
        "--identity-file", str(cluster.client_key), "--known-hosts", str(cluster.known_hosts),
        "--max-concurrency", "1", "--interval", "0.3",
        "--remote-root", str(tmp_path / "remote"), "--log-dir", str(tmp_path / "cli-logs"),
    ]  # fmt: skip
    assert main([*common, "--run-id", "ok", "--", "echo", "it's", "fine"]) == EXIT_OK
    assert (tmp_path / "cli-logs" / "slice-0-worker-1.log").read_text() == "it's fine\n"
    code = main(
        [
            *common,
            "--run-id",
            "bad",
            "--",
            'echo nope; [ "$MULTISLICE_WORKER_INDEX" = 0 ] || exit 3',
        ]
    )
    assert code == EXIT_WORKER_FAILED
    err = capsys.readouterr().err
    assert "slice 0 worker 1" in err and "exit code 3" in err and "nope" in err
    assert os.path.isdir(tmp_path / "remote" / "bad" / "s0-w1")
