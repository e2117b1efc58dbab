"""Failure schedules the restart benchmarks share: the same steps for every mode of a repeat."""

from __future__ import annotations

import random


def failure_steps(steps: int, failures: int, rng: random.Random, spread: int) -> list[int]:
    """`failures` kill steps spread evenly over `steps`, each moved by up to a 1/`spread` of the
    gap between two either way (the same for every mode a repeat runs)."""
    span = steps // (failures + 1)
    return [span * (k + 1) + rng.randrange(-span // spread, span // spread + 1)
            for k in range(failures)]
