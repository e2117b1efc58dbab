"""The production storage path, rehearsed: `multislice local --run-dir gs://...` against a real GCS
JSON API server (fake-gcs-server), reached only through STORAGE_EMULATOR_HOST and
TENSORSTORE_GCS_HTTP_URL, exactly as on a TPU VM the clients reach storage.googleapis.com.

A 2-slice run on gs:// is killed while a save is in flight, resumes from the bucket and ends with
the same parameters as an uninterrupted run on local disk; a corrupted newest checkpoint in the
bucket falls back to the previous one; processes racing to prepare the data set in the bucket
leave exactly one preparer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.emulators.gcs_emulator import GcsEmulator, serving_bucket
from scripts.local.attempt import Drill
from scripts.local.command import run_local
from tests.scripts.test_resume import assert_same_steps, attempts, holding_commits, one, step_rows
from tests.support.resume_runs import INTERVAL, SMALL, STEPS

# The worker that runs test_resume.py runs this module too (pytest -n: fixtures are per worker):
# the uninterrupted reference on local disk is the one tests/scripts/conftest.py makes for both.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

BUCKET = "ms-gcs-test"


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with serving_bucket(BUCKET) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def experiment(resume_experiment: Path) -> Path:
    return resume_experiment


def launch(experiment: Path, run_dir: str | Path, log_dir: Path, *, data_dir: str = "",
           kill_at: tuple[Drill, ...] = (), max_restarts: int = 0) -> int:
    values = (*SMALL, *([f"data.path={data_dir}"] if data_dir else []))
    sets = [arg for value in values for arg in ("--set", value)]
    return run_local(
        experiment=experiment, slices=2, devices_per_slice=2, run_dir=run_dir, log_dir=log_dir,
        trainer_args=["--config", "tiny", "--steps", str(STEPS), *sets], kill_at=kill_at,
        max_restarts=max_restarts, init_timeout_s=120, stall_timeout_s=240, stop_grace_s=2,
    )


def bucket_metrics(gcs: GcsEmulator, run: str) -> list[dict[str, Any]]:
    text = gcs.get(BUCKET, f"{run}/metrics.jsonl").decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def bucket_summary(gcs: GcsEmulator, run: str) -> dict[str, Any]:
    return json.loads(gcs.get(BUCKET, f"{run}/summary.json"))


@pytest.fixture(scope="module")
def reference(resume_reference: Path) -> Path:
    """Uninterrupted, on local disk (the same run test_resume.py compares against)."""
    return resume_reference


def local_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def drilled(gcs: GcsEmulator, experiment: Path, reference: Path,
            tmp_path_factory: pytest.TempPathFactory) -> str:
    """On gs://, slice 1 killed at step 10 while save 8 is held in flight; then resumed."""
    logs = tmp_path_factory.mktemp("drilled-logs")
    hold = tmp_path_factory.mktemp("hold")
    (hold / "commit-release-1").touch()  # save 1 (step 4) commits; save 2 (step 8) is held
    with holding_commits(experiment, hold, logs, '"event": "restart"'), \
            pytest.MonkeyPatch.context() as patch:
        patch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # the run's own, in the bucket
        code = launch(experiment, f"gs://{BUCKET}/runs/drilled", logs, max_restarts=2,
                      kill_at=(Drill(step=10, slice=1),))
    assert code == 0, (logs / "logs" / "slice-0.log").read_text()[-3000:]
    assert (hold / "commit-waiting-2").exists(), "save 2 never reached its commit"
    return "runs/drilled"


