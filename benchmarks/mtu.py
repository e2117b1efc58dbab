"""What a smaller MTU costs one TCP stream: a veth pair between two network namespaces, MTU 1460
(a VPC's default) against 8896 (what the Multislice overview asks of the slices' network).

    .venv/bin/python benchmarks/mtu.py [--repeats 3] [--seconds 3]      (as root: namespaces)

A sender in one namespace writes 1 MiB buffers to a receiver in the other for `--seconds`; the
MTU of both ends is set before each run, and repeats alternate the two MTUs. Segmentation
offloads are off (ethtool; `--offload` keeps them), so every packet of the MTU's size goes
through the stack as it crosses a wire. What this measures is the per-packet cost (headers, the
kernel's work per packet) on this machine's CPUs, not a DCN link's: the ratio is what
infra/preview/network_check.py quotes when it warns about a network's MTU. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.99.0.2", 5201)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); total = 0
while True:
    chunk = c.recv(1 << 20)
    if not chunk: break
    total += len(chunk)
print(total, flush=True)
"""
CLIENT = """
import socket, sys, time
s = socket.create_connection(("10.99.0.2", 5201)); buf = b"x" * (1 << 20)
end = time.monotonic() + float(sys.argv[1]); start = time.monotonic()
while time.monotonic() < end: s.sendall(buf)
s.close(); print(time.monotonic() - start, flush=True)
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def gbps(a: str, b: str, mtu: int, seconds: float) -> float:
    sh("ip", "-n", a, "link", "set", "va", "mtu", str(mtu))
    sh("ip", "-n", b, "link", "set", "vb", "mtu", str(mtu))
    server = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", SERVER],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    client = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", CLIENT,
                             str(seconds)], capture_output=True, text=True, check=True)
    total = int(server.stdout.readline())
    server.wait()
    return total * 8 / float(client.stdout) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--offload", action="store_true",
                        help="keep the veth pair's segmentation offloads (TSO, GSO, GRO): the "
                             "kernel then moves 64 KiB segments whatever the MTU")
    args = parser.parse_args(argv)
    tag = uuid.uuid4().hex[:6]
    a, b = f"mtu-a-{tag}", f"mtu-b-{tag}"
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    try:
        sh("ip", "-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b)
        sh("ip", "-n", a, "addr", "add", "10.99.0.1/24", "dev", "va")
        sh("ip", "-n", b, "addr", "add", "10.99.0.2/24", "dev", "vb")
        for ns, dev in ((a, "va"), (b, "vb")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if not args.offload:  # every packet of the MTU's size reaches the stack, as on a wire
                sh("ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso", "off",
                   "gro", "off")
        runs: dict[int, list[float]] = {1460: [], 8896: []}
        for repeat in range(args.repeats):
            for mtu in ((1460, 8896) if repeat % 2 == 0 else (8896, 1460)):
                runs[mtu].append(gbps(a, b, mtu, args.seconds))
                print(f"repeat {repeat} MTU {mtu}: {runs[mtu][-1]:.2f} Gbit/s", flush=True)
                time.sleep(0.2)
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)
    median = {mtu: statistics.median(v) for mtu, v in runs.items()}
    ratio = median[1460] / median[8896]
    print(f"median: MTU 1460 {median[1460]:.2f} Gbit/s, MTU 8896 {median[8896]:.2f} Gbit/s "
          f"(1460/8896 {ratio:.2f})")
    print(json.dumps({"repeats": args.repeats, "seconds": args.seconds,
                      "median_gbps": median, "ratio_1460_over_8896": ratio}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
