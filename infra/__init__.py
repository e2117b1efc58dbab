"""The Pulumi program of one multislice experiment and what its TPU VMs run (see README.md)."""

from pathlib import Path

from infra.state_names import install as _answer_moved_provider_names

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # Pulumi.yaml, __main__.py, stacks/

_answer_moved_provider_names()
