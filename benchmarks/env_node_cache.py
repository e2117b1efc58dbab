"""What a GKE pod pays at every start to get a Python environment it can trust, four ways.

    .venv/bin/python benchmarks/env_node_cache.py [--tree .venv] [--repeats 5]

The ways a GKE pod could get an environment it can trust at every start, measured on the same
tree (by default this toolkit's own .venv, a stand-in of a trainer's environment's size and file
count). What pods do now: on a stack's own nodes the init container installs the environment
onto the node and the trainer's container reads it read-only, so a marker check is enough
(`stat-digest`); on an admin's shared nodes, `download-check-unpack` at every start.

- `stat-digest` (a pod on its stack's node, every start): a digest of every file's path, size
  and mtime (skipping __pycache__), against its marker. No defence against a writer, which is
  why the trainer's container gets the directory read-only.
- `content-digest` (what pods did before the init container): every file's bytes.
- `archive-check-unpack`: an archive kept on the node, copied into the pod, checked, unpacked
  (the alternative of keeping only the archive on the node).
- `download-check-unpack` (a pod with nothing on its node, every start; the first pod on a
  node): the same from the GCS emulator over loopback (real GCS from a GKE node in the bucket's
  region is slower than loopback; scale by the archive's size over your measured throughput).

Each is timed `--repeats` times with the page cache warm (a pod restart on the same node finds
it so), alternating between the ways; the medians and their ratios to `stat-digest` are printed,
then one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stat_digest(tree: Path) -> str:
    command = (f"cd {tree} && find . \\( -name __pycache__ -o -path ./.complete \\) -prune "
               "-o -type f -printf '%P %s %T@\\n' -o -type l -printf '%P -> %l\\n' "
               "| LC_ALL=C sort | sha256sum")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          check=True).stdout.split()[0]


def content_digest(tree: Path) -> str:
    command = (f"cd {tree} && find . -type f -print0 | LC_ALL=C sort -z "
               f"| xargs -0 -P {os.cpu_count() or 1} -n 256 sha256sum | LC_ALL=C sort "
               "| sha256sum")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          check=True).stdout.split()[0]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_and_unpack(archive: Path, want: str, work: Path) -> None:
    copy = work / "env.tar.gz"
    shutil.copyfile(archive, copy)
    assert sha256_file(copy) == want
    dest = work / "env"
    dest.mkdir()
    subprocess.run(["tar", "-C", str(dest), "-xzf", str(copy)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT / ".venv")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tree = args.tree.resolve()
    files = sum(1 for p in tree.rglob("*") if p.is_file())
    with tempfile.TemporaryDirectory(prefix="env-node-cache-") as tmp:
        work = Path(tmp)
        archive = work / "node" / "env.tar.gz"
        archive.parent.mkdir()
        started = time.monotonic()
        subprocess.run(["tar", "-C", str(tree.parent), "-czf", str(archive), tree.name],
                       check=True)
        print(f"packed {tree} ({files} files) into {archive.stat().st_size / 2**20:.0f} MiB "
              f"in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
        want = sha256_file(archive)
        archive_mib = archive.stat().st_size / 2**20

        from scripts.emulators.gcs_emulator import GcsEmulator

        times: dict[str, list[float]] = {name: [] for name in (
            "stat-digest", "content-digest", "archive-check-unpack", "download-check-unpack")}
        with GcsEmulator(work / "gcs") as gcs:
            gcs.create_bucket("env-bench")
            gcs.put("env-bench", "envs/env.tar.gz", archive.read_bytes())
            for repeat in range(args.repeats):
                for name in times:
                    pod = work / f"pod-{repeat}-{name}"
                    pod.mkdir()
                    started = time.monotonic()
                    if name == "stat-digest":
                        stat_digest(tree)
                    elif name == "content-digest":
                        content_digest(tree)
                    elif name == "archive-check-unpack":
                        check_and_unpack(archive, want, pod)
                    else:
                        fetched = pod / "fetched.tar.gz"
                        fetched.write_bytes(gcs.get("env-bench", "envs/env.tar.gz"))
                        check_and_unpack(fetched, want, pod)
                    times[name].append(time.monotonic() - started)
                    shutil.rmtree(pod)
                print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                    f"{n} {t[-1]:.2f}s" for n, t in times.items()), file=sys.stderr, flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["stat-digest"]
    for name, median in medians.items():
        print(f"{name:24s} {median:7.2f} s  ({median / base:6.1f}x stat-digest)")
    print(json.dumps({"tree": str(tree), "files": files, "archive_mib": round(archive_mib, 1),
                      "median_s": {k: round(v, 3) for k, v in medians.items()},
                      "repeats": args.repeats, "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
