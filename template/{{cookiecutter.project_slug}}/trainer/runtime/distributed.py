"""Multi-process start-up and the check that every expected slice and device is present.

- MULTISLICE_* set (CPU emulation by `multislice local`): one process per slice, gloo collectives,
  `jax.distributed.initialize` with an explicit coordinator and timeout.
- On a TPU VM (no MULTISLICE_* variables): the cluster comes from the VM's metadata (`tpu-env`
  with its MEGASCALE_* values, `agent-worker-number`, `worker-network-endpoints`), read by JAX's
  own Cloud TPU cluster code, exactly what a bare `jax.distributed.initialize()` would find there;
  on a GKE TPU pod, from what GKE sets in the pod's environment (TPU_WORKER_ID and
  TPU_WORKER_HOSTNAMES, or TPU_PROCESS_ADDRESSES, and MEGASCALE_*), read by JAX's GKE cluster
  code as JAX's own detection does;
  MULTISLICE_INIT_TIMEOUT_S (set by the startup script from the stack's
  `trainer.init_timeout_s`) bounds how long it waits for the other hosts.
- MULTISLICE_HEARTBEAT_TIMEOUT_S, when set, replaces JAX's heartbeat timeout (100 s): how long the
  coordination service waits for a process that went silent (its host died) before it ends the
  job's other processes, which a restart then brings back together. The emulated TPU hosts set
  it lower: a CPU process whose Gloo peer died spins a core until then.
- Otherwise: a single process, nothing to do.

A runtime that cannot form (a peer not up yet, the coordinator unreachable) raises
ClusterUnavailable, which a restart can fix; a bad variable or a topology that differs from the
expected one raises DistributedError, which it cannot.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping

ENV_COORDINATOR = "MULTISLICE_COORDINATOR"
ENV_NUM_PROCESSES = "MULTISLICE_NUM_PROCESSES"
ENV_PROCESS_ID = "MULTISLICE_PROCESS_ID"
ENV_INIT_TIMEOUT = "MULTISLICE_INIT_TIMEOUT_S"
ENV_SPEC_GENERATION = "MULTISLICE_SPEC_GENERATION"  # set by the startup script on a TPU VM
DEFAULT_INIT_TIMEOUT_S = 300
ENV_HEARTBEAT_TIMEOUT = "MULTISLICE_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100  # jax.distributed.initialize's own default

# Hosts (processes) in each slice, as the cluster described itself to initialize(). Only CPU
# needs it: there devices carry no slice_index, so a device's slice is its process // this.
_processes_per_slice = 1


def processes_per_slice() -> int:
    return _processes_per_slice


class DistributedError(RuntimeError):
    """The cluster settings or the topology are wrong; restarting will not help."""


class ClusterUnavailable(DistributedError):
    """The distributed runtime did not form in time; a restart once the peers are up can fix it."""


class SpecMismatch(RuntimeError):
    """The hosts run different launch spec generations; reading the spec again fixes it."""


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    coordinator: str
    num_processes: int
    process_id: int
    init_timeout_s: int


def _int_env(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise DistributedError(f"{name}={value}: expected an integer >= {minimum}")
    return value


def cluster_env(env: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """Parse the MULTISLICE_* variables; None when none are set."""
    env = os.environ if env is None else env
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [n for n in names if env.get(n)]
    if not present:
        return None
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise DistributedError(
            f"{', '.join(present)} set but {', '.join(missing)} missing; set all of {names}"
        )
    num = _int_env(env, ENV_NUM_PROCESSES, 1)
    pid = _int_env(env, ENV_PROCESS_ID, 0)
    if pid >= num:
        raise DistributedError(
            f"{ENV_PROCESS_ID}={pid} but {ENV_NUM_PROCESSES}={num}; ids run 0..{num - 1}"
        )
    timeout = (_int_env(env, ENV_INIT_TIMEOUT, 1) if env.get(ENV_INIT_TIMEOUT)
               else DEFAULT_INIT_TIMEOUT_S)
    return ClusterEnv(env[ENV_COORDINATOR], num, pid, timeout)


def on_tpu_vm() -> bool:
    # TPU v4/v5e expose /dev/accel*, v5p/v6e /dev/vfio/*; checked without touching the backend.
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def heartbeat_timeout_s(env: Mapping[str, str] | None = None) -> int:
    """MULTISLICE_HEARTBEAT_TIMEOUT_S (seconds, at least 1), else JAX's default."""
    env = os.environ if env is None else env
    if env.get(ENV_HEARTBEAT_TIMEOUT):
        return _int_env(env, ENV_HEARTBEAT_TIMEOUT, 1)
    return DEFAULT_HEARTBEAT_TIMEOUT_S


