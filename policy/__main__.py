"""Entry point run by `pulumi preview --policy-pack policy/`: registers the pack and serves it."""

from multislice_policies import build_policies
from pulumi_policy import EnforcementLevel, PolicyPack

PolicyPack(
    name="multislice-guardrails",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=build_policies(),
)
