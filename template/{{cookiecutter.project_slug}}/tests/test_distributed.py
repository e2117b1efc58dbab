import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import xla_flags

from trainer.runtime.distributed import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DistributedError,
    check_expected,
    cluster_env,
    heartbeat_timeout_s,
)


def fake_devices(process: int, count: int) -> list:
    return [SimpleNamespace(process_index=process) for _ in range(count)]


def test_cluster_env_absent_means_single_process():
    assert cluster_env({}) is None


def test_cluster_env_parses_all_variables():
    env = {"MULTISLICE_COORDINATOR": "127.0.0.1:1234", "MULTISLICE_NUM_PROCESSES": "2",
           "MULTISLICE_PROCESS_ID": "1", "MULTISLICE_INIT_TIMEOUT_S": "30"}
    cluster = cluster_env(env)
    assert (cluster.coordinator, cluster.num_processes, cluster.process_id,
            cluster.init_timeout_s) == ("127.0.0.1:1234", 2, 1, 30)


def test_cluster_env_rejects_partial_or_bad_values():
    with pytest.raises(DistributedError, match="MULTISLICE_PROCESS_ID missing"):
        cluster_env({"MULTISLICE_COORDINATOR": "h:1", "MULTISLICE_NUM_PROCESSES": "2"})
    with pytest.raises(DistributedError, match="MULTISLICE_PROCESS_ID=2 but "
                                               "MULTISLICE_NUM_PROCESSES=2"):
        cluster_env({"MULTISLICE_COORDINATOR": "h:1", "MULTISLICE_NUM_PROCESSES": "2",
                     "MULTISLICE_PROCESS_ID": "2"})
    with pytest.raises(DistributedError, match="MULTISLICE_NUM_PROCESSES='two'"):
        cluster_env({"MULTISLICE_COORDINATOR": "h:1", "MULTISLICE_NUM_PROCESSES": "two",
                     "MULTISLICE_PROCESS_ID": "0"})


def test_the_heartbeat_timeout_is_jaxs_unless_the_environment_sets_it():
    assert heartbeat_timeout_s({}) == DEFAULT_HEARTBEAT_TIMEOUT_S == 100
    assert heartbeat_timeout_s({"MULTISLICE_HEARTBEAT_TIMEOUT_S": "30"}) == 30
    with pytest.raises(DistributedError, match="MULTISLICE_HEARTBEAT_TIMEOUT_S=0: expected an "
                                               "integer >= 1"):
        heartbeat_timeout_s({"MULTISLICE_HEARTBEAT_TIMEOUT_S": "0"})


_STUCK_IN_A_COLLECTIVE = """
import sys, jax, jax.numpy as jnp
from jax.experimental import multihost_utils
from trainer.runtime.distributed import initialize
initialize()
print("joined", flush=True)
while True:
    multihost_utils.process_allgather(jnp.ones(()))
"""


@pytest.mark.slow
def test_a_process_whose_peer_died_ends_within_the_heartbeat_timeout():
    # The survivor of a killed peer waits in a collective until the coordination service
    # declares the peer dead; on CPU it spins a core meanwhile. MULTISLICE_HEARTBEAT_TIMEOUT_S
    # bounds it (JAX's default: 100 s).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        env = {**os.environ, "MULTISLICE_COORDINATOR": f"127.0.0.1:{port}",
               "MULTISLICE_NUM_PROCESSES": "2", "MULTISLICE_PROCESS_ID": str(pid),
               "MULTISLICE_HEARTBEAT_TIMEOUT_S": "5", "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": xla_flags(1)}
        procs.append(subprocess.Popen([sys.executable, "-c", _STUCK_IN_A_COLLECTIVE],
                                      cwd=Path(__file__).resolve().parents[1], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True))
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "joined"
        time.sleep(1)
        procs[1].kill()
        killed = time.monotonic()
        code = procs[0].wait(timeout=90)
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert code != 0 and waited < 45, (code, waited)


def test_expected_topology_passes_when_complete():
    check_expected({0: fake_devices(0, 4), 1: fake_devices(1, 4)}, 2, 4)


def test_missing_slice_is_named():
    with pytest.raises(DistributedError, match=r"missing slices \[1, 2\]"):
        check_expected({0: fake_devices(0, 4)}, 3, 4)


def test_short_slice_names_its_hosts():
    groups = {0: fake_devices(0, 4), 1: fake_devices(2, 2) + fake_devices(3, 1)}
    with pytest.raises(DistributedError, match=r"slice 1 has 3 of 4 devices \(hosts \[2, 3\]\)"):
        check_expected(groups, 2, 4)


