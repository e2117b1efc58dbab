"""Checkpoints: exact resume, incomplete and corrupt steps, resharding, a kill mid-save."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags

from trainer.dataset import input_pipeline as dp
from trainer.dataset.prepare import write_shards
from trainer.runtime import checkpoint as ck
from trainer.runtime.compilation_cache import COMPILE_CACHE_SUBDIR

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 7
BATCH = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    records = (np.arange(30 * (SEQ_LEN + 1)).reshape(30, SEQ_LEN + 1) % 251).astype(np.uint8)
    write_shards(records, out, num_shards=2, sources=["test"])
    return out


def _iterator(data_dir: Path) -> dp.DataIterator:
    info = dp.open_dataset(data_dir, seq_len=SEQ_LEN)
    return dp.make_iterator(info, global_batch_size=BATCH, seed=3, row_start=0, row_stop=BATCH)


def _state(step: int) -> dict:
    return {"params": {"w": jnp.arange(12.0).reshape(3, 4) + step, "b": jnp.full((4,), step)},
            "opt_count": jnp.asarray(step, jnp.int32)}


def _abstract() -> dict:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        _state(0))


def _assert_state_is(state: dict, step: int) -> None:
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(_state(step)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _save_steps(run_dir: Path, data_dir: Path, steps: list[int], **options) -> None:
    it = _iterator(data_dir)
    mgr = ck.Checkpointer(run_dir, save_interval_steps=1, max_to_keep=None, **options)
    for step in steps:
        while it.next_global_batch < step:
            next(it)
        assert mgr.save(step, _state(step), it, jax.random.key(step), force=True).saved
    mgr.close()


def test_restore_returns_state_rng_step_and_positions_the_data(tmp_path, data_dir):
    it = _iterator(data_dir)
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=3)
    for _ in range(3):
        next(it)
    rng = jax.random.key(11)
    info = mgr.save(3, _state(3), it, rng)
    expected_next = [next(it) for _ in range(2)]
    mgr.close()
    assert info.saved and info.blocking_s > 0

    fresh = _iterator(data_dir)
    restored = ck.Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=3).restore_latest(
        _abstract(), fresh)
    assert restored.step == 3 and restored.skipped_steps == ()
    _assert_state_is(restored.state, 3)
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(rng))
    for want in expected_next:
        np.testing.assert_array_equal(next(fresh), want)


def test_data_state_written_by_another_process_count_is_restored(tmp_path, data_dir):
    it = _iterator(data_dir)
    for _ in range(4):
        next(it)
    state = json.dumps(it.get_state())
    for p in range(2):  # as a two-process run would have written it
        (tmp_path / f"process_{p}-of-2.json").write_text(state)
    expected = next(it)

    fresh = _iterator(data_dir)
    ck.DataIteratorHandler().restore(tmp_path, ck.DataIteratorRestore(fresh))
    assert fresh.next_global_batch == 4
    np.testing.assert_array_equal(next(fresh), expected)


def test_raw_uint32_rng_keys_round_trip():
    key = jax.random.PRNGKey(5)
    back = ck.rng_from_json(json.loads(json.dumps(ck.rng_to_json(key))))
    assert back.dtype == jnp.uint32
    np.testing.assert_array_equal(back, key)


def test_no_checkpoint_means_fresh_start(tmp_path, data_dir, caplog):
    caplog.set_level(logging.INFO, logger="trainer.runtime.checkpoint")
    mgr = ck.Checkpointer(tmp_path / "run", save_interval_steps=1, max_to_keep=1)
    assert mgr.restore_latest(_abstract(), _iterator(data_dir)) is None
    assert "starting fresh" in caplog.text


def test_interval_and_max_to_keep_decide_what_stays(tmp_path, data_dir):
    it = _iterator(data_dir)
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=3, max_to_keep=2)
    results = {step: mgr.save(step, _state(step), it, jax.random.key(0)) for step in range(1, 11)}
    final = mgr.save(10, _state(10), it, jax.random.key(0), force=True)
    mgr.close()
    assert [s for s, r in results.items() if r.saved] == [1, 3, 6, 9]  # Orbax also saves the first
    assert all(r.blocking_s == 0.0 for r in results.values() if not r.saved)
    assert final.saved
    assert mgr.all_steps() == [9, 10]


def test_orbax_never_asks_the_preemption_sync_point_the_loop_asks_it(tmp_path, data_dir,
                                                                      monkeypatch):
    # JAX's sync-point protocol takes each process's last asked step as its position: a second
    # caller (Orbax's save, should_save and finalize thread, with the step being saved) can
    # move it, and a process then trains past the step the others stopped at.
    from jax.experimental import multihost_utils

    asked: list[int] = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: asked.append(step) or True)
    it = _iterator(data_dir)
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=2, max_to_keep=2)
    saved = [mgr.save(step, _state(step), it, jax.random.key(0)).saved for step in range(1, 5)]
    mgr.save(5, _state(5), it, jax.random.key(0), force=True)
    mgr.close()
    assert asked == []
    assert saved == [True, True, False, True]  # the interval alone (and Orbax's first step)


def test_forced_save_of_an_existing_step_is_a_no_op(tmp_path, data_dir):
    it = _iterator(data_dir)
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=5, max_to_keep=2)
    assert mgr.save(5, _state(5), it, jax.random.key(0)).saved
    assert not mgr.save(5, _state(5), it, jax.random.key(0), force=True).saved
    mgr.close()


def test_half_written_step_directory_is_ignored_and_cleaned(tmp_path, data_dir):
    _save_steps(tmp_path, data_dir, [1, 2])
    partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "manifest.ocdbt").write_bytes(b"\x00" * 10)

    mgr = ck.Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None)
    assert mgr.all_steps() == [1, 2]
    restored = mgr.restore_latest(_abstract(), _iterator(data_dir))
    assert restored.step == 2
    _assert_state_is(restored.state, 2)
    assert not partial.exists()


def _truncate_arrays(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no array data files under {step_dir}"
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, data_dir, caplog):
    _save_steps(tmp_path, data_dir, [1, 2])
    _truncate_arrays(tmp_path / "checkpoints" / "2")

    it = _iterator(data_dir)
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None)
    with caplog.at_level(logging.WARNING, logger="trainer.runtime.checkpoint"):
        restored = mgr.restore_latest(_abstract(), it)
    assert restored.step == 1 and restored.skipped_steps == (2,)
    _assert_state_is(restored.state, 1)
    assert it.next_global_batch == 1
    assert "checkpoint step 2" in caplog.text and "falling back to step 1" in caplog.text
    # The unreadable step is gone, so training can save step 2 again.
    assert mgr.save(2, _state(2), it, jax.random.key(2)).saved
    mgr.close()
    assert mgr.all_steps() == [1, 2]


def test_all_checkpoints_unreadable_is_an_error_naming_them(tmp_path, data_dir):
    _save_steps(tmp_path, data_dir, [4])
    _truncate_arrays(tmp_path / "checkpoints" / "4")
    mgr = ck.Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None)
    with pytest.raises(ck.CheckpointError, match=r"none of the checkpoints \[4\]"):
        mgr.restore_latest(_abstract(), _iterator(data_dir))


def held_commits(hold: Path) -> dict[str, str]:
    """Environment of a child whose checkpoint commits wait for the test (tests/hooks/)."""
    return {"TRAINER_TEST_HOLD_COMMIT": str(hold),
            "PYTHONPATH": f"{ROOT / 'tests' / 'hooks'}{os.pathsep}{ROOT}"}


def _env(devices: int, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(devices))
    env.update(extra)
    return env


_RESHARD_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trainer.dataset import input_pipeline as dp
from trainer.runtime import checkpoint as ck

run_dir, data_dir, mode = sys.argv[1:]
info = dp.open_dataset(data_dir)
it = dp.make_iterator(info, global_batch_size=4, seed=3, row_start=0, row_stop=4)
mgr = ck.Checkpointer(run_dir, save_interval_steps=1, max_to_keep=2)
assert jax.device_count() == (4 if mode == "save" else 2), jax.devices()
if mode == "save":
    mesh = Mesh(np.array(jax.devices()), ("x",))
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x", None)))
    b = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    next(it); next(it)
    mgr.save(2, {"w": w, "b": b}, it, jax.random.key(9), force=True)
    mgr.close()
else:
    mesh = Mesh(np.array(jax.devices()), ("y",))
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                        sharding=NamedSharding(mesh, P(None, "y"))),
              "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    r = mgr.restore_latest(target, it)
    w = r.state["w"]
    print(json.dumps({"step": r.step, "w": np.asarray(w).tolist(), "spec": list(w.sharding.spec),
                      "shards": sorted(s.data.shape for s in w.addressable_shards),
                      "next": it.next_global_batch,
                      "rng": np.asarray(jax.random.key_data(r.rng)).tolist()}))
"""


