"""The TPU commands against servers that misbehave, and the babysitter across crashes."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.cli import main as cli
from scripts.emulators.tpu_emulator import TpuEmulator
from tests.scripts.test_tpu_ops import (
    PROJECT,
    QUIET_BACKOFF,
    WHERE,
    ZONE,
    create,
    create_bodies,
    read_log,
)

FAST = ["--interval", "0.02"]


class _RawServer:
    """A loopback TCP server that answers every connection with ``reply`` (or never answers)."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.reply is None:
                self.held.append(conn)  # accept, read nothing, answer nothing
                continue
            conn.recv(65536)
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def raw_server(request, monkeypatch) -> Iterator[_RawServer]:
    server = _RawServer(request.param)
    monkeypatch.setenv("MULTISLICE_TPU_API_ENDPOINT", server.url)
    yield server
    server.close()


@pytest.mark.parametrize("raw_server", [None], indirect=True)
@pytest.mark.parametrize("command", [["status", "qr"], ["watch", "qr"], ["reset", "qr"],
                                     ["babysit", "qr", "--until-active"]])
def test_a_server_that_never_answers_fails_every_command_in_bounded_time(
        raw_server, command, capsys, tmp_path):
    started = time.monotonic()
    code = cli([*command, *WHERE, "--request-timeout", "0.3",
                *(["--log", str(tmp_path / "a.jsonl")] if command[0] == "babysit" else [])])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 15, f"{command[0]} took {elapsed:.1f}s"
    assert "did not answer usable responses" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "raw_server",
    [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{not json",
     b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"na"],
    indirect=True, ids=["malformed", "truncated"])
def test_a_malformed_or_truncated_answer_is_one_line_not_a_traceback(raw_server, capsys):
    code = cli(["status", "qr", *WHERE, "--request-timeout", "0.5"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "multislice status:" in err


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://127.0.0.1:1", "http://", "127.0.0.1:80"])
def test_an_invalid_endpoint_override_is_a_usage_error(endpoint, monkeypatch, capsys):
    monkeypatch.setenv("MULTISLICE_TPU_API_ENDPOINT", endpoint)
    assert cli(["status", "qr", *WHERE]) == 2
    err = capsys.readouterr().err
    assert f"MULTISLICE_TPU_API_ENDPOINT={endpoint!r} is not an endpoint" in err
    assert "http://HOST:PORT" in err


# ---- watch --timeout 0 -------------------------------------------------------------------------

def test_watch_timeout_zero_means_no_limit_as_in_babysit():
    from scripts.tpu.commands import EXIT_OK, Target, run_watch

    class Client:
        polls = 0

        def get_queued_resource(self, **_):
            from google.cloud import tpu_v2

            self.polls += 1
            state = "ACTIVE" if self.polls > 50 else "WAITING_FOR_RESOURCES"
            return tpu_v2.QueuedResource(name="q", state={"state": state})

        def list_nodes(self, **_):
            return []

    class Console:
        is_terminal = False

        def print(self, *a, **k):
            pass

    now = [0.0]
    client = Client()
    code = run_watch(client, Target("p", "z", "q"), Console(), interval_s=100.0, timeout_s=0.0,
                     clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert code == EXIT_OK and client.polls == 51  # 5000 s of fake time, never gave up


# ---- babysit: the spec is never only in memory --------------------------------------------------

@pytest.fixture
def emu(monkeypatch):
    with TpuEmulator(port=0, delete_polls=0) as emulator:
        monkeypatch.setenv("MULTISLICE_TPU_API_ENDPOINT", emulator.url)
        yield emulator


def test_babysit_retries_a_create_that_fails_with_503_and_recovers(emu, tmp_path):
    create("qr-a")
    emu.set_state("qr-a", "SUSPENDED")
    emu.inject(status=503, count=2, method="POST", path_contains="/queuedResources")
    log = tmp_path / "a.jsonl"
    code = cli(["babysit", "qr-a", *WHERE, *FAST, *QUIET_BACKOFF, "--until-active",
                "--timeout", "30", "--log", str(log), "--request-timeout", "2"])
    assert code == 0
    assert emu.state_of("qr-a") == "ACTIVE"
    # the setup's create, two 503s, then babysit's create that went through
    assert len(create_bodies(emu, "qr-a")) == 4
    spec_file = log.with_name("a.jsonl.spec.json")
    assert json.loads(spec_file.read_text())["pending_create"] is False


def test_babysit_that_dies_after_the_delete_resumes_from_the_spec_file(emu, tmp_path, capsys):
    request = create("qr-b")
    emu.set_state("qr-b", "FAILED", error="host error")
    emu.inject(status=503, count=1000, method="POST", path_contains="/queuedResources")
    log = tmp_path / "b.jsonl"
    args = ["babysit", "qr-b", *WHERE, *FAST, *QUIET_BACKOFF, "--until-active", "--timeout",
            "30", "--log", str(log), "--request-timeout", "0.5"]
    assert cli(args) == 1  # the create kept failing: the resource is gone...
    assert emu.state_of("qr-b") is None
    saved = json.loads(log.with_name("b.jsonl.spec.json").read_text())
    assert saved["pending_create"] is True  # ...but its spec is on disk
    node = saved["spec"]["tpu"]["nodeSpec"][0]["node"]
    assert node["metadata"] == request["queued_resource"]["tpu"]["node_spec"][0]["node"][
        "metadata"]

    emu.clear_faults()  # the API is back
    capsys.readouterr()
    assert cli(args) == 0  # a rerun creates it from the spec file, no --recreate-missing needed
    assert emu.state_of("qr-b") == "ACTIVE"
    assert "resume" in [e["action"] for e in read_log(log)]
    assert json.loads(log.with_name("b.jsonl.spec.json").read_text())["pending_create"] is False


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "exists and is not a regular file"),
    (lambda p: p.write_text("my notes, not json\n"), "not a spec file babysit wrote"),
    (lambda p: p.write_text('{"queued_resource": "projects/p/locations/z/queuedResources/other"}'),
     "holds queued_resource 'projects/p/locations/z/queuedResources/other', not "),
    (lambda p: p.write_text('{"queued_resource": "QR", "pending_create": true, '
                            '"spec": {"tpu": 7}}'), "its spec is not a queued resource"),
], ids=["directory", "not json", "another target", "broken spec"])
def test_babysit_refuses_a_spec_file_it_did_not_write_in_one_line_and_leaves_it(
        emu, tmp_path, capsys, make, says):
    create("qr-f")
    emu.set_state("qr-f", "SUSPENDED")
    path = tmp_path / "spec.json"
    make(path)
    if path.is_file():
        path.write_text(path.read_text().replace(
            "QR", f"projects/{PROJECT}/locations/{ZONE}/queuedResources/qr-f"))
    before = path.read_text() if path.is_file() else None
    code = cli(["babysit", "qr-f", *WHERE, *FAST, *QUIET_BACKOFF, "--until-active",
                "--timeout", "30", "--spec-file", str(path)])
    err = capsys.readouterr()
    assert code == 2, err
    assert f"--spec-file {path}: {says}" in err.out + err.err and "Traceback" not in err.err
    assert (path.read_text() if path.is_file() else None) == before
    assert emu.state_of("qr-f") == "SUSPENDED"  # nothing deleted on its account