def test_killed_run_on_gcs_resumes_from_the_bucket_to_the_local_reference(
        gcs, drilled, reference):
    first, second = attempts(bucket_metrics(gcs, drilled))
    one(first, "fresh_start")
    # Save 8 was in flight when slice 1 died: it is never restored; step 4 is.
    assert one(second, "restore")["restored_step"] == INTERVAL
    want = step_rows(local_rows(reference))
    assert_same_steps(step_rows(second), want, range(INTERVAL + 1, STEPS + 1), exact=True)
    assert bucket_summary(gcs, drilled)["params_digest"] == \
        json.loads((reference / "summary.json").read_text())["params_digest"]
    names = gcs.list(BUCKET, f"{drilled}/")
    assert not [n for n in names if "orbax-checkpoint-tmp" in n or ".part-" in n]
    assert f"{drilled}/data/metadata.json" in names  # prepared in the bucket by the run itself
    assert any("/events.out.tfevents." in n for n in names), "no TensorBoard events in the bucket"
    assert any(n.startswith(f"{drilled}/compile_cache/") for n in names)


def test_a_corrupt_newest_checkpoint_in_the_bucket_falls_back_to_the_previous(
        gcs, drilled, reference, experiment, tmp_path):
    run = "runs/corrupt"
    for name in gcs.list(BUCKET, f"{drilled}/"):
        if not name.endswith("summary.json"):
            gcs.put(BUCKET, run + name[len(drilled):], gcs.get(BUCKET, name))
    state = [n for n in gcs.list(BUCKET, f"{run}/checkpoints/{STEPS}/state/") if "/d/" in n]
    victim = max(state, key=lambda n: len(gcs.get(BUCKET, n)))
    data = gcs.get(BUCKET, victim)
    gcs.put(BUCKET, victim, data[: len(data) // 3])

    assert launch(experiment, f"gs://{BUCKET}/{run}", tmp_path) == 0
    last = attempts(bucket_metrics(gcs, run))[-1]
    restore = one(last, "restore")
    assert (restore["restored_step"], restore["skipped_steps"]) == (STEPS - INTERVAL, [STEPS])
    assert_same_steps(step_rows(last), step_rows(local_rows(reference)),
                      range(STEPS - INTERVAL + 1, STEPS + 1), exact=True)
    assert bucket_summary(gcs, run)["params_digest"] == \
        json.loads((reference / "summary.json").read_text())["params_digest"]


RACE = """
import json, sys
from trainer.config import load_config
from trainer.dataset.loader import ensure_dataset
config = load_config("tiny", ["data.path=" + sys.argv[1], "data.prepare_wait_s=120",
                              "data.prepare_if_missing=true"])
info, prepared = ensure_dataset(config, "unused")
print(json.dumps({"prepared": prepared, "records": info.num_records}))
"""


def test_hosts_racing_to_prepare_data_in_the_bucket_leave_exactly_one_preparer(
        gcs, experiment, tmp_path):
    uri = f"gs://{BUCKET}/data/raced"
    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, uri], cwd=experiment, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / f"host{i}")})
        for i in range(4)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["prepared"] for r in results) == [False, False, False, True]
    assert len({r["records"] for r in results}) == 1
    names = gcs.list(BUCKET, "data/raced/")
    assert "data/raced/metadata.json" in names
    claim = json.loads(gcs.get(BUCKET, "data/raced/.prepare-claim"))
    assert {"host", "pid", "time"} <= set(claim)


READ = """
import json, sys
from trainer.config import load_config
from trainer.dataset.loader import ensure_dataset
from trainer.dataset.input_pipeline import DataError
config = load_config("tiny", ["data.path=" + sys.argv[1], "data.prepare_if_missing=false",
                              "model.seq_len=" + sys.argv[2]])
try:
    info, prepared = ensure_dataset(config, "unused")
except DataError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"prepared": prepared, "records": info.num_records, "dir": info.data_dir}))
"""


def read_dataset(experiment: Path, uri: str, seq_len: int, cache: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", READ, uri, str(seq_len)], cwd=experiment,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_data_error_names_the_data_set_in_the_bucket_not_this_hosts_copy(gcs, experiment,
                                                                          tmp_path):
    # The trainer reads a local copy of a gs:// data set (ArrayRecord reads local files); its
    # messages must name what the user configured.
    uri = f"gs://{BUCKET}/data/raced"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", "1", "--run-dir",
         f"gs://{BUCKET}/runs/eval-too-small", "--set", f"data.path={uri}",
         "--set", "eval.num_batches=100000"],
        cwd=experiment, capture_output=True, text=True, timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-2000:]
    assert last.startswith(f"error: the held-out split of {uri} has "), last