@pytest.mark.slow
def test_restore_reshards_onto_a_different_mesh(tmp_path, data_dir):
    def run(devices: int, mode: str) -> str:
        proc = subprocess.run([sys.executable, "-c", _RESHARD_SCRIPT, str(tmp_path),
                               str(data_dir), mode], env=_env(devices), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    run(4, "save")
    out = json.loads(run(2, "restore").strip().splitlines()[-1])
    assert out["step"] == 2 and out["next"] == 2
    assert out["w"] == np.arange(32.0).reshape(8, 4).tolist()
    assert out["spec"] == [None, "y"]
    assert out["shards"] == [[8, 2], [8, 2]]
    assert out["rng"] == np.asarray(jax.random.key_data(jax.random.key(9))).tolist()


_KILL_SCRIPT = """
import sys, time
import jax, jax.numpy as jnp
from trainer.dataset import input_pipeline as dp
from trainer.runtime import checkpoint as ck

run_dir, data_dir = sys.argv[1:]
it = dp.make_iterator(dp.open_dataset(data_dir), global_batch_size=4, seed=3, row_start=0,
                      row_stop=4)
mgr = ck.Checkpointer(run_dir, save_interval_steps=1, max_to_keep=None)
for step in (1, 2):
    next(it)
    state = {"params": {"w": jnp.arange(12.0).reshape(3, 4) + step, "b": jnp.full((4,), step)},
             "opt_count": jnp.asarray(step, jnp.int32)}
    mgr.save(step, state, it, jax.random.key(step))
time.sleep(600)  # killed by the test while save 2 is in flight
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {path} appeared: "
                                 f"{proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.02)


@pytest.mark.slow
def test_kill_during_async_save_keeps_the_previous_checkpoint(tmp_path, data_dir):
    hold = tmp_path / "hold"
    hold.mkdir()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(run_dir), str(data_dir)],
                            env=_env(1, **held_commits(hold)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(hold / "commit-waiting-1", proc)
        (hold / "commit-release-1").touch()
        _wait_for(hold / "commit-waiting-2", proc)  # save 2 is now in flight
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()

    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir()
                 if ".orbax-checkpoint-tmp" in p.name]
    assert [name.split(".")[0] for name in leftovers] == ["2"], leftovers

    mgr = ck.Checkpointer(run_dir, save_interval_steps=1, max_to_keep=None)
    assert mgr.all_steps() == [1]
    it = _iterator(data_dir)
    restored = mgr.restore_latest(_abstract(), it)
    assert restored.step == 1 and it.next_global_batch == 1
    _assert_state_is(restored.state, 1)
    next(it)
    assert mgr.save(2, _state(2), it, jax.random.key(2)).saved
    mgr.close()
    assert mgr.all_steps() == [1, 2]


_CACHE_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from trainer.runtime.compilation_cache import enable_compilation_cache
print(enable_compilation_cache(sys.argv[1]))
jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()
"""


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["run-dir", "shared"])
def test_compilation_cache_stores_even_small_programs_in_the_run_dir(tmp_path, shared):
    # JAX_COMPILATION_CACHE_DIR (this suite's conftest sets one) replaces RUN_DIR/compile_cache.
    env = {k: v for k, v in _env(1).items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if shared:
        env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "team-cache")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cache = tmp_path / "team-cache" if shared else run_dir / COMPILE_CACHE_SUBDIR
    assert proc.stdout.strip() == str(cache)
    assert any(cache.iterdir()), "no cache entry written"
    assert shared != (run_dir / COMPILE_CACHE_SUBDIR).exists()


