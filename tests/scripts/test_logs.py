"""`multislice logs`: the hosts' trainer logs from the bucket copy, through the GCS emulator."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.cli import main as cli
from scripts.emulators.gcs_emulator import GcsEmulator

BUCKET = "my-proj-ms-lg"
LOGS = "runs/lg/logs"


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with GcsEmulator() as gcs, pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        gcs.create_bucket(BUCKET)
        yield gcs


@pytest.fixture
def stack(tmp_path: Path, gcs: GcsEmulator) -> Path:
    for name in gcs.list(BUCKET):
        gcs.delete(BUCKET, name)
    path = tmp_path / "Pulumi.lg.yaml"
    path.write_text(
        "config:\n  multislice:project: my-proj\n  multislice:region: us-central2\n"
        "  multislice:zone: us-central2-b\n  multislice:accelerator_type: v4-8\n"
        "  multislice:slices: 2\n  multislice:experiment_dir: experiments/missing\n")
    return path


def test_every_hosts_log_is_printed_prefixed_and_one_host_alone(gcs, stack, capsys):
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", b"=== boot ===\nstep 1 loss 2.5\nstep 2 loss 2.4\n")
    gcs.put(BUCKET, f"{LOGS}/vm-1.log", b"step 1 loss 2.6\n")
    gcs.put(BUCKET, f"{LOGS}/vm-1.startup.log", b"not the trainer's\n")
    assert cli(["logs", "--stack-config", str(stack)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[vm-0] === boot ===", "[vm-0] step 1 loss 2.5", "[vm-0] step 2 loss 2.4",
        "[vm-1] step 1 loss 2.6"]
    assert cli(["logs", "--stack-config", str(stack), "--host", "vm-1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["step 1 loss 2.6"]


def test_a_missing_host_or_attempt_is_one_line_naming_what_there_is(gcs, stack, capsys):
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", b"step 1\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "vm-9"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"multislice logs: no trainer log of vm-9 in gs://{BUCKET}/{LOGS}/ (hosts "
                    "with logs: vm-0)")
    gcs.put(BUCKET, f"{LOGS}/pod-0.attempt-0.log", b"a0\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "pod-0", "--attempt", "3"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "no attempt 3 in the logs of pod-0 (attempts kept: 0)" in line
    with pytest.raises(SystemExit) as usage:
        cli(["logs", "--stack-config", str(stack), "--attempt", "-1"])
    assert usage.value.code == 2
    assert "expected a whole number >= 0, got -1" in capsys.readouterr().err


def test_an_attempt_is_a_pods_kept_log_or_a_vms_restart(gcs, stack, capsys):
    gcs.put(BUCKET, f"{LOGS}/pod-0.attempt-0.log", b"first pod\nTraceback (most recent call "
            b"last):\nValueError: boom\n")
    gcs.put(BUCKET, f"{LOGS}/pod-0.log", b"second pod\n")
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", b"=== spec generation 1, code c t ===\nold run\n"
            b"=== spec generation 2, code c t ===\nstep 1\n=== restart 1 t ===\nstep 2\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "pod-0", "--attempt", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ValueError: boom"
    assert cli(["logs", "--stack-config", str(stack), "--host", "pod-0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["second pod"]
    assert cli(["logs", "--stack-config", str(stack), "--host", "vm-0", "--attempt", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["=== restart 1 t ===", "step 2"]


def test_an_attempt_of_two_jobset_objects_prints_both_named_by_their_run(gcs, stack, capsys):
    # a JobSet recreated (babysit) or replaced (a new run) counts its attempts from 0 again:
    # its pods name their kept logs by the object's UID, so neither overwrote the other
    gcs.put(BUCKET, f"{LOGS}/pod-0.run-1a2b3c4d.attempt-0.log", b"the first object\n")
    gcs.put(BUCKET, f"{LOGS}/pod-0.run-9f8e7d6c.attempt-0.log", b"the second object\n")
    gcs.put(BUCKET, f"{LOGS}/pod-0.run-9f8e7d6c.attempt-1.log", b"its restart\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "pod-0", "--attempt", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[pod-0 run 1a2b3c4d] the first object", "[pod-0 run 9f8e7d6c] the second object"]
    assert cli(["logs", "--stack-config", str(stack), "--host", "pod-0", "--attempt", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["its restart"]


def test_a_log_larger_than_a_read_is_printed_whole_in_bounded_pieces(gcs, stack, capsys,
                                                                       monkeypatch):
    import scripts.logs as logs

    monkeypatch.setattr(logs, "CHUNK_BYTES", 1000)  # lines straddle every read
    text = "".join(f"step {i} loss {i / 7:.6f}\n" for i in range(2000))
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", text.encode())
    assert cli(["logs", "--stack-config", str(stack)]) == 0
    assert capsys.readouterr().out == text


def test_follow_prints_what_is_appended_and_starts_over_on_a_new_pods_log(gcs, stack):
    from google.cloud import storage

    from infra.stack_config.validation import load_stack_file
    from scripts.logs import print_logs

    cfg = load_stack_file(stack, check_files=False)
    gcs.put(BUCKET, f"{LOGS}/pod-0.log", b"step 1\n")
    rounds = [b"step 1\nstep 2\npartial", b"new pod\n"]
    out: list[str] = []

    def next_round(_seconds: float) -> None:
        gcs.put(BUCKET, f"{LOGS}/pod-0.log", rounds.pop(0))

    code = print_logs(storage.Client(project="my-proj"), cfg, follow=True, interval_s=0,
                      write=out.append, sleep=next_round, stop=lambda: not rounds)
    assert code == 0
    assert out == ["step 1", "step 2", "[pod-0] (a new log: the pod was recreated)", "new pod"]


def test_status_links_the_stacks_hosts_in_cloud_logging():
    from infra.stack_config.schema import parse_stack
    from scripts.logs import logging_link

    vm = parse_stack({"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
                      "accelerator_type": "v4-8", "slices": 2, "experiment_dir": "e"}, "lg")
    query = urllib.parse.unquote(logging_link(vm).split("query=")[1].split("?")[0])
    assert query == 'resource.type="tpu_worker"\nresource.labels.node_id=("ms-lg-0" OR "ms-lg-1")'
    assert logging_link(vm).endswith("?project=my-proj")
    pods = parse_stack({"project": "my-proj", "region": "us-central1", "zone": "us-central1-a",
                        "accelerator_type": "v5litepod-16", "slices": 2, "experiment_dir": "e",
                        "orchestration": "gke", "gke": {
                            "kind": "workload", "namespace": "team-a",
                            "cluster": "projects/plat/locations/us-central1/clusters/c"}}, "lg")
    query = urllib.parse.unquote(logging_link(pods).split("query=")[1].split("?")[0])
    assert 'resource.labels.namespace_name="team-a"' in query
    assert 'labels."k8s-pod/jobset_sigs_k8s_io/jobset-name"="ms-lg"' in query
    assert logging_link(pods).endswith("?project=plat")


def test_a_vms_restart_that_is_not_in_its_log_is_one_line_and_exit_1(gcs, stack, capsys):
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", b"=== spec generation 2, code c t ===\nstep 1\n"
            b"=== restart 1 t ===\nstep 2\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "vm-0", "--attempt", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "multislice logs: no restart 4 in vm-0's log of its current spec (restarts in it: 0, 1)"]


def test_a_host_without_a_trainer_log_shows_its_start_up_log_and_says_so(gcs, stack, capsys):
    gcs.put(BUCKET, f"{LOGS}/vm-1.startup.log",
            b"multislice-startup: ERROR: step 3 (environment): no environment for the lock\n")
    assert cli(["logs", "--stack-config", str(stack), "--host", "vm-1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "multislice-startup: ERROR: step 3 (environment): no environment for the lock"]
    assert captured.err.splitlines() == [
        f"multislice logs: no trainer log of vm-1 in gs://{BUCKET}/{LOGS}/ yet; printing the "
        "start-up log of vm-1, where a boot error is"]


def test_a_line_of_any_length_is_printed_cut_in_bounded_memory(gcs, stack, capsys,
                                                               monkeypatch):
    import scripts.logs as logs

    monkeypatch.setattr(logs, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(logs, "MAX_LINE_BYTES", 100)
    splitter = logs._Lines()
    longest = 0
    for _ in range(50):  # 50 kB without a newline, in 1 kB pieces
        assert splitter.feed(b"x" * 1000) == []
        longest = max(longest, len(splitter.partial))
    assert longest == 100
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", b"a" * 5000 + b"\nstep 2\n" + b"b" * 250)
    assert cli(["logs", "--stack-config", str(stack)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "a" * 100 + " ...[4,900 bytes of this line cut]", "step 2",
        "b" * 100 + " ...[150 bytes of this line cut]"]


def test_host_written_control_characters_are_shown_never_obeyed(gcs, stack, capsys):
    # a compromised host's log: colours, a cursor move, a window title, OSC 52 (the clipboard)
    evil = b"step 1 \x1b[31mred\x1b[0m \x1b[2J\x1b]0;title\x07 \x1b]52;c;ZXZpbA==\x07 tab\tok\n"
    gcs.put(BUCKET, f"{LOGS}/vm-0.log", evil)
    assert cli(["logs", "--stack-config", str(stack)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert "\x1b" not in line and "\x07" not in line
    assert line == ("step 1 \\x1b[31mred\\x1b[0m \\x1b[2J\\x1b]0;title\\x07 "
                    "\\x1b]52;c;ZXZpbA==\\x07 tab\tok")
