import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from infra.boot import launch
from infra.packaging.archive import build_archive
from infra.stack_config import manifest
from infra.stack_config.schema import parse_stack
from tests.infra.conftest import base_config


def test_archive_is_deterministic_across_mtimes_and_named_by_hash(project_root):
    exp = project_root / "experiments" / "demo"
    first = build_archive(exp)
    os.utime(exp / "trainer" / "main.py", (1, 1))
    second = build_archive(exp)
    assert first.data == second.data
    assert first.sha256 == hashlib.sha256(gzip.decompress(first.data)).hexdigest()
    assert first.object_name == f"code/{first.sha256}.tar.gz"
    (exp / "trainer" / "main.py").write_text("print('changed')\n")
    assert build_archive(exp).sha256 != first.sha256


def test_the_archive_name_is_the_trees_hash_whatever_zlib_compressed_it(project_root, tmp_path):
    # zlib and zlib-ng (a laptop's Python and CI's) give different gzip bytes for one tree; the
    # name, and so the launch spec, must not change, and the VM's check must accept both.
    from infra.boot.launch import archive_sha256

    exp = project_root / "experiments" / "demo"
    fast = build_archive(exp, compress=lambda data: gzip.compress(data, compresslevel=1, mtime=0))
    best = build_archive(exp, compress=lambda data: gzip.compress(data, compresslevel=9, mtime=0))
    assert fast.data != best.data
    assert fast.sha256 == best.sha256 == build_archive(exp).sha256
    assert fast.object_name == best.object_name
    for name, archive in (("fast", fast), ("best", best)):
        path = tmp_path / f"{name}.tar.gz"
        path.write_bytes(archive.data)
        assert archive_sha256(str(path)) == archive.sha256


def test_the_vms_archive_check_refuses_a_truncated_download_in_one_line(project_root, tmp_path):
    from infra.boot.launch import LaunchSpecError, archive_sha256

    data = build_archive(project_root / "experiments" / "demo").data
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(LaunchSpecError, match=r"cut.tar.gz is not a whole gzip file"):
        archive_sha256(str(path))


def test_archive_excludes_venvs_caches_and_runs_and_zeroes_owners(project_root):
    exp = project_root / "experiments" / "demo"
    for junk in (
        ".venv/bin/python",
        "trainer/__pycache__/main.cpython-311.pyc",
        "runs/r1/x",
        ".git/HEAD",
    ):
        (exp / junk).parent.mkdir(parents=True, exist_ok=True)
        (exp / junk).write_text("junk")
    with tarfile.open(fileobj=io.BytesIO(build_archive(exp).data)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert set(names) == {
        "configs",
        "configs/base.toml",
        "configs/default.toml",
        "configs/tiny.toml",
        "pyproject.toml",
        "requirements-tpu.lock",  # what the VMs install
        "trainer",
        "trainer/__init__.py",
        "trainer/config.py",
        "trainer/main.py",
        "trainer/model",
        "trainer/model/__init__.py",
        "trainer/model/rope.py",
        "trainer/runtime",
        "trainer/runtime/__init__.py",
        "trainer/runtime/storage.py",
    }
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members)


def test_multisliceignore_leaves_weights_and_checkpoints_out_and_large_files_are_named(
        project_root):
    from infra.packaging.archive import LARGE_FILE_BYTES, large_files
    from infra.packaging.experiment import _archive_warnings

    exp = project_root / "experiments" / "demo"
    template = Path(__file__).resolve().parents[2] / "template" / "{{cookiecutter.project_slug}}"
    (exp / ".multisliceignore").write_text((template / ".multisliceignore").read_text())
    for path, size in (("weights/my-llama/params/x", 10), ("hf-tiny/model.safetensors", 10),
                       ("trainer/extra.safetensors", 10), ("notes/data/big.bin", 10),
                       ("blob.bin", LARGE_FILE_BYTES + 1), ("trainer/dataset/loader.py", 10)):
        (exp / path).parent.mkdir(parents=True, exist_ok=True)
        (exp / path).write_bytes(b"x" * size)
    with tarfile.open(fileobj=io.BytesIO(build_archive(exp).data)) as tar:
        names = set(tar.getnames())
    assert not any(n.startswith(("weights", "hf-tiny", "notes/data")) for n in names), names
    assert "trainer/extra.safetensors" not in names
    assert {"trainer/dataset/loader.py", "blob.bin", ".multisliceignore", "notes"} <= names
    assert large_files(exp) == [("blob.bin", LARGE_FILE_BYTES + 1)]
    [warning] = _archive_warnings(exp)
    assert "blob.bin (10 MiB) goes into the code archive" in warning
    assert ".multisliceignore" in warning


