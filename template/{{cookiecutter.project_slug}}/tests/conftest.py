"""Eight CPU devices for every test; must run before anything imports jax."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)
for name in ("MULTISLICE_COORDINATOR", "MULTISLICE_NUM_PROCESSES", "MULTISLICE_PROCESS_ID"):
    os.environ.pop(name, None)
