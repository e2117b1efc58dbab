"""The example stacks this toolkit ships (stacks/), named once: tests check these, never
whatever else a user keeps in stacks/ (their own half-written Pulumi.*.yaml is theirs, not a
failing test case). tests/test_examples_list.py checks the list against what git tracks."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_STACK_NAMES = ("Pulumi.gke-capacity.yaml", "Pulumi.gke-tpu7x.yaml", "Pulumi.gke-v5e.yaml",
                       "Pulumi.gke-workload.yaml", "Pulumi.seed-v5e.yaml",
                       "Pulumi.single-v4.yaml")
EXAMPLE_STACKS = tuple(ROOT / "stacks" / name for name in EXAMPLE_STACK_NAMES)