def test_a_coordinator_that_never_answers_is_a_restartable_exit_not_a_config_error(tmp_path):
    # jaxlib's coordination client aborts the process (SIGABRT) when RegisterTask times out;
    # a jax that raises instead gets exit 4. Either is restarted by the startup script and by
    # `multislice local`; exit 2 (config or topology) would not be.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MULTISLICE_COORDINATOR": f"127.0.0.1:{port}",
           "MULTISLICE_NUM_PROCESSES": "2", "MULTISLICE_PROCESS_ID": "1",
           "MULTISLICE_INIT_TIMEOUT_S": "3", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", "1",
         "--run-dir", str(tmp_path / "run")],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
        timeout=120)
    assert result.returncode in (4, -signal.SIGABRT), result.stderr[-2000:]
    if result.returncode == 4:
        assert f"could not join the coordinator at 127.0.0.1:{port} within 3s" in result.stderr
    else:
        assert "RegisterTask" in result.stderr


def test_on_cpu_a_slice_spans_its_hosts_and_only_the_slices_meet_across_dcn(monkeypatch):
    # Two slices of two hosts (processes) each, two devices a host, as an emulated TPU VM of a
    # 2 x v4-16 stack describes itself: the DCN axis splits slices, never the hosts of one.
    from trainer import mesh
    from trainer.runtime import distributed

    devices = [SimpleNamespace(id=i, platform="cpu", device_kind="cpu", process_index=i // 2)
               for i in range(8)]
    monkeypatch.setattr(distributed, "_processes_per_slice", 2)
    assert {s: [d.id for d in g] for s, g in mesh.devices_by_slice(devices).items()} == {
        0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # pipeline, data, fsdp, tensor: fsdp 4 inside a slice, data 2 across slices.
    array = mesh._hybrid_mesh_by_slice((1, 1, 4, 1), (1, 2, 1, 1), devices)
    assert [[d.id for d in row] for row in array[0, :, :, 0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # One host a slice (multislice local): each process is a slice, as JAX's
    # process_is_granule makes it.
    monkeypatch.setattr(distributed, "_processes_per_slice", 1)
    array = mesh._hybrid_mesh_by_slice((1, 1, 2, 1), (1, 4, 1, 1), devices)
    assert [[d.id for d in row] for row in array[0, :, :, 0]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"4 slices \(hosts 1 a slice\) but the DCN axes"):
        mesh._hybrid_mesh_by_slice((1, 1, 4, 1), (1, 2, 1, 1), devices)


def test_tpu_metadata_whose_hosts_do_not_split_into_its_slices_is_a_config_error(monkeypatch):
    import jax

    from trainer.runtime import distributed

    monkeypatch.setattr(distributed, "_processes_per_slice", 1)  # restored after the test
    monkeypatch.setattr(distributed, "on_tpu_vm", lambda: True)
    monkeypatch.setattr(distributed, "tpu_cluster_from_metadata",
                        lambda timeout_s: ("10.0.0.2:8482", 3, 0, 2))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
    with pytest.raises(DistributedError, match=r"describes 3 hosts in 2 slices \(MEGASCALE_NUM_"
                                               r"SLICES in tpu-env\): the host count must be a "
                                               r"multiple of the slice count"):
        distributed.initialize({})
    assert distributed.processes_per_slice() == 1
    monkeypatch.setattr(distributed, "tpu_cluster_from_metadata",
                        lambda timeout_s: ("10.0.0.2:8482", 4, 3, 2))
    assert distributed.initialize({}) == \
        "tpu: process 3 of 4, coordinator 10.0.0.2:8482, 2 hosts a slice"
    assert distributed.processes_per_slice() == 2


def test_a_gke_pod_finds_its_place_from_the_environment_gke_gives_it(monkeypatch):
    # What GKE and JobSet set on the pod of worker 1 of slice 1 (2 pods a slice, 2 slices); the
    # metadata server is unreachable, so nothing may be read from it.
    from trainer.runtime import distributed

    for name, value in {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "ms-x-slice-1-0.ms-x,"
                        "ms-x-slice-1-1.ms-x", "MEGASCALE_NUM_SLICES": "2",
                        "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1",
                        "GCE_METADATA_IP": "127.0.0.1:9"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TPU_PROCESS_ADDRESSES", raising=False)
    assert distributed.tpu_cluster_from_metadata(5) == ("127.0.0.1:8482", 4, 3, 2)


GKE_POD = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "ms-x-slice-1-0.ms-x,ms-x-slice-1-1.ms-x",
           "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
           "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1", "GCE_METADATA_IP": "127.0.0.1:9"}


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TPU_WORKER_ID", "one", r"TPU_WORKER_ID='one' \(the pod's environment\): expected an "
                             r"integer 0\.\.1"),
    ("TPU_WORKER_ID", "2", r"TPU_WORKER_ID=2 \(the pod's environment\): expected an integer "
                           r"0\.\.1"),
    ("TPU_WORKER_HOSTNAMES", "a,,b", r"TPU_WORKER_HOSTNAMES='a,,b' .*entry '' is not one of"),
    ("MEGASCALE_NUM_SLICES", "2x", r"MEGASCALE_NUM_SLICES='2x' \(the pod's environment\): "
                                   r"expected an integer >= 1"),
    ("MEGASCALE_NUM_SLICES", "0", r"MEGASCALE_NUM_SLICES=0 .*expected an integer >= 1"),
    ("MEGASCALE_NUM_SLICES", "", r"MEGASCALE_NUM_SLICES='' \(the pod's environment\): set but "
                                 r"empty; expected an integer >= 1"),
    ("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.2:99999",
     r"MEGASCALE_COORDINATOR_ADDRESS='10\.0\.0\.2:99999' .*HOST:PORT \(port 1\.\.65535\)"),
    ("MEGASCALE_COORDINATOR_ADDRESS", "", r"MEGASCALE_COORDINATOR_ADDRESS='' .*expected HOST"),
    ("MEGASCALE_SLICE_ID", "2", r"MEGASCALE_SLICE_ID=2 .*expected an integer 0\.\.1"),
    ("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.2 10.0.0.3",
     r"MEGASCALE_COORDINATOR_ADDRESS='10\.0\.0\.2 10\.0\.0\.3' .*expected HOST or HOST:PORT"),
    ("TPU_WORKER_ID", "9" * 5000, r"TPU_WORKER_ID='9{20,}\.\.\. \(5000 characters\)"),
    ("TPU_WORKER_ID", "9" * 4000, r"TPU_WORKER_ID=9{20,}\.\.\. \(4000 characters\)"),
], ids=lambda value: value if len(str(value)) < 30 else f"{len(value)} characters")
def test_malformed_gke_pod_values_are_config_errors_naming_the_variable(
        monkeypatch, name, value, message):
    import jax

    from trainer.runtime import distributed

    for key, setting in {**GKE_POD, name: value}.items():
        monkeypatch.setenv(key, setting)
    monkeypatch.delenv("TPU_PROCESS_ADDRESSES", raising=False)
    monkeypatch.setattr(distributed, "on_tpu_vm", lambda: True)
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda **kwargs: pytest.fail("initialize() reached with a bad value"))
    with pytest.raises(DistributedError, match=message) as caught:
        distributed.initialize({})
    assert not isinstance(caught.value, distributed.ClusterUnavailable)  # exit 2, not 4
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(("key", "value", "message"), [
    ("agent-worker-number", "w1", r"agent-worker-number='w1' \(the TPU VM's metadata\): "
                                  r"expected an integer 0\.\.1"),
    ("worker-network-endpoints", "a:b,c:d:10.0.0.3",
     r"worker-network-endpoints='a:b,c:d:10\.0\.0\.3' .*entry 'a:b' is not one of the "
     r"comma-separated HOST or NAME:ID:IP entries"),
    ("tpu-env", "MEGASCALE_NUM_SLICES: 'two'",
     r"MEGASCALE_NUM_SLICES='two' \(tpu-env in the TPU VM's metadata\)"),
])
def test_malformed_tpu_vm_metadata_is_a_config_error_naming_the_key(
        monkeypatch, key, value, message):
    # The values as the metadata server answers them (JAX's own reader fetches them over HTTP:
    # replaced here by what a server would return for this VM).
    from jax._src.clusters import cloud_tpu_cluster

    from trainer.runtime import distributed

    metadata = {"agent-worker-number": "0", "worker-network-endpoints":
                "u:u:10.0.0.2,u:u:10.0.0.3", "tpu-env": "MEGASCALE_NUM_SLICES: '2'\n"
                "MEGASCALE_SLICE_ID: '0'\nMEGASCALE_COORDINATOR_ADDRESS: '10.0.0.2'", key: value}
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES",
                 "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", lambda k: (metadata[k], 200))
    with pytest.raises(DistributedError, match=message):
        distributed.tpu_cluster_from_metadata(5)
    if key == "tpu-env":
        return
    metadata.update({"agent-worker-number": "1",
                     "worker-network-endpoints": "u:u:10.0.0.2,u:u:10.0.0.3"})
    monkeypatch.setattr(cloud_tpu_cluster.GceTpuCluster, "wait_for_coordinator",
                        classmethod(lambda cls, address, timeout: None))
    assert distributed.tpu_cluster_from_metadata(5) == ("10.0.0.2:8482", 4, 1, 2)


@pytest.mark.parametrize("key", ["tpu-env", "worker-network-endpoints", "agent-worker-number"])
def test_a_metadata_attribute_answered_with_an_error_status_is_restartable_not_a_value(
        monkeypatch, key):
    # JAX's reader hands back the error page's body after its retries; read as tpu-env it made
    # the host a one-slice job that trained alone while its peer waited for it.
    from jax._src.clusters import cloud_tpu_cluster

    from trainer.runtime import distributed

    metadata = {"agent-worker-number": ("0", 200),
                "worker-network-endpoints": ("u:u:10.0.0.2,u:u:10.0.0.3", 200),
                "tpu-env": ("MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '0'", 200),
                key: ("upstream connect error", 503)}
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES",
                 "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", lambda k: metadata[k])
    with pytest.raises(distributed.ClusterUnavailable,
                       match=rf"metadata attribute {key} could not be read \(HTTP 503: "
                             r"'upstream connect error'\)"):
        distributed.tpu_cluster_from_metadata(5)
