"""Stand-ins that speak the real protocols, for tests, benchmarks and `multislice rehearse`.

tpu_emulator: the Cloud TPU API v2 over loopback (python -m scripts.emulators.tpu_emulator).
gcs_emulator: fake-gcs-server (the GCS JSON API) on loopback.
metadata_server: the GCE metadata server a TPU VM reads (attributes, token, per-worker TPU keys).
tpu_image, netns, boot_harness: TPU VMs of the real image's shape (python3 3.10, no uv, their own
disks, users and loopback) that boot infra/boot/startup.sh unchanged (root only: namespaces).
"""
