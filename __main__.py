"""Pulumi program entry point: `pulumi up` runs this file (see infra/program.py for why here)."""

from infra.program import run

run()
