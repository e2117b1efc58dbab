"""Orchestration tpu-vm: one queued resource of N TPU VM slices, its Pulumi dynamic provider
and the Cloud TPU API v2 client it calls (google-cloud-tpu)."""
