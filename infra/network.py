"""VPC for the slices: no auto subnets, MTU 8896, slice-to-slice firewall, optional IAP SSH, NAT."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.manifest import IAP_SOURCE_RANGE, NETWORK_MTU

# All protocols between slice VMs, no port list: the JAX/megascale ports moved between releases
# (8476 -> 8482 coordinator, 8471, 8080, ...), and a port list would break on upgrade.
SLICE_PROTOCOLS = ("tcp", "udp", "icmp")


@dataclass
class NetworkArgs:
    project: str
    region: str
    subnet_cidr: str
    slice_tag: str
    ssh_from_iap: bool
    network_name: str
    subnet_name: str
    firewall_internal_name: str
    firewall_iap_ssh_name: str
    router_name: str
    nat_name: str


class SliceNetwork(pulumi.ComponentResource):
    network: gcp.compute.Network
    subnet: gcp.compute.Subnetwork

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.network = gcp.compute.Network(
            f"{name}-vpc",
            name=args.network_name,
            project=args.project,
            auto_create_subnetworks=False,
            mtu=NETWORK_MTU,
            routing_mode="REGIONAL",
            opts=child,
        )
        self.subnet = gcp.compute.Subnetwork(
            f"{name}-subnet",
            name=args.subnet_name,
            project=args.project,
            region=args.region,
            network=self.network.id,
            ip_cidr_range=args.subnet_cidr,
            private_ip_google_access=True,  # GCS without external IPs
            opts=child,
        )
        self.firewall_internal = gcp.compute.Firewall(
            f"{name}-allow-internal",
            name=args.firewall_internal_name,
            project=args.project,
            network=self.network.id,
            direction="INGRESS",
            allows=[gcp.compute.FirewallAllowArgs(protocol=p) for p in SLICE_PROTOCOLS],
            source_tags=[args.slice_tag],
            target_tags=[args.slice_tag],
            opts=child,
        )
        self.firewall_iap_ssh: gcp.compute.Firewall | None = None
        if args.ssh_from_iap:
            self.firewall_iap_ssh = gcp.compute.Firewall(
                f"{name}-allow-iap-ssh",
                name=args.firewall_iap_ssh_name,
                project=args.project,
                network=self.network.id,
                direction="INGRESS",
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=["22"])],
                source_ranges=[IAP_SOURCE_RANGE],
                target_tags=[args.slice_tag],
                opts=child,
            )
        self.router = gcp.compute.Router(
            f"{name}-router",
            name=args.router_name,
            project=args.project,
            region=args.region,
            network=self.network.id,
            opts=child,
        )
        self.nat = gcp.compute.RouterNat(
            f"{name}-nat",
            name=args.nat_name,
            project=args.project,
            region=args.region,
            router=self.router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
            log_config=gcp.compute.RouterNatLogConfigArgs(enable=True, filter="ERRORS_ONLY"),
            opts=child,
        )
        self.register_outputs(
            {"network": self.network.id, "subnet": self.subnet.id, "nat": self.nat.id}
        )