def _spec(**trainer):
    raw = base_config(slices=2, trainer={"config": "tiny", "steps": 50, **trainer})
    return manifest.launch_spec(parse_stack(raw, "exp"), "a" * 64)


def test_launch_argv_follows_the_trainer_contract():
    spec = _spec(seed=3, overrides={"optim.learning_rate": 0.0003, "data.name": "bytes"})
    argv = launch.trainer_argv(spec)
    assert argv[:6] == [
        "--config",
        "tiny",
        "--steps",
        "50",
        "--run-dir",
        "gs://my-proj-ms-exp/runs/exp",
    ]
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert pairs == [
        "mesh.ici_data=1",
        "mesh.ici_fsdp=4",
        "mesh.ici_tensor=1",
        "mesh.dcn_data=2",
        "mesh.dcn_fsdp=1",
        "mesh.dcn_tensor=1",
        'data.name="bytes"',
        "optim.learning_rate=0.0003",
    ]
    assert argv[argv.index("--seed") + 1] == "3"
    assert argv[-4:] == ["--expect-slices", "2", "--expect-devices-per-slice", "4"]


def test_gcs_object_names_are_percent_encoded_for_the_json_api(capsys):
    assert launch.main(["gcs-object", "gs://b/runs/x/logs/w 0.log"]) == 0
    assert capsys.readouterr().out == "b runs%2Fx%2Flogs%2Fw%200.log\n"
    assert launch.main(["gcs-object", "gs://b"]) == 1
    assert "'gs://b' is not a gs://BUCKET/OBJECT URI" in capsys.readouterr().err


def test_json_field_reads_the_metadata_token(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"access_token": "ya29.x", "expires_in": 5}'))
    assert launch.main(["json-field", "access_token"]) == 0
    assert capsys.readouterr().out == "ya29.x"
    monkeypatch.setattr("sys.stdin", io.StringIO("<html>"))
    assert launch.main(["json-field", "access_token"]) == 1


def test_the_spec_carries_what_the_vm_needs_from_the_stack():
    spec = _spec(init_timeout_s=120, max_restarts=3)
    assert (spec["init_timeout_s"], spec["max_restarts"]) == (120, 3)
    assert spec["envs_uri"] == "gs://my-proj-ms-exp/envs"
    assert spec["lock_file"] == "requirements-tpu.lock"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("run_dir"), "launch spec lacks run_dir"),
        (lambda s: s.update(version=9), "version 9 is not supported"),
        (lambda s: s.update(archive_sha256="xyz"), "'xyz' is not a hex sha256"),
        (lambda s: s.update(archive_uri="gs://b/code/other.tar.gz"), "does not name the archive"),
        (lambda s: s.update(run_dir="/tmp/run"), "run_dir '/tmp/run' is not a gs://BUCKET/PATH"),
        (lambda s: s.update(max_restarts=-1), "max_restarts -1 is not a non-negative integer"),
        (lambda s: s.pop("envs_uri"), "launch spec lacks envs_uri"),
        (lambda s: s.update(spec_poll_s="60"), "spec_poll_s '60' is not a non-negative integer"),
        (lambda s: s.update(trainer=[]), "trainer [] is not an object"),
        (lambda s: s.update(version=2), "version 2 is not supported"),  # the inline spec's
    ],
)
def test_launch_check_names_what_is_wrong(tmp_path, capsys, mutate, message):
    spec = _spec()
    mutate(spec)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert launch.main(["check", str(path)]) == 1
    assert message in capsys.readouterr().err


