"""Catalog of Cloud TPU generations that support Multislice, and accelerator-type parsing.

No pulumi import: the CLI planner and the offline render use this module too.

Sources for the per-generation numbers (Cloud TPU system architecture pages, 2025-2026):
  docs.cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e, and the Multislice overview seed.
Host DCN bandwidth is the one number the pages do not state uniformly; each entry says how it was
obtained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024**3
MAX_SLICES = 256  # slices in one Multislice queued resource (the toolkit's limit)


class UnknownAcceleratorError(ValueError):
    """The accelerator-type name is not one this toolkit knows how to run Multislice on."""


@dataclass(frozen=True)
class Generation:
    """Per-chip and per-host facts about one TPU generation."""

    family: str  # canonical accelerator-type prefix, e.g. "v5litepod"
    aliases: tuple[str, ...]  # other prefixes accepted in names, e.g. ("v5e",)
    counts_tensorcores: bool  # True: the number in the name counts TensorCores (2 per chip)
    tensorcores_per_chip: int
    chips_per_host: int  # chips per VM in a multi-host slice
    single_host_max_chips: int  # slices with at most this many chips fit on one VM
    peak_bf16_tflops_per_chip: float
    hbm_gib_per_chip: float
    host_dcn_gbps: float  # data-center network bandwidth of one TPU VM host
    valid_sizes: tuple[int, ...]  # the numbers that may follow the family prefix
    supports_multislice: bool = True
    default_runtime_version: str = ""
    devices_per_chip: int = 1  # JAX devices a chip shows (v4/v5p: one megacore of 2 cores)
    dcn_source: str = ""  # where host_dcn_gbps comes from, as `multislice plan` prints it
    # Whether the Cloud TPU API (queued resources, TPU VMs) serves it; False: GKE only.
    cloud_tpu_api: bool = True


# v4: 2 TensorCores per chip run as one megacore JAX device; 4 chips per host.
# Host DCN 50 Gbps: the Multislice overview's own worked example ("4 chips x 275 TFLOP/s, 50 Gbps").
V4 = Generation(
    family="v4",
    aliases=(),
    counts_tensorcores=True,
    tensorcores_per_chip=2,
    chips_per_host=4,
    single_host_max_chips=4,
    peak_bf16_tflops_per_chip=275.0,
    hbm_gib_per_chip=32.0,
    host_dcn_gbps=50.0,
    valid_sizes=(8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096),
    default_runtime_version="tpu-ubuntu2204-base",
    dcn_source="the Multislice overview's worked example: 4 chips x 275 TFLOP/s, 50 Gbps a host",
)

# v5e: 1 TensorCore per chip, names count chips. -1/-4/-8 are single-host VMs (1, 4, 8 chips);
# multi-host training slices use 4-chip VMs (ct5lp-hightpu-4t), so v5litepod-16 has 4 hosts.
# Host DCN 100 Gbps: the v5e page gives 6.4 Tbps DCN per 256-chip pod, i.e. 64 four-chip hosts
# x 100 Gbps (consistent with its "2 x 100 Gbps NIC" per 8-chip host).
V5E = Generation(
    family="v5litepod",
    aliases=("v5e",),
    counts_tensorcores=False,
    tensorcores_per_chip=1,
    chips_per_host=4,
    single_host_max_chips=8,
    peak_bf16_tflops_per_chip=197.0,
    hbm_gib_per_chip=16.0,
    host_dcn_gbps=100.0,
    valid_sizes=(1, 4, 8, 16, 32, 64, 128, 256),
    default_runtime_version="v2-alpha-tpuv5-lite",
    dcn_source="Cloud TPU's v5e page: 6.4 Tbps DCN per 256-chip pod, 64 four-chip hosts",
)

# v5p: like v4, names count TensorCores (v5p-8 = 4 chips = 1 host).
# Host DCN 200 Gbps: the v5p page lists 50 Gbps DCN per chip, x 4 chips per host.
V5P = Generation(
    family="v5p",
    aliases=(),
    counts_tensorcores=True,
    tensorcores_per_chip=2,
    chips_per_host=4,
    single_host_max_chips=4,
    peak_bf16_tflops_per_chip=459.0,
    hbm_gib_per_chip=95.0,
    host_dcn_gbps=200.0,
    valid_sizes=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288),
    default_runtime_version="v2-alpha-tpuv5",
    dcn_source="Cloud TPU's v5p page: 50 Gbps DCN per chip, 4 chips a host",
)

# v6e (Trillium): names count chips; same slice shapes and host layout as v5e.
# Host DCN 400 Gbps: the TPU7x page's comparison table gives v6e 100 Gbps DCN per chip (and the
# v6e page's 25.6 Tbps per 256-chip pod agrees: 64 four-chip hosts x 400 Gbps).
V6E = Generation(
    family="v6e",
    aliases=(),
    counts_tensorcores=False,
    tensorcores_per_chip=1,
    chips_per_host=4,
    single_host_max_chips=8,
    peak_bf16_tflops_per_chip=918.0,
    hbm_gib_per_chip=32.0,
    host_dcn_gbps=400.0,
    valid_sizes=(1, 4, 8, 16, 32, 64, 128, 256),
    default_runtime_version="v2-alpha-tpuv6e",
    dcn_source="Cloud TPU's TPU7x page, its v6e column: 100 Gbps DCN per chip, 4 chips a host",
)

# TPU7x (Ironwood), Cloud TPU's "TPU7x (Ironwood)" page (docs.cloud.google.com/tpu/docs/tpu7x,
# read 2026-12): two TensorCores per chip, and "the Ironwood programming model lets you access two
# TPU devices instead of the single logical core (megacore)": 2 JAX devices a chip; 2307 bf16
# TFLOP/s and 192 GiB HBM per chip; DCN 100 Gbps per chip, so 400 Gbps per 4-chip VM; 4 chips
# per VM ("About Ironwood (TPU7x) in GKE": "each VM contains 4 chips and 2 NICs"). Names count
# TensorCores as v5p's do: tpu7x-8 is one 2x2x1 VM, tpu7x-128 a 4x4x4 cube of 16 VMs (xpk's
# accelerator table: device_type tpu7x-8 / tpu7x-128, machine type tpu7x-standard-4t). The page
# says "To use TPU7x, you must use Google Kubernetes Engine (GKE)" and the Multislice overview
# that the Cloud TPU API is not supported on TPU7x: no queued resource serves it. Sizes: the
# topologies GKE, xpk and the TPU recipes name for it (infra/gke/topology.py).
TPU7X = Generation(
    family="tpu7x",
    aliases=("v7x",),
    counts_tensorcores=True,
    tensorcores_per_chip=2,
    chips_per_host=4,
    single_host_max_chips=4,
    peak_bf16_tflops_per_chip=2307.0,
    hbm_gib_per_chip=192.0,
    host_dcn_gbps=400.0,
    valid_sizes=(8, 16, 128, 256, 512),
    devices_per_chip=2,
    cloud_tpu_api=False,
    dcn_source="Cloud TPU's TPU7x page: 100 Gbps DCN per chip, 4 chips a VM",
)

# Generations before v4 exist as names but cannot form a Multislice; kept so the error says so.
_PRE_MULTISLICE = ("v2", "v3")

GENERATIONS: tuple[Generation, ...] = (V4, V5E, V5P, V6E, TPU7X)


@dataclass(frozen=True)
class SliceTopology:
    """One slice of a given accelerator type: how many chips, hosts and JAX devices it has."""

    accelerator_type: str  # canonical name, e.g. "v5litepod-16"
    generation: Generation
    size: int  # the number in the name
    chips: int
    hosts: int
    chips_per_host: int
    devices: int  # JAX devices per slice (v4/v5p megacore: one a chip; TPU7x: two a chip)

    @property
    def family(self) -> str:
        return self.generation.family

    @property
    def peak_bf16_flops_per_chip(self) -> float:
        return self.generation.peak_bf16_tflops_per_chip * 1e12

    @property
    def hbm_bytes_per_chip(self) -> int:
        return int(self.generation.hbm_gib_per_chip * GIB)

    @property
    def host_dcn_bits_per_s(self) -> float:
        # An 8-chip single-host VM (v5e/v6e -8) has twice the NICs of a 4-chip one; smaller VMs
        # are counted at the 4-chip figure (an upper bound).
        scale = max(1.0, self.chips_per_host / self.generation.chips_per_host)
        return self.generation.host_dcn_gbps * 1e9 * scale

    @property
    def peak_bf16_flops_per_slice(self) -> float:
        return self.chips * self.peak_bf16_flops_per_chip


def known_families() -> list[str]:
    names: list[str] = []
    for gen in GENERATIONS:
        names.append(gen.family)
        names.extend(gen.aliases)
    return names


def _generation_for_prefix(prefix: str) -> Generation | None:
    for gen in GENERATIONS:
        if prefix == gen.family or prefix in gen.aliases:
            return gen
    return None


_NAME_RE = re.compile(r"^(?P<prefix>[a-z0-9]+?)-(?P<size>\d+)$")


def parse_accelerator_type(name: str) -> SliceTopology:
    """Parse an accelerator-type name such as ``v4-8`` or ``v5litepod-16`` into its topology.

    Raises UnknownAcceleratorError naming the value and what is allowed.
    """
    text = name.strip().lower()
    match = _NAME_RE.match(text)
    if not match:
        raise UnknownAcceleratorError(
            f"accelerator_type {name!r} is not of the form FAMILY-SIZE; "
            f"known families: {', '.join(known_families())} (e.g. v4-8, v5litepod-16)"
        )
    prefix, size = match.group("prefix"), int(match.group("size"))
    gen = _generation_for_prefix(prefix)
    if gen is None:
        if prefix in _PRE_MULTISLICE:
            raise UnknownAcceleratorError(
                f"accelerator_type {name!r}: TPU {prefix} cannot run Multislice, which needs v4 "
                f"or later; known families: {', '.join(known_families())}"
            )
        raise UnknownAcceleratorError(
            f"accelerator_type {name!r}: unknown TPU family {prefix!r}; "
            f"known families: {', '.join(known_families())}"
        )
    if size not in gen.valid_sizes:
        raise UnknownAcceleratorError(
            f"accelerator_type {name!r}: {gen.family} has no slice of size {size}; "
            f"valid sizes: {', '.join(str(s) for s in gen.valid_sizes)}"
        )
    chips = size // gen.tensorcores_per_chip if gen.counts_tensorcores else size
    if chips <= gen.single_host_max_chips:
        hosts, chips_per_host = 1, chips
    else:
        hosts, chips_per_host = chips // gen.chips_per_host, gen.chips_per_host
    return SliceTopology(
        accelerator_type=f"{gen.family}-{size}",
        generation=gen,
        size=size,
        chips=chips,
        hosts=hosts,
        chips_per_host=chips_per_host,
        devices=chips * gen.devices_per_chip,
    )


def flop_per_dcn_bit_per_host(topology: SliceTopology) -> float:
    """Peak bf16 FLOP a host can do in the time it sends one bit over DCN.

    The seed's budget: v4 gives 4 chips x 275e12 / 50e9 = 22,000. A multi-host slice uses the
    full-host chip count; a single-host slice counts the chips it actually has.
    """
    host_flops = topology.chips_per_host * topology.peak_bf16_flops_per_chip
    return host_flops / topology.host_dcn_bits_per_s


# Zones listed as offering each generation (Cloud TPU "regions and zones" page, read 2026-12;
# single-tenant-only zones included). Capacity changes: a zone missing here is a warning at
# preview, never an error.
ZONES: dict[str, tuple[str, ...]] = {
    "v4": ("us-central2-b",),
    "v5litepod": (
        "us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a", "us-east5-a", "us-east5-b",
        "us-east5-c", "europe-west4-b", "asia-southeast1-b",
    ),
    "v5p": ("us-central1-a", "us-east5-a", "us-east5-b", "us-east5-c", "us-south1-a",
            "europe-west4-b"),
    "v6e": ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "us-east5-c", "us-east4-a",
            "us-east4-b", "us-west1-c", "europe-west4-a", "asia-northeast1-b"),
    # TPU7x is reached through the account team; the zone its GKE examples and the TPU recipes
    # use (a warning only, like every entry here).
    "tpu7x": ("us-central1-c",),
}

# Software images that name the generation they are built for (TPU software versions page).
# tpu-ubuntu2204-base is the image for v2, v3 and v4; of those only v4 can run Multislice.
_RUNTIME_MARKERS: tuple[tuple[re.Pattern[str], Generation], ...] = (
    (re.compile(r"tpuv5-lite|v5litepod|v5e"), V5E),
    (re.compile(r"tpuv6e|v6e"), V6E),
    (re.compile(r"tpuv5(?!-lite)|v5p"), V5P),
    (re.compile(r"tpuv4|-v4-|^tpu-ubuntu2204-base$"), V4),
)


def zones_offering(generation: Generation) -> tuple[str, ...]:
    return ZONES.get(generation.family, ())


def runtime_version_generation(version: str) -> Generation | None:
    """The generation a runtime version is built for, when its name says; else None."""
    for pattern, generation in _RUNTIME_MARKERS:
        if pattern.search(version):
            return generation
    return None