def initialize(env: Mapping[str, str] | None = None) -> str:
    """Start the distributed runtime if this is a multi-process job; returns what was done."""
    import jax

    cluster = cluster_env(env)
    if cluster is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        heartbeat_s = heartbeat_timeout_s(env)  # a bad value: DistributedError, not retried
        try:
            jax.distributed.initialize(
                coordinator_address=cluster.coordinator,
                num_processes=cluster.num_processes,
                process_id=cluster.process_id,
                initialization_timeout=cluster.init_timeout_s,
                heartbeat_timeout_seconds=heartbeat_s,
            )
        except Exception as exc:  # jax raises several types (XlaRuntimeError, RuntimeError...)
            raise ClusterUnavailable(
                f"process {cluster.process_id} of {cluster.num_processes} could not join the "
                f"coordinator at {cluster.coordinator} within {cluster.init_timeout_s}s: {exc}"
            ) from exc
        return f"env: process {cluster.process_id} of {cluster.num_processes}"
    if on_tpu_vm():
        global _processes_per_slice
        env = os.environ if env is None else env
        timeout = (_int_env(env, ENV_INIT_TIMEOUT, 1) if env.get(ENV_INIT_TIMEOUT)
                   else DEFAULT_INIT_TIMEOUT_S)
        heartbeat_s = heartbeat_timeout_s(env)
        if env.get("JAX_PLATFORMS", "") == "cpu":  # an emulated TPU VM: CPU collectives
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            coordinator, num_processes, process_id, num_slices = \
                tpu_cluster_from_metadata(timeout)
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the metadata server unreachable, a DNS wait
            raise ClusterUnavailable(
                f"the TPU hosts' cluster could not be read within {timeout}s "
                f"({ENV_INIT_TIMEOUT}): {exc}") from exc
        try:
            jax.distributed.initialize(coordinator_address=coordinator,
                                       num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=timeout,
                                       heartbeat_timeout_seconds=heartbeat_s)
        except Exception as exc:  # noqa: BLE001 - see above
            raise ClusterUnavailable(
                f"the TPU hosts did not all join the distributed runtime within {timeout}s "
                f"({ENV_INIT_TIMEOUT}): {exc}"
            ) from exc
        if num_slices < 1 or num_processes % num_slices:
            raise DistributedError(f"the TPU metadata describes {num_processes} hosts in "
                                   f"{num_slices} slices (MEGASCALE_NUM_SLICES in tpu-env): the "
                                   "host count must be a multiple of the slice count")
        _processes_per_slice = num_processes // num_slices
        return (f"tpu: process {process_id} of {num_processes}, coordinator {coordinator}"
                + (f", {_processes_per_slice} hosts a slice" if _processes_per_slice > 1 else ""))
    return "single-process"