OWN = "gs://my-proj-ms-exp/launch/exp.json"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(archive_uri=f"gs://evil/code/{s['archive_sha256']}.tar.gz"),
         "archive_uri 'gs://evil/code/"),
        (lambda s: s.update(archive_uri=f"gs://my-proj-ms-exp/runs/exp/{s['archive_sha256']}"
                                        ".tar.gz"), "is not 'gs://my-proj-ms-exp/code/"),
        (lambda s: s.update(envs_uri="gs://evil/envs"), "envs_uri 'gs://evil/envs' is not"),
        (lambda s: s.update(envs_uri="gs://my-proj-ms-exp/runs/exp"), "envs_uri"),
        (lambda s: s.update(run_dir="gs://evil/runs/exp", logs_uri="gs://evil/runs/exp/logs"),
         "run_dir 'gs://evil/runs/exp' is not a gs://my-proj-ms-exp/runs/NAME directory"),
        (lambda s: s.update(run_dir="gs://my-proj-ms-exp/code", logs_uri="gs://my-proj-ms-exp/code/logs"),
         "is not a gs://my-proj-ms-exp/runs/NAME"),
        (lambda s: s.update(logs_uri="gs://evil/logs"), "logs_uri 'gs://evil/logs' is not"),
        (lambda s: s.update(env_sha256="abc"), "env_sha256 'abc' is not a hex sha256"),
    ],
)
def test_a_spec_naming_objects_outside_its_own_bucket_is_refused(tmp_path, capsys, mutate,
                                                                  message):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(_spec()))
    assert launch.main(["check", str(path), OWN]) == 0, capsys.readouterr().err
    assert launch.main(["check", str(path), "gs://other/launch/exp.json"]) == 1
    assert "is not 'gs://other/code/" in capsys.readouterr().err
    spec = _spec()
    mutate(spec)
    path.write_text(json.dumps(spec))
    assert launch.main(["check", str(path), OWN]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_launch_argv_command_is_nul_separated(tmp_path, capsys):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(_spec()))
    assert launch.main(["argv", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\0") and out.split("\0")[:-1] == launch.trainer_argv(_spec())


def test_launch_fields_are_nul_terminated_in_the_order_asked(tmp_path, capsys):
    path = tmp_path / "spec.json"
    spec = _spec(max_restarts=3)
    path.write_text(json.dumps(spec))
    assert launch.main(["fields", str(path), "max_restarts", "run_as", "lock_file"]) == 0
    assert capsys.readouterr().out == f"3\0{spec['run_as']}\0requirements-tpu.lock\0"
    assert launch.main(["fields", str(path), "max_restarts", "trainer"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no scalar key 'trainer'" in captured.err


def test_the_spec_has_no_provider_only_settings_and_names_its_run():
    raw = base_config(slices=2, run_name="wide", spec_poll_s=30, wait_for_active_s=99)
    spec = manifest.launch_spec(parse_stack(raw, "exp"), "a" * 64)
    assert spec["run_dir"] == "gs://my-proj-ms-exp/runs/exp-wide" and spec["spec_poll_s"] == 30
    assert "99" not in json.dumps(spec) and "wait_for_active_s" not in json.dumps(spec)


def test_launch_changes_names_every_changed_field_old_and_new(tmp_path, capsys):
    old, new = _spec(), _spec(steps=80, overrides={"model.d_model": 96})
    new["archive_sha256"] = "b" * 64
    new["archive_uri"] = new["archive_uri"].replace("a" * 64, "b" * 64)
    paths = []
    for name, spec in (("old", old), ("new", new)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(spec))
    assert launch.main(["changes", *map(str, paths)]) == 0
    assert capsys.readouterr().out == (f"archive_sha256 {'a' * 12} -> {'b' * 12}, "
                                       "trainer.overrides.model.d_model (none) -> 96, "
                                       "trainer.steps 50 -> 80")


def _beat(slice_index: int, worker: int, seconds: float, address: str = "10.0.0.9") -> dict:
    whole, frac = divmod(seconds, 1)
    stamp = f"2026-12-08T00:00:{int(whole):02d}.{round(frac * 1e9):09d}Z"  # GCS gives ns too
    return {"name": f"runs/x/logs/alive/s{slice_index}-w{worker}@{address}", "updated": stamp}


def test_the_live_slices_are_those_whose_every_host_beat_recently_by_the_buckets_clock(tmp_path,
                                                                                      capsys):
    listing = {"items": [
        _beat(0, 0, 50.0, "10.0.0.2"), _beat(0, 1, 49.5),
        _beat(1, 0, 30.0, "10.0.0.4"), _beat(1, 1, 48.0, "10.0.0.5"),  # worker 0 is gone
        _beat(1, 0, 12.0, "10.0.0.3"),  # an older VM's address of that place: ignored
        _beat(2, 0, 45.0, "10.0.0.6"), _beat(2, 1, 44.9),
        {"name": "runs/x/logs/alive/junk", "updated": "2026-12-08T00:00:50Z"},
    ]}
    path = tmp_path / "listing.json"
    path.write_text(json.dumps(listing))
    # Within 6 s of the newest beat of this host's slice (50.0): slices 0 and 2.
    assert launch.main(["elastic-live", str(path), "2", "3", "2", "6"]) == 0
    assert capsys.readouterr().out == "0,2 10.0.0.2\n"
    # Seen from slice 2's clock at 45: slice 0 is not ahead of it by more than the window.
    assert launch.elastic_live(listing, 2, 3, 2, 6.0) == ([0, 2], "10.0.0.2")
    # Slice 0 gone: the coordinator is the first live slice's worker 0.
    later = {"items": [_beat(0, 0, 20.0), _beat(0, 1, 20.0), *listing["items"][2:]]}
    assert launch.elastic_live(later, 2, 3, 2, 6.0) == ([2], "10.0.0.6")
    # This host's own slice has no beat: an error, never "nothing is up".
    path.write_text(json.dumps({"items": []}))
    assert launch.main(["elastic-live", str(path), "0", "3", "1", "6"]) == 1
    assert "no heartbeat of this host's slice 0" in capsys.readouterr().err
