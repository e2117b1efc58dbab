"""Settings for an organisation whose platform team did part of the work: the bucket under the
organisation's own key (CMEK), and APIs the platform already enabled."""

from __future__ import annotations

from infra.stack_config.schema import StackConfig
from infra.stack_config.validation import stack_problems
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program

KEY = "projects/platform-kms/locations/us-central2/keyRings/training/cryptoKeys/buckets"


def test_the_bucket_encrypts_with_the_organisations_key_when_the_stack_names_one(project_root):
    mocks, _ = run_program(base_config(bucket_kms_key=KEY), project_root)
    [bucket] = mocks.of_type("gcp:storage/bucket:Bucket")
    assert bucket.inputs["encryption"] == {"defaultKmsKeyName": KEY}
    mocks, _ = run_program(base_config(), project_root)
    [bucket] = mocks.of_type("gcp:storage/bucket:Bucket")
    assert "encryption" not in bucket.inputs


def test_a_key_outside_the_buckets_location_is_one_line_naming_both():
    cfg = StackConfig.model_validate({"stack": "exp", **base_config(
        bucket_kms_key=KEY.replace("us-central2", "europe-west4"))})
    [line] = [p for p in stack_problems(cfg)[0] if p.startswith("bucket_kms_key")]
    assert "'europe-west4'" in line and "'us-central2'" in line


def test_a_stack_whose_platform_enabled_the_apis_declares_no_service(project_root):
    mocks, _ = run_program(base_config(), project_root)
    enabled = {r.inputs["service"] for r in mocks.of_type("gcp:projects/service:Service")}
    assert "tpu.googleapis.com" in enabled
    mocks, _ = run_program(base_config(enable_apis=False), project_root)
    assert mocks.of_type("gcp:projects/service:Service") == []
    assert mocks.queued_resource() is not None
