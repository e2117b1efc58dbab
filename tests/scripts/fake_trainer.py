"""A stand-in for `python -m trainer.main` that honours docs/CONTRACTS.md without JAX.

Tests copy it to EXPERIMENT/trainer/main.py. Contract flags are accepted; `--fake-*` flags make it
misbehave on purpose. It "checkpoints" to RUN_DIR/fake-checkpoint.json (process 0) and resumes from
there, so launcher restarts can be observed without a real trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--expect-slices", type=int)
    p.add_argument("--expect-devices-per-slice", type=int)
    p.add_argument("--fake-step-time", type=float, default=0.02)
    p.add_argument("--fake-ckpt-every", type=int, default=0)
    p.add_argument("--fake-fail", default=None, help="SLICE:STEP:CODE")
    p.add_argument("--fake-fail-once", action="store_true", help="not again after a restart")
    p.add_argument("--fake-hang", default=None, help="SLICE:STEP, SLICE -1 = every slice")
    p.add_argument("--fake-ignore-sigterm", action="store_true")
    p.add_argument("--fake-dump-env", action="store_true")
    p.add_argument("--fake-jax-init", action="store_true")
    p.add_argument("--fake-no-coordinator", action="store_true")
    return p.parse_args()


def agreed_start_step(ckpt: Path, pid: int) -> int:
    """The step every process of this attempt resumes from, as a real trainer's collective restore.

    Process 0 reads the checkpoint and publishes its step for this attempt (one coordinator per
    attempt); the others wait for it. Each reading the checkpoint itself would let a process that
    starts late resume from a step its peers wrote after the attempt began.
    """
    coordinator = os.environ["MULTISLICE_COORDINATOR"].replace(":", "_").replace("/", "_")
    agreed = ckpt.with_name(f"fake-start-{coordinator}.json")
    if pid == 0:
        step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
        partial = agreed.with_suffix(".partial")
        partial.write_text(json.dumps({"step": step}))
        os.replace(partial, agreed)
        return step
    deadline = time.monotonic() + 120
    while not agreed.exists():
        if time.monotonic() > deadline:
            print(f"process {pid}: process 0 never published its start step", flush=True)
            sys.exit(1)
        time.sleep(0.01)
    return json.loads(agreed.read_text())["step"]


def main() -> int:
    args = parse()
    pid = int(os.environ["MULTISLICE_PROCESS_ID"])
    nproc = int(os.environ["MULTISLICE_NUM_PROCESSES"])
    flags = os.environ.get("XLA_FLAGS", "").split()
    devices = [int(f.split("=")[1]) for f in flags if f.startswith("--xla_force_host_platform")]

    def on_sigterm(_signum: int, _frame: object) -> None:
        print(f"process {pid}: SIGTERM, checkpoint saved", flush=True)
        sys.exit(42)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.fake_ignore_sigterm else on_sigterm)

    if args.fake_dump_env:
        for key in sorted(os.environ):
            if key.startswith("MULTISLICE_") or key in ("XLA_FLAGS", "JAX_PLATFORMS"):
                print(f"env {key}={os.environ[key]}", flush=True)
        print(f"argv {' '.join(sys.argv[1:])}", flush=True)
    print(f"process {pid} to stderr", file=sys.stderr, flush=True)
    if args.expect_slices is not None and (
        args.expect_slices != nproc or [args.expect_devices_per_slice] != devices
    ):
        print(f"expected {args.expect_slices}x{args.expect_devices_per_slice}, "
              f"got {nproc}x{devices}", flush=True)
        return 3

    if args.fake_jax_init:
        if pid == 0 and args.fake_no_coordinator:
            time.sleep(3600)  # the coordinator never comes up
        import jax

        jax.distributed.initialize(
            coordinator_address=os.environ["MULTISLICE_COORDINATOR"],
            num_processes=nproc,
            process_id=pid,
            initialization_timeout=int(float(os.environ["MULTISLICE_INIT_TIMEOUT_S"])),
        )
        print(f"process {pid}: distributed up, {jax.device_count()} devices", flush=True)

    ckpt = args.run_dir / "fake-checkpoint.json"
    start = agreed_start_step(ckpt, pid)
    print(f"process {pid}: starting at step {start}", flush=True)
    fail = [int(x) for x in args.fake_fail.split(":")] if args.fake_fail else None
    hang = [int(x) for x in args.fake_hang.split(":")] if args.fake_hang else None
    loss = 5.0
    for step in range(start + 1, args.steps + 1):
        if hang and hang[0] in (pid, -1) and step == hang[1]:
            time.sleep(3600)
        failed_marker = args.run_dir / f"fake-failed-{pid}"
        if fail and fail[0] == pid and step == fail[1] and not (
            args.fake_fail_once and failed_marker.exists()
        ):
            failed_marker.touch()
            print(f"process {pid}: failing at step {step} with code {fail[2]}", flush=True)
            return fail[2]
        time.sleep(args.fake_step_time)
        loss = 5.0 / step
        if pid == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
        if os.environ.get("MULTISLICE_STEP_MARKERS") == "1":  # as the real trainer
            print(f"MULTISLICE_STEP {step}", flush=True)
        if pid == 0 and args.fake_ckpt_every and step % args.fake_ckpt_every == 0:
            # Atomic, like a real checkpoint: the launcher may kill this process mid-write.
            partial = ckpt.with_suffix(".partial")
            partial.write_text(json.dumps({"step": step}))
            os.replace(partial, ckpt)
    if pid == 0:
        summary = {"final_step": args.steps, "final_loss": loss, "tokens_per_s": 1234.5,
                   "mfu": 0.0123, "num_slices": nproc, "devices_per_slice": devices[0]}
        (args.run_dir / "summary.json").write_text(json.dumps(summary))
    print(f"process {pid}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
