"""How an accelerator type becomes a GKE TPU slice node pool: machine type, topology, nodes.

No pulumi import: the schema's checks, the offline render and `multislice plan` use it too.

Sources (read 2026-12):
  - GKE "Plan TPUs in GKE" (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus): the
    machine type and topology of each TPU version, and which of them are single-host.
  - GKE "Deploy TPU Multislice in GKE" (cloud.google.com/kubernetes-engine/docs/how-to/
    tpu-multislice): "Multislice only supports multi-host TPU slice node pools", with
    ct4p-hightpu-4t 2x2x1 and ct5lp-hightpu-4t 2x2 as its examples of what is refused; the slices
    of one multislice share one TPU type, size and topology.
  - The node labels and the `google.com/tpu` resource: GKE "About TPUs in GKE" and JobSet's
    "TPU Multislice Training with JobSet" (jobset.sigs.k8s.io/docs/tasks/tpu_multislice).
  - Cross-checked entry by entry against xpk's accelerator table (AI-Hypercomputer/xpk,
    src/xpk/core/system_characteristics.py, 2026-06): same label, machine type, topology and
    nodes for every multi-host type below.
  - TPU7x: GKE's "About Ironwood (TPU7x) in GKE" (kubernetes-engine/docs/concepts/
    tpu-ironwood): GKE Standard from 1.34.0-gke.2201000; a multi-host TPU7x slice node pool is
    placed by a workload policy (a Compute Engine resource policy of type HIGH_THROUGHPUT with
    the accelerator topology), given as the node pool's placement policy, which "replaces the
    --tpu-topology flag used by other TPU versions"; each VM has 4 chips. The node label value
    tpu7x and machine type tpu7x-standard-4t are xpk's (SystemCharacteristics gke_accelerator
    and gce_machine_type), which creates one workload policy per topology for a multi-host pool.
    Topologies: those GKE, xpk and the TPU recipes run (2x2x2, 4x4x4, 4x4x8, 4x8x8).
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.stack_config.topology import SliceTopology

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"
CHIPS_PER_NODE = 4  # every multi-host TPU machine type below has 4 chips per VM


@dataclass(frozen=True)
class GkeFamily:
    """What GKE calls one TPU generation."""

    accelerator: str  # value of the node label cloud.google.com/gke-tpu-accelerator
    machine_type: str  # the multi-host machine type (4 chips per VM)
    topologies: dict[int, str]  # chips per slice -> the topology GKE's tables give for it
    # A multi-host pool is placed by a workload policy (HIGH_THROUGHPUT, the topology) that the
    # node pool names, instead of a placement policy with tpu_topology (TPU7x).
    workload_policy: bool = False
    min_gke_version: str = ""  # the GKE version from which GKE runs it ("": the multislice floor)


_TOPOLOGIES_2D = {8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TOPOLOGIES_3D = {
    8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8",
    768: "8x8x12", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16", 6144: "16x16x24",
}

GKE_FAMILIES: dict[str, GkeFamily] = {
    "v4": GkeFamily("tpu-v4-podslice", "ct4p-hightpu-4t",
                    {k: v for k, v in _TOPOLOGIES_3D.items() if k <= 2048}),
    "v5litepod": GkeFamily("tpu-v5-lite-podslice", "ct5lp-hightpu-4t", _TOPOLOGIES_2D),
    "v5p": GkeFamily("tpu-v5p-slice", "ct5p-hightpu-4t", _TOPOLOGIES_3D),
    # GKE's TPU planning page: v6e from 1.31.2-gke.1115000
    "v6e": GkeFamily("tpu-v6e-slice", "ct6e-standard-4t", _TOPOLOGIES_2D,
                     min_gke_version="1.31.2-gke.1115000"),
    "tpu7x": GkeFamily("tpu7x", "tpu7x-standard-4t",
                       {8: "2x2x2", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"},
                       workload_policy=True, min_gke_version="1.34.0-gke.2201000"),
}


class GkeTopologyError(ValueError):
    """The accelerator type has no multi-host GKE node pool."""


@dataclass(frozen=True)
class GkeSlice:
    """One slice as a GKE node pool."""

    accelerator_type: str  # the stack's canonical name, e.g. v5litepod-16
    accelerator: str  # cloud.google.com/gke-tpu-accelerator
    machine_type: str
    topology: str  # cloud.google.com/gke-tpu-topology and the node pool's tpu_topology
    nodes: int  # nodes (TPU VMs, one pod each) per slice
    chips_per_node: int
    workload_policy: bool = False  # placed by a workload policy the pool names (TPU7x)

    @property
    def chips(self) -> int:
        return self.nodes * self.chips_per_node


def gke_slice(topo: SliceTopology) -> GkeSlice:
    """The node pool shape of one slice; GkeTopologyError names why a type has none."""
    family = GKE_FAMILIES.get(topo.family)
    if family is None:
        raise GkeTopologyError(
            f"accelerator_type: {topo.accelerator_type!r} has no GKE TPU node pool mapping; "
            f"GKE families here: {', '.join(GKE_FAMILIES)}")
    if topo.chips < 2 * CHIPS_PER_NODE:
        multi = [f"{topo.family}-{_size(topo, c)}" for c in sorted(family.topologies)[:2]]
        raise GkeTopologyError(
            f"accelerator_type: {topo.accelerator_type!r} is a single-host slice ({topo.chips} "
            "chips, one VM); GKE runs multislice on multi-host TPU slice node pools only "
            f"(GKE's multislice page); use a multi-host type such as {' or '.join(multi)}")
    topology = family.topologies.get(topo.chips)
    if topology is None:
        raise GkeTopologyError(
            f"accelerator_type: {topo.accelerator_type!r} ({topo.chips} chips) has no GKE TPU "
            f"topology in this toolkit's table; {topo.family} node pools here: "
            + ", ".join(f"{topo.family}-{_size(topo, c)} ({t})"
                        for c, t in sorted(family.topologies.items())))
    return GkeSlice(
        accelerator_type=topo.accelerator_type,
        accelerator=family.accelerator,
        machine_type=family.machine_type,
        topology=topology,
        nodes=topo.chips // CHIPS_PER_NODE,
        chips_per_node=CHIPS_PER_NODE,
        workload_policy=family.workload_policy,
    )


def _size(topo: SliceTopology, chips: int) -> int:
    """The number in the accelerator-type name of a slice of `chips` chips of topo's family."""
    return chips * topo.generation.tensorcores_per_chip if topo.generation.counts_tensorcores \
        else chips
