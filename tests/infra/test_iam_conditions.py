"""The IAM Condition expressions the toolkit writes or tells a reader to write, evaluated as CEL
(cel-python) against resource names that must and must not match: each ends at a delimiter, so
one name's prefix never grants a longer name (`teama` is not `teamab`, `runs/exp1/` is not
`runs/exp1-old/`). Cloud Storage's resource names are projects/_/buckets/BUCKET[/objects/NAME]
(IAM's resource attributes page)."""

from __future__ import annotations

import re
from pathlib import Path

import celpy
import pytest

from infra.stack_config.manifest import host_write_condition, host_write_prefixes
from infra.stack_config.schema import parse_stack
from tests.infra.conftest import base_config

ROOT = Path(__file__).resolve().parents[2]


def grants(expression: str, name: str) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return bool(program.evaluate({"resource": celpy.json_to_cel({"name": name})}))


def test_the_hosts_write_condition_admits_their_run_and_boot_logs_only():
    cfg = parse_stack(base_config(), "exp1")
    bucket = cfg.names.bucket
    condition = host_write_condition(bucket, host_write_prefixes(cfg))
    obj = f"projects/_/buckets/{bucket}/objects/"
    run = cfg.names.run_dir.removeprefix(f"gs://{bucket}/")
    boot = cfg.names.launch_spec_object.removesuffix(".json") + ".boot/"
    for name in (f"{obj}{run}/checkpoints/4/x", f"{obj}{run}/metrics.jsonl", f"{obj}{boot}h0.log"):
        assert grants(condition, name), name
    for name in (f"{obj}{run}-other/metrics.jsonl",  # a longer run name: the "/" holds it off
                 f"{obj}{run}", f"{obj}{cfg.names.launch_spec_object}", f"{obj}code/a.tar.gz",
                 f"{obj}envs/x.tar", f"projects/_/buckets/{bucket}-other/objects/{run}/x",
                 f"projects/_/buckets/{bucket}"):
        assert not grants(condition, name), name


def readme_conditions() -> dict[str, str]:
    """title -> expression of the README's gcloud block for a project teams share, with the
    block's own P and TEAM."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("P=my-proj TEAM=teama", 1)[1].split("```", 1)[0]
    found = {}
    for title, expression in re.findall(r'--condition="title=([\w-]+),expression=(.*?)"',
                                        block.replace("\\\n", ""), flags=re.S):
        found[title] = expression.replace("$P", "my-proj").replace("$TEAM", "teama")
    return found


def test_the_readmes_team_bucket_condition_reaches_that_teams_buckets_only():
    condition = readme_conditions()["team-buckets"]
    ours = "projects/_/buckets/my-proj-ms-teama-exp1"
    assert grants(condition, ours) and grants(condition, f"{ours}/objects/runs/exp1/x")
    for name in ("projects/_/buckets/my-proj-ms-teamab-exp1",  # a team whose name extends ours
                 "projects/_/buckets/my-proj-ms-teamb-exp1",
                 "projects/_/buckets/other-proj-ms-teama-exp1",
                 "projects/_/buckets/my-proj-ms-teama"):
        assert not grants(condition, name), name


def test_the_readme_conditions_only_names_iam_evaluates():
    # IAM evaluates resource-name conditions for the services its resource-attributes page
    # lists (Cloud Storage among them; not the TPU API, not IAM's service accounts): a
    # condition on a service account's or a TPU node's name would not hold, so the README
    # writes none and says the project is the boundary.
    conditions = readme_conditions()
    assert set(conditions) == {"multislice-grants-only", "team-buckets"}
    assert all("serviceAccounts/" not in e and "/nodes/" not in e for e in conditions.values())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "neither the TPU API nor IAM's own service accounts are among them" in readme
    assert "`TEAM` is lowercase letters and digits only" in readme


@pytest.mark.parametrize("team", ["teama", "t2"])
def test_a_team_name_of_letters_and_digits_is_never_a_prefix_of_another_teams_buckets(team):
    condition = readme_conditions()["team-buckets"].replace("teama", team)
    for other in ("teamab", "teama1", "t22", "t"):
        if other != team:
            assert not grants(condition, f"projects/_/buckets/my-proj-ms-{other}-exp1"), other


def readme_provider_condition() -> str:
    """The workload identity provider's attribute condition of the README's CI recipe."""
    readme = (ROOT / "README.md").read_text()
    [condition] = re.findall(r'--attribute-condition="(.*?)"', readme)
    return condition.replace("OWNER/REPO", "acme/train")


def admits(expression: str, claims: dict[str, str]) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return bool(program.evaluate({"assertion": celpy.json_to_cel(claims)}))


def token(event: str, ref: str, environment: str | None = None, repository: str = "acme/train"
          ) -> dict[str, str]:
    """GitHub's OIDC claims: a job in an environment has it in its subject, not the branch."""
    sub = (f"repo:{repository}:environment:{environment}" if environment else
           f"repo:{repository}:pull_request" if event == "pull_request" else
           f"repo:{repository}:ref:{ref}")
    claims = {"sub": sub, "repository": repository, "event_name": event, "ref": ref}
    if environment:
        claims["environment"] = environment
    return claims


def test_the_ci_provider_admits_the_deploy_environment_only_from_a_push_to_main():
    condition = readme_provider_condition()
    assert admits(condition, token("push", "refs/heads/main", "deploy"))
    assert admits(condition, token("pull_request", "refs/pull/7/merge"))  # preview, read-only
    assert admits(condition, token("push", "refs/heads/main"))
    for claims in (token("push", "refs/heads/feature", "deploy"),  # a branch naming deploy
                   token("pull_request", "refs/pull/7/merge", "deploy"),
                   token("workflow_dispatch", "refs/heads/main", "deploy"),
                   token("push", "refs/heads/main", "deploy", repository="acme/fork")):
        assert not admits(condition, claims), claims