def test_two_tier_cache_reads_near_first_and_keeps_what_it_fetched_from_far():
    from trainer.runtime.compilation_cache import TwoTierCache

    class Tier(dict):
        def get(self, key):
            return dict.get(self, key)

        def put(self, key, value):
            self[key] = value

    near, far = Tier(), Tier(a=b"from-far")
    cache = TwoTierCache(near, far)
    assert cache.get("a") == b"from-far" and near == {"a": b"from-far"}
    far["a"] = b"changed"
    assert cache.get("a") == b"from-far"  # near first
    cache.put("b", b"new")
    assert near["b"] == far["b"] == b"new"
    assert cache.get("missing") is None and "missing" not in near


def test_a_local_tier_that_cannot_be_made_is_skipped_with_a_warning(tmp_path, caplog):
    from jax.experimental.compilation_cache import compilation_cache

    from trainer.runtime.compilation_cache import add_local_tier, enable_compilation_cache

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    previous = jax.config.jax_compilation_cache_dir
    enable_compilation_cache(tmp_path / "run")
    compilation_cache.reset_cache()
    try:
        with caplog.at_level("WARNING"):
            assert add_local_tier({"MULTISLICE_LOCAL_COMPILE_CACHE": str(blocker / "cache")}) \
                is None
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        compilation_cache.reset_cache()
    assert "MULTISLICE_LOCAL_COMPILE_CACHE=" in caplog.text and "cannot be made" in caplog.text


