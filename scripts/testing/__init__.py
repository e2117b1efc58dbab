"""Stand-ins that speak the real protocols, for tests and for trying the CLI without a cloud.

tpu_emulator: the Cloud TPU API v2 over loopback (python -m scripts.testing.tpu_emulator).
"""
