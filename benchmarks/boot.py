"""Boot to first training step of a fresh TPU VM host on the emulated image: building the
interpreter and the locked environment vs installing the one another host published.

    .venv/bin/python benchmarks/boot.py [--repeats 3]      (as root: the image needs mounts)

Each repeat makes a new single-slice stack (a new bucket on fake-gcs-server) and boots
infra/boot/startup.sh twice through scripts/emulators/boot_harness.py, each time as a fresh host of the
emulated TPU image (scripts/emulators/tpu_image.py: python3 3.10, no uv, empty disks): host A finds
no environment for the lock, wins the claim, pip-installs the pinned uv, installs the lock's
CPython with it, builds the venv with `uv pip sync --require-hashes` and publishes both (in the
background, while its trainer starts); host B unpacks A's (interpreter included) and trains one
more step on the same run. The size of the published archive is what A logs for it. Boot to first step is the time from
starting the startup script to the first `step` row this boot wrote in metrics.jsonl (it
includes loading the trainer, restoring A's checkpoint for B, and compiling);
the environment phase is what the startup script logs for it. Medians over repeats; the ratio
is B over A.

What the numbers mean here: uv installs from this machine's cache (offline), so A's build has no
downloads in it. On a real VM it also downloads every wheel (jax, jaxlib, libtpu: about a
gigabyte) from PyPI through Cloud NAT, once per host without the bucket; B's cost does not
change. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.emulators.boot_harness import Host, Stack, boot_experiment  # noqa: E402
from scripts.emulators.gcs_emulator import GcsEmulator  # noqa: E402
from scripts.emulators.tpu_image import build_image  # noqa: E402

ENV_LINE = re.compile(r"(built|installed) environment \S+ (?:from \S+ )?in (\d+)s")
SIZE_LINE = re.compile(r"publishing \S+ \((\d+) MiB, interpreter included\)")


def boot_once(stack: Stack, host: Host, steps: int) -> dict[str, float]:
    stack.publish_spec(steps=steps)
    result = host.boot(stack)
    if result.returncode != 0:
        raise SystemExit(host.explain(result))
    first_step = next(e["time"] for e in stack.events()
                      if e["event"] == "step" and e["time"] > host.started)
    match = ENV_LINE.search(result.stderr)
    size = SIZE_LINE.search((host.logs / "startup.log").read_text())
    return {"boot_to_first_step_s": first_step - host.started,
            "env_s": float(match[2]) if match else float("nan"),
            "published_env_mib": float(size[1]) if size else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {"builds": [], "from_bucket": []}
    with tempfile.TemporaryDirectory() as tmp, GcsEmulator() as gcs:
        experiment = boot_experiment(Path(tmp) / "exp")
        image = build_image(Path(tmp) / "image")
        for repeat in range(args.repeats):
            stack = Stack(gcs, experiment, f"bench{repeat}", steps=1)
            # B continues A's run (one more step) on the same bucket, as a second host would.
            for steps, (kind, name) in enumerate((("builds", "a"), ("from_bucket", "b")), 1):
                host = Host(image, Path(tmp) / f"r{repeat}", f"host-{name}")
                row = boot_once(stack, host, steps)
                rows[kind].append(row)
                print(f"repeat {repeat} {kind:11s} boot->first step "
                      f"{row['boot_to_first_step_s']:.1f} s (environment {row['env_s']:.0f} s)",
                      flush=True)
    medians = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for kind, rs in rows.items()}
    ratio = (medians["from_bucket"]["boot_to_first_step_s"]
             / medians["builds"]["boot_to_first_step_s"])
    print(f"median boot->first step: builds {medians['builds']['boot_to_first_step_s']:.1f} s, "
          f"from bucket {medians['from_bucket']['boot_to_first_step_s']:.1f} s "
          f"(from_bucket/builds {ratio:.2f}); published environment "
          f"{medians['builds']['published_env_mib']:.0f} MiB with its interpreter")
    print(json.dumps({"repeats": args.repeats, "median": medians,
                      "from_bucket_over_builds": ratio}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
