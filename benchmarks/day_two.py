"""Day two on the emulated image: time from a launch spec change (`pulumi up` with new code) to
the first training step on the new code, for a running two-host job, without a reboot.

    .venv/bin/python benchmarks/day_two.py [--repeats 3] [--spec-poll-s 5]   (as root)

One two-slice stack (2 emulated hosts x 4 CPU devices, scripts/emulators/boot_harness.py) trains a
long run. Each repeat changes the experiment's code (a new archive) and rewrites the launch spec
object as `pulumi up` does (delete, then create). Each host's startup script notices the new
generation within spec_poll_s (jittered by 25%), stops its trainer with SIGTERM (JAX's preemption
sync point: every process saves the same step and exits 42), fetches the new archive, reuses the
environment (the lock did not change) and starts the trainer, which restores the checkpoint and
compiles. Reported per repeat and as medians: until the first host logs the stop (detect),
until the new spec is read on both hosts (stopped), and until the first `step` row after the
restore (first new step). The alternative, a replacement of the queued resource, costs a delete,
the queueing time for capacity (minutes to days for multi-slice v5e/v4, not measurable here)
and a full boot of every host (benchmarks/boot.py). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.emulators.boot_harness import Host, Stack, boot_experiment  # noqa: E402
from scripts.emulators.gcs_emulator import GcsEmulator  # noqa: E402
from scripts.emulators.tpu_image import build_image  # noqa: E402

STAMP = re.compile(r"^(\S+Z) multislice-startup: launch spec generation (\d+) -> (\d+): (\S+)")


def _logged(hosts: list[Host], new_gen: str, stopping: bool) -> float | None:
    """Earliest (stopping) or latest (reading the new spec) time a host logged the change."""
    times = []
    for host in hosts:
        for line in host.console.read_text().splitlines():
            match = STAMP.match(line)
            if match and match[3] == new_gen and (match[4] == "stopping") == stopping:
                times.append(datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%SZ")
                             .replace(tzinfo=UTC).timestamp())
                break
    if len(times) < (1 if stopping else len(hosts)):
        return None
    return min(times) if stopping else max(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec-poll-s", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, GcsEmulator() as gcs:
        experiment = boot_experiment(Path(tmp) / "exp")
        image = build_image(Path(tmp) / "image")
        stack = Stack(gcs, experiment, "daytwo", slices=2, steps=100000,
                      spec_poll_s=args.spec_poll_s,
                      overrides={"checkpoint.save_interval_steps": 20})
        hosts = [Host(image, Path(tmp), f"daytwo-w-{i}", slice_index=i) for i in range(2)]
        for host in hosts:
            host.start(stack)
        try:
            _wait(lambda: _steps_after(stack, 0.0) >= 2, 900, "the job's first steps")
            for repeat in range(args.repeats):
                marker = experiment / "trainer" / "__init__.py"
                marker.write_text(marker.read_text() + f"\n# day-two change {repeat}\n")
                changed = time.time()
                new_gen = stack.publish_spec()
                first = _wait(lambda t=changed: _first_step_after_restore(stack, t), 900,
                              "the first step on the new code")
                detect = _wait(lambda g=new_gen: _logged(hosts, g, True), 60, "the stop line")
                read = _wait(lambda g=new_gen: _logged(hosts, g, False), 60, "the new spec read")
                row = {"detect_s": detect - changed, "stopped_s": read - changed,
                       "first_new_step_s": first - changed}
                rows.append(row)
                print(f"repeat {repeat}: detected {row['detect_s']:.0f} s, new spec read on "
                      f"both hosts {row['stopped_s']:.0f} s, first step on the new code "
                      f"{row['first_new_step_s']:.1f} s after the change", flush=True)
        finally:
            for host in hosts:
                host.stop()
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median over {args.repeats}: first step on the new code "
          f"{medians['first_new_step_s']:.1f} s after the spec change (spec_poll_s "
          f"{args.spec_poll_s}; console timestamps have 1 s resolution); a replacement instead "
          "gives up the slices and queues again")
    print(json.dumps({"repeats": args.repeats, "spec_poll_s": args.spec_poll_s,
                      "median": medians, "rows": rows}))
    return 0


def _wait(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout:.0f}s")
        time.sleep(0.5)


def _events(stack: Stack) -> list[dict]:
    try:
        return stack.events()
    except Exception:  # no metrics.jsonl yet
        return []


def _steps_after(stack: Stack, since: float) -> int:
    return sum(e["event"] == "step" and e["time"] > since for e in _events(stack))


def _first_step_after_restore(stack: Stack, since: float) -> float | None:
    events = _events(stack)
    restores = [i for i, e in enumerate(events) if e["event"] == "restore" and e["time"] > since]
    if not restores:
        return None
    return next((e["time"] for e in events[restores[0]:] if e["event"] == "step"), None)


if __name__ == "__main__":
    raise SystemExit(main())