def test_bring_your_own_data_set_prepared_into_the_bucket_is_read_by_the_trainer(
        gcs, experiment, tmp_path, capsys):
    from scripts.cli import main as cli_main

    uri = f"gs://{BUCKET}/data/byo"
    args = ["data", "prepare", "--experiment", str(experiment), "--output", uri,
            "--seq-len", "32", "--num-sentences", "2000"]
    assert cli_main(args) == 0
    assert f"train on it with: --set data.path='{uri}'" in capsys.readouterr().err
    names = gcs.list(BUCKET, "data/byo/")
    assert "data/byo/metadata.json" in names and any(n.endswith(".array_record") for n in names)
    assert cli_main(args) == 2  # never overwritten
    assert "already holds a prepared data set" in capsys.readouterr().err

    got = read_dataset(experiment, uri, 32, tmp_path / "cache")
    assert got["prepared"] is False and got["records"] > 0
    assert got["dir"].startswith(str(tmp_path / "cache" / "trainer-data"))  # staged locally
    again = read_dataset(experiment, uri, 32, tmp_path / "cache")  # reuses the verified copy
    assert again == got

    # Bad input fails before training, naming what is wrong.
    assert "seq_len=32 tokens (+1 target), but the model expects seq_len=64" in \
        read_dataset(experiment, uri, 64, tmp_path / "c2")["error"]
    assert "data.path gs://ms-gcs-test/data/none does not exist" in \
        read_dataset(experiment, f"gs://{BUCKET}/data/none", 32, tmp_path / "c3")["error"]


def test_an_unreachable_bucket_fails_the_trainer_at_start_with_exit_2(gcs, experiment, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", "1",
         "--run-dir", "gs://no-such-bucket-here/runs/x"], cwd=experiment, capture_output=True,
        text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "gs://no-such-bucket-here/runs/x: bucket gs://no-such-bucket-here does not exist" in \
        result.stderr


@pytest.mark.parametrize(("deny_for_s", "retry_s"), [(6, 120), (3600, 5)],
                         ids=["grant-propagating", "never-granted"])
def test_a_bucket_that_refuses_the_trainer_is_retried_for_storage_retry_s(
        gcs, experiment, tmp_path, deny_for_s, retry_s):
    """A day-two update's new grant reaches GCS minutes after the trainers restart on it: a
    401/403 is retried for MULTISLICE_STORAGE_RETRY_S (the startup script passes the stack's
    storage_retry_s), a line per retry naming the bucket, then one line and exit 2."""
    from tests.support.iam_proxy import DenyingProxy

    with DenyingProxy(gcs.url, deny_for_s=deny_for_s, path_contains=f"/b/{BUCKET}",
                      from_first_request=True) as proxy:  # the trainer's start takes seconds
        env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url,
               "TENSORSTORE_GCS_HTTP_URL": proxy.url, "MULTISLICE_STORAGE_RETRY_S": str(retry_s)}
        result = subprocess.run(
            [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", "2",
             "--run-dir", f"gs://{BUCKET}/runs/refused-{deny_for_s}",
             *[arg for value in SMALL for arg in ("--set", value)]],
            cwd=experiment, capture_output=True, text=True, timeout=600, env=env)
    assert proxy.denied > 0
    retries = [line for line in result.stderr.splitlines()
               if line.startswith(f"storage: gs://{BUCKET} answered HTTP 403 (an IAM grant "
                                  "takes minutes to propagate); retry ")]
    assert retries and retries[0].endswith(f"retry 1 in 2s, for up to {retry_s}s"), \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    if deny_for_s < retry_s:
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"bucket gs://{BUCKET} refuses this host's credentials (HTTP 403) after " in last
    assert f"attempts in {retry_s}s (MULTISLICE_STORAGE_RETRY_S); grant the service account " \
        "read access to it" in last, last
    assert len(retries) <= 3, retries  # bounded, with backoff
