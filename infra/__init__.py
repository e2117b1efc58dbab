"""The Pulumi program of one multislice experiment and what its TPU VMs run (see README.md)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # Pulumi.yaml, __main__.py, stacks/
