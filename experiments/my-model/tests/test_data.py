import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import xla_flags

from trainer.config import ResolvedMesh, load_config
from trainer.dataset.corpus import generate_corpus
from trainer.dataset.loader import TrainData, device_batch, ensure_dataset
from trainer.mesh import build_mesh
from trainer.sharding import logical_to_sharding


def test_corpus_is_deterministic_fast_and_ascii_text():
    generate_corpus.cache_clear()
    # CPU time, not wall time: a busy machine (a parallel test run) must not fail it; a generator
    # that turned into a slow Python loop still would (it takes ~0.2 s of CPU here).
    start = time.process_time()
    text = generate_corpus(seed=123)
    assert time.process_time() - start < 2.0
    assert 1_000_000 <= len(text) <= 4_000_000
    assert text == generate_corpus.__wrapped__(seed=123)
    assert text != generate_corpus.__wrapped__(seed=124)
    assert text.decode("ascii")[0].isupper() and text.count(b". ") > 1000


def test_benchmark_batches_are_the_same_global_array_on_any_mesh():
    config = load_config("tiny")
    single = build_mesh(ResolvedMesh(ici=(1, 1, 1), dcn=(1, 1, 1)), jax.devices()[:1])
    reference = np.asarray(device_batch(3, config, logical_to_sharding(("batch", None), single)))
    assert reference.shape == (16, 65) and reference.dtype == np.int32
    for ici in [(8, 1, 1), (2, 2, 2), (1, 1, 8)]:
        mesh = build_mesh(ResolvedMesh(ici=ici, dcn=(1, 1, 1)))
        sharding = logical_to_sharding(("batch", None), mesh)
        array = device_batch(3, config, sharding)
        np.testing.assert_array_equal(np.asarray(array), reference)
        assert array.sharding == sharding
    other = np.asarray(device_batch(4, config, logical_to_sharding(("batch", None), single)))
    assert not np.array_equal(other, reference)


def _loop_data(tmp_path, ici):
    config = load_config("tiny", [f"data.path={tmp_path / 'data'}",
                                  "data.prepare_if_missing=true"])
    info, _ = ensure_dataset(config, str(tmp_path / "run"))
    mesh = build_mesh(ResolvedMesh(ici=ici, dcn=(1, 1, 1)))
    return TrainData(info, config, logical_to_sharding(("batch", None), mesh))


def test_loop_batches_and_their_digest_do_not_depend_on_the_mesh(tmp_path):
    reference = _loop_data(tmp_path, (1, 1, 8))
    first = [reference.next_batch() for _ in range(3)]
    digests = [int(reference.digest(b)) for b in first]
    assert len(set(digests)) == 3
    other = _loop_data(tmp_path, (4, 2, 1))
    for batch, digest in zip(first, digests, strict=True):
        again = other.next_batch()
        np.testing.assert_array_equal(np.asarray(again), np.asarray(batch))
        assert int(other.digest(again)) == digest
    # A single changed token changes the digest.
    changed = np.asarray(first[0]).copy()
    changed[5, 7] ^= 1
    assert int(reference.digest(jax.numpy.asarray(changed))) != digests[0]


def test_default_data_dir_is_prepared_once_inside_the_run_dir(tmp_path):
    config = load_config("tiny")
    info, prepared = ensure_dataset(config, str(tmp_path))
    assert prepared and info.data_dir == str(tmp_path / "data") and info.seq_len == 64
    again, prepared_again = ensure_dataset(config, str(tmp_path))
    assert not prepared_again and again.num_records == info.num_records
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


ROOT = Path(__file__).resolve().parents[1]


def _train(run_dir: Path, processes: int, devices: int, mesh: list[str]) -> list[dict]:
    """`trainer.main` for 4 steps as `processes` emulated slices; returns the step rows."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for pid in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(devices))
        if processes > 1:
            env.update(MULTISLICE_COORDINATOR=f"127.0.0.1:{port}",
                       MULTISLICE_NUM_PROCESSES=str(processes), MULTISLICE_PROCESS_ID=str(pid),
                       MULTISLICE_INIT_TIMEOUT_S="60")
        args = ["--config", "tiny", "--steps", "4", "--run-dir", str(run_dir),
                "--set", "metrics.log_every=1"] + [a for m in mesh for a in ("--set", m)]
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, out[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "step"]


@pytest.mark.slow
def test_data_in_slices_with_fsdp_across_them_reads_the_single_process_batches(tmp_path):
    # ici_data=2 x dcn_fsdp=2: each slice holds two separate blocks of every global batch.
    two = _train(tmp_path / "two", 2, 2, ["mesh.ici_data=2", "mesh.ici_fsdp=1",
                                          "mesh.dcn_data=1", "mesh.dcn_fsdp=2"])
    one = _train(tmp_path / "one", 1, 4, ["mesh.ici_data=2", "mesh.ici_fsdp=2"])
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [r["batch_digest"] for r in two] == [r["batch_digest"] for r in one]
    assert len({r["batch_digest"] for r in one}) == 4
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
