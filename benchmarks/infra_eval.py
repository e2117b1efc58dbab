"""Time to evaluate the Pulumi program (validation + all components) under the mock runtime.

Usage: python benchmarks/infra_eval.py [--repeats N]
Prints one line per slice count, then one JSON line: {"benchmark": "infra_eval", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pulumi  # noqa: E402

SLICE_COUNTS = (1, 16, 256)


class _Mocks(pulumi.runtime.Mocks):
    def __init__(self) -> None:
        self.count = 0

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.count += 1
        outputs = dict(args.inputs)
        if "accountId" in outputs:
            outputs["email"] = (
                f"{outputs['accountId']}@{outputs['project']}.iam.gserviceaccount.com"
            )
        return [f"{args.name}_id", outputs]

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}


def _experiment(root: Path) -> Path:
    exp = root / "experiments" / "bench"
    (exp / "configs").mkdir(parents=True)
    (exp / "trainer").mkdir()
    (exp / "pyproject.toml").write_text('[project]\nname = "bench"\nversion = "0"\n')
    (exp / "configs" / "tiny.toml").write_text("")
    (exp / "trainer" / "main.py").write_text("")
    return exp


def evaluate(slices: int, root: Path) -> tuple[float, int]:
    from infra.stack import create_stack
    from infra.stack_config.pulumi_config import load_stack_config

    config = {
        "project": "bench-proj",
        "region": "us-central2",
        "zone": "us-central2-b",
        "accelerator_type": "v5litepod-16",
        "slices": str(slices),
        "capacity": "spot",
        "experiment_dir": "experiments/bench",
        "trainer": json.dumps({"config": "tiny", "mesh": {"ici_fsdp": 16, "dcn_data": -1}}),
    }
    mocks = _Mocks()
    pulumi.runtime.set_mocks(mocks, project="multislice", stack="bench", preview=True)
    pulumi.runtime.set_all_config({f"multislice:{k}": v for k, v in config.items()})
    start = time.perf_counter()

    @pulumi.runtime.test
    def program():
        cfg, _ = load_stack_config(base_dir=root)
        return pulumi.Output.all(**create_stack(cfg, root))

    program()
    return time.perf_counter() - start, mocks.count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _experiment(root)
        evaluate(1, root)  # warm-up: imports of pulumi_gcp and the google client dominate
        for slices in SLICE_COUNTS:
            times, resources = [], 0
            for _ in range(args.repeats):
                elapsed, resources = evaluate(slices, root)
                times.append(elapsed)
            median = statistics.median(times)
            results[str(slices)] = {"median_s": round(median, 4), "resources": resources}
            print(
                f"{slices:>4} slices: median {median * 1000:.1f} ms over {args.repeats} runs, "
                f"{resources} resources",
                flush=True,
            )
    print(json.dumps({"benchmark": "infra_eval", "repeats": args.repeats, "slices": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
