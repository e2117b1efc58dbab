"""Entry point run by `pulumi preview --policy-pack policy/`: registers the pack and serves it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the analyzer may run this file by path from another directory
    sys.path.insert(0, str(HERE))

from multislice_policies import build_policies  # noqa: E402
from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

PolicyPack(
    name="multislice-guardrails",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=build_policies(),
)
