"""SIGTERM sets a flag; the loop saves at the next step boundary and exits with code 42."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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
from trainer.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_only_sets_the_flag_and_uninstall_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    guard = PreemptionGuard().install()
    try:
        assert not guard.requested and not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.wait(10)  # still alive: the handler did not exit
        assert guard.should_stop(2) and guard.signal_name == "SIGTERM"
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_wait_wakes_when_the_signal_lands_on_another_thread():
    # The kernel gives a process-directed SIGTERM to any thread that does not block it; with
    # the main thread blocking it here, it lands on the helper. A single long wait in the main
    # thread slept through such a notice until its timeout.
    guard = PreemptionGuard().install()
    started = threading.Event()

    def notify() -> None:
        started.wait(10)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=notify)  # created before the mask: it may take SIGTERM
    helper.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        began = time.monotonic()
        started.set()
        assert guard.wait(60)
        assert time.monotonic() - began < 5
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        helper.join()
        guard.uninstall()


def test_exit_code_is_42():
    assert EXIT_PREEMPTED == 42


_LOOP_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from trainer.dataset import input_pipeline as dp
from trainer.runtime import checkpoint as ck
from trainer.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard

run_dir, data_dir = sys.argv[1:]
guard = PreemptionGuard().install()
it = dp.make_iterator(dp.open_dataset(data_dir), global_batch_size=2, seed=0, row_start=0,
                      row_stop=2)
mgr = ck.Checkpointer(run_dir, save_interval_steps=100, max_to_keep=2)
w = jnp.zeros(4)
for step in range(1, 50):
    batch = next(it)
    w = w + batch[:, 0].sum()
    print(f"STEP {step}", flush=True)
    if step == 3:
        guard.wait(120)  # the notice arrives while step 3 is running
    if guard.should_stop(step):
        mgr.save(step, {"w": w}, it, jax.random.key(0), force=True)
        mgr.close()
        print(f"PREEMPTED {step}", flush=True)
        sys.exit(EXIT_PREEMPTED)
    mgr.save(step, {"w": w}, it, jax.random.key(0))
sys.exit(0)
"""


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_exits_42(tmp_path):
    data = tmp_path / "data"
    records = (np.arange(20 * 5).reshape(20, 5) % 200).astype(np.uint8)
    write_shards(records, data, num_shards=1, sources=["test"])
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    proc = subprocess.Popen([sys.executable, "-c", _LOOP_SCRIPT, str(tmp_path / "run"), str(data)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "STEP 3":
            proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert rc == EXIT_PREEMPTED, stderr[-3000:]
    assert lines[-2:] == ["STEP 3", "PREEMPTED 3"]

    # The checkpoint holds step 3 exactly: state after 3 batches, data positioned at batch 3.
    info = dp.open_dataset(data)
    replay = dp.make_iterator(info, global_batch_size=2, seed=0, row_start=0, row_stop=2)
    expected = sum(int(next(replay)[:, 0].sum()) for _ in range(3))
    it = dp.make_iterator(info, global_batch_size=2, seed=0, row_start=0, row_stop=2)
    mgr = ck.Checkpointer(tmp_path / "run", save_interval_steps=100, max_to_keep=2)
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(
                                            jax.devices()[0]))}
    restored = mgr.restore_latest(target, it)
    assert restored.step == 3 and mgr.all_steps() == [1, 3]
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full(4, expected))
    np.testing.assert_array_equal(next(it), next(replay))


_TWO_PROCESS_SCRIPT = """
import sys, time
import jax
from trainer.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard

port, pid = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid),
                           initialization_timeout=60)
guard = PreemptionGuard().install()
for step in range(1, 2000):
    time.sleep(0.02)  # a "train step"
    print(f"STEP {step}", flush=True)
    if guard.should_stop(step):
        print(f"PREEMPTED {step}", flush=True)
        jax.distributed.shutdown()
        sys.exit(EXIT_PREEMPTED)
sys.exit(0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_notice_to_one_of_two_processes_stops_both_at_the_same_step():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_SCRIPT, port, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(2)]
    try:
        lines = []
        for line in procs[1].stdout:  # only process 1 gets the notice
            lines.append(line.strip())
            if line.strip() == "STEP 5":
                procs[1].send_signal(signal.SIGTERM)
        last = [lines[-1], procs[0].stdout.read().strip().splitlines()[-1]]
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.stdout.close()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    assert last[0] == last[1] and last[0].startswith("PREEMPTED "), last
    assert int(last[0].split()[1]) >= 5