def test_babysit_treats_a_404_on_delete_as_already_gone(emu, tmp_path):
    create("qr-c")
    emu.set_state("qr-c", "SUSPENDED")
    emu.inject(status=404, count=1, method="DELETE", path_contains="queuedResources/qr-c")
    code = cli(["babysit", "qr-c", *WHERE, *FAST, *QUIET_BACKOFF, "--until-active",
                "--timeout", "30", "--spec-file", str(tmp_path / "spec.json")])
    # the injected 404 answered the delete without deleting; the create then finds it and the
    # next poll sees SUSPENDED again, so babysit deletes for real and recreates
    assert code == 0
    assert emu.state_of("qr-c") == "ACTIVE"


def test_babysit_spec_file_default_sits_next_to_the_log(tmp_path):
    from scripts.tpu.babysit import default_spec_file
    from scripts.tpu.commands import Target

    target = Target("p", "z", "q")
    assert default_spec_file(target, tmp_path / "x.jsonl") == tmp_path / "x.jsonl.spec.json"
    assert default_spec_file(target, None) == Path(".multislice/babysit/p-z-q.spec.json")


def test_babysit_cannot_recreate_a_resource_it_never_saw_without_a_stack_config(emu, tmp_path):
    log = tmp_path / "d.jsonl"
    code = cli(["babysit", "qr-d", *WHERE, *FAST, "--recreate-missing", "--timeout", "30",
                "--log", str(log)])
    assert code == 1
    last = read_log(log)[-1]
    assert last["action"] == "error" and "pass --stack-config so it can be rebuilt" in last["reason"]
    assert create_bodies(emu, "qr-d") == []