_TIER_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache
from trainer.runtime.compilation_cache import add_local_tier, enable_compilation_cache
enable_compilation_cache(sys.argv[1])
compilation_cache.reset_cache()
print(add_local_tier())
print(jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).tolist())
"""


@pytest.mark.slow
def test_a_local_tier_is_filled_from_the_run_cache_and_a_corrupt_local_entry_recompiles(tmp_path):
    env = {k: v for k, v in _env(1).items() if k != "JAX_COMPILATION_CACHE_DIR"}
    local = tmp_path / "node-cache"
    env["MULTISLICE_LOCAL_COMPILE_CACHE"] = str(local)
    run_dir = tmp_path / "run"

    def run() -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _TIER_SCRIPT, str(run_dir)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split("\n")[:2]

    assert run() == [str(local), "[1.0, 3.0, 5.0]"]
    far = {p.name for p in (run_dir / COMPILE_CACHE_SUBDIR).iterdir()}
    assert far and {p.name for p in local.iterdir()} == far  # written to both tiers
    shutil.rmtree(local)  # a new node: the run's cache fills it again
    assert run()[1] == "[1.0, 3.0, 5.0]"
    assert {p.name for p in local.iterdir()} == far
    for entry in local.iterdir():  # a corrupt node cache: recompiled, never a wrong program
        if entry.is_file():
            entry.write_bytes(b"garbage")
    assert run()[1] == "[1.0, 3.0, 5.0]"


def _launch_two_processes(args: list[str]) -> list[tuple[int, str]]:
    """Runs `python -m trainer.main ARGS` as two emulated slices of two CPU devices each."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
        env=_env(2, MULTISLICE_COORDINATOR=f"127.0.0.1:{port}", MULTISLICE_NUM_PROCESSES="2",
                 MULTISLICE_PROCESS_ID=str(pid), MULTISLICE_INIT_TIMEOUT_S="60"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            outputs.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


@pytest.mark.slow
def test_a_checkpoint_unreadable_on_one_process_makes_both_fall_back_to_the_same_step(tmp_path):
    common = ["--config", "tiny", "--run-dir", str(tmp_path), "--set", "mesh.dcn_data=2",
              "--set", "checkpoint.save_interval_steps=2", "--set", "metrics.log_every=1"]
    for code, out in _launch_two_processes([*common, "--steps", "4"]):
        assert code == 0, out[-3000:]
    # Only process 1 reads this file, so only process 1 fails to restore step 4.
    own_state = tmp_path / "checkpoints" / "4" / "data" / "process_1-of-2.json"
    own_state.write_text(own_state.read_text()[:10])

    outputs = _launch_two_processes([*common, "--steps", "6"])
    for code, out in outputs:
        assert code == 0, out[-3000:]
        assert "checkpoint step 4" in out and "falling back to step 2" in out, out[-3000:]
    assert "JSONDecodeError" in outputs[1][1] and "JSONDecodeError" not in outputs[0][1]
    digests = [re.search(r"params_digest (\w+)", out).group(1) for _, out in outputs]
    assert digests[0] == digests[1]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    restores = [r for r in rows if r["event"] == "restore"]
    assert [(r["restored_step"], r["skipped_steps"]) for r in restores] == [(2, [4])]
    steps_after = [r["step"] for r in rows[rows.index(restores[0]):] if r["event"] == "step"]
    assert steps_after == [3, 4, 5, 6]
    assert (tmp_path / "checkpoints" / "6").is_dir()
    assert json.loads(own_state.read_text())["next_global_batch"] == 4  # step 4 saved anew