def _quoted(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def _metadata_int(name: str, raw: str | None, source: str, minimum: int,
                  below: int | None = None, default: int | None = None) -> int:
    """An integer the TPU metadata or the pod's environment gives, checked; a value that is not
    one is a DistributedError naming the variable, its value and where it came from (a restart
    reads the same value again, so it is not ClusterUnavailable)."""
    allowed = f"{minimum}..{below - 1}" if below is not None else f">= {minimum}"
    if raw is None:  # absent: JAX's own default where it has one
        if default is None:
            raise DistributedError(f"{name} is not set ({source}); expected an integer "
                                   f"{allowed}")
        return default
    if not raw.strip():  # set, but to nothing: a broken environment, not "absent"
        raise DistributedError(f"{name}='' ({source}): set but empty; expected an integer "
                               f"{allowed}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistributedError(f"{name}={_quoted(raw)} ({source}): expected an integer "
                               f"{allowed}") from None
    if value < minimum or (below is not None and value >= below):
        raise DistributedError(f"{name}={_quoted(raw.strip()).strip(chr(39))} ({source}): "
                               f"expected an integer {allowed}")
    return value


def _host_port(value: str) -> bool:
    """HOST or HOST:PORT with a port of 1..65535, no whitespace."""
    text = value.strip()
    if not text or any(c.isspace() for c in text):
        return False
    host, colon, port = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    return bool(host) and (not colon or (port.isdigit() and 1 <= int(port) <= 65535))


def _worker_list(name: str, raw: str, source: str, endpoints: bool) -> list[str]:
    """The slice's workers: hostnames (GKE), or the VM metadata's entries, each a hostname or
    NAME:ID:IP as JAX's Cloud TPU cluster reads them."""
    workers = []
    for entry in raw.split(","):
        parts = entry.strip().split(":") if endpoints else [entry.strip()]
        address = parts[0] if len(parts) == 1 else parts[2] if len(parts) == 3 else ""
        if not address or any(c.isspace() for c in address):
            form = "HOST or NAME:ID:IP entries" if endpoints else "hostnames"
            raise DistributedError(f"{name}={_quoted(raw)} ({source}): entry {_quoted(entry)} "
                                   f"is not one of the comma-separated {form} expected")
        workers.append(address)
    return workers


def _tpu_env_lines(text: str) -> dict[str, str]:
    """tpu-env's `KEY: 'value'` lines, read as JAX's get_tpu_env_value reads them."""
    values = {}
    for line in text.split("\n"):
        if ":" in line:
            key, value = line.split(":", 1)
            values[key.strip()] = value.strip().strip("'")
    return values


def tpu_cluster_from_metadata(timeout_s: int) -> tuple[str, int, int, int]:
    """(coordinator, process count, process id, slice count) from what JAX's own Cloud TPU
    cluster code reads (what `jax.distributed.initialize()` uses when libtpu finds the chips):
    the pod's environment when it lists the slice's workers, as JAX checks, else the TPU VM's
    metadata. Process id = worker number + slice id x hosts a slice. Every value is checked
    first: a malformed one is a DistributedError naming it (exit 2), never a wait for hosts; an
    attribute the metadata server answers with an error status is ClusterUnavailable (exit 4, a
    restart reads it again), never a value."""
    from jax._src.clusters.cloud_tpu_cluster import (
        GceTpuCluster,
        GkeTpuCluster,
        get_metadata,
        get_tpu_env_value,
    )

    def vm_attribute(key: str) -> str:
        # JAX's reader returns whatever body the server sent after its retries: an error page
        # read as tpu-env would make this host a job of one slice that trains alone.
        text, status = get_metadata(key)
        if status != 200:
            raise ClusterUnavailable(f"the TPU VM's metadata attribute {key} could not be read "
                                     f"(HTTP {status}: {_quoted(text.strip(), 60)})")
        return text

    hostnames = GkeTpuCluster._get_worker_host_names_env_var()
    on_gke = hostnames is not None
    tpu_env = "the pod's environment" if on_gke else "tpu-env in the TPU VM's metadata"
    if on_gke:
        env_value = get_tpu_env_value
    else:
        vm_env = _tpu_env_lines(vm_attribute("tpu-env"))
        env_value = lambda key: os.environ.get(key, vm_env.get(key))  # noqa: E731 - JAX's order
    num_slices = _metadata_int("MEGASCALE_NUM_SLICES", env_value("MEGASCALE_NUM_SLICES"),
                               tpu_env, 1, default=1)
    slice_id = _metadata_int("MEGASCALE_SLICE_ID", env_value("MEGASCALE_SLICE_ID"),
                             tpu_env, 0, below=num_slices, default=0)
    coordinator_host = env_value("MEGASCALE_COORDINATOR_ADDRESS")
    if coordinator_host is not None and not _host_port(coordinator_host):
        raise DistributedError(f"MEGASCALE_COORDINATOR_ADDRESS={_quoted(coordinator_host)} "
                               f"({tpu_env}): expected HOST or HOST:PORT (port 1..65535)")
    if on_gke:
        name = ("TPU_PROCESS_ADDRESSES" if os.environ.get("TPU_PROCESS_ADDRESSES") is not None
                else "TPU_WORKER_HOSTNAMES")
        workers = _worker_list(name, hostnames, "the pod's environment", endpoints=False)
        worker = _metadata_int("TPU_WORKER_ID", os.environ.get("TPU_WORKER_ID"),
                               "the pod's environment", 0, below=len(workers))
        cluster = GkeTpuCluster
    else:
        workers = _worker_list("worker-network-endpoints",
                               vm_attribute("worker-network-endpoints"),
                               "the TPU VM's metadata", endpoints=True)
        worker = _metadata_int("agent-worker-number", vm_attribute("agent-worker-number"),
                               "the TPU VM's metadata", 0, below=len(workers))
        cluster = GceTpuCluster
    # The coordinator as JAX finds it (MEGASCALE_COORDINATOR_ADDRESS, else the slice's first
    # worker), once its name resolves: not resolving in time is ClusterUnavailable.
    coordinator = cluster.get_coordinator_address(timeout_s, None)
    return (coordinator, len(workers) * num_slices, worker + slice_id * len(workers),
            num_slices)


def check_expected(groups: Mapping[int, list], expect_slices: int,
                   expect_devices_per_slice: int) -> None:
    """Fail naming the missing slices and the short ones (with the hosts they do have).

    `groups` maps slice index -> its devices (see mesh.devices_by_slice).
    """
    problems = []
    missing = [s for s in range(expect_slices) if s not in groups]
    if missing:
        problems.append(f"missing slices {missing}")
    for index, devices in sorted(groups.items()):
        hosts = sorted({d.process_index for d in devices})
        if index >= expect_slices:
            problems.append(f"unexpected slice {index} (hosts {hosts})")
        elif len(devices) != expect_devices_per_slice:
            problems.append(
                f"slice {index} has {len(devices)} of {expect_devices_per_slice} devices "
                f"(hosts {hosts})"
            )
    if problems:
        raise DistributedError(
            f"expected {expect_slices} slices x {expect_devices_per_slice} devices, found "
            f"{len(groups)} slices with {sum(len(d) for d in groups.values())} devices: "
            + "; ".join(problems)
        )


def check_same_spec(env: Mapping[str, str] | None = None) -> int | None:
    """All processes run the same launch spec generation (MULTISLICE_SPEC_GENERATION), or
    SpecMismatch: no job trains with a mix of old and new code or settings. A collective; returns
    the generation (None where the variable is not set, as under `multislice local`)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_SPEC_GENERATION, "")
    if not raw:
        return None
    try:
        generation = int(raw)
    except ValueError:
        raise DistributedError(f"{ENV_SPEC_GENERATION}={raw!r}: expected an integer") from None
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        # Two 31-bit halves: collectives carry int32 unless x64 is on.
        row = np.asarray([generation >> 31, generation & 0x7FFFFFFF], dtype=np.int32)
        seen = np.asarray(multihost_utils.process_allgather(row)).tolist()
        generations = [(hi << 31) | lo for hi, lo in seen]
        if len(set(generations)) > 1:
            by_process = ", ".join(f"process {p}: {g}" for p, g in enumerate(generations))
            raise SpecMismatch(f"the hosts run different launch spec generations ({by_process}); "
                               "not training a mixed job: each host reads the spec again")
    return generation
