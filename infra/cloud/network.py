"""VPC for the slices: no auto subnets, MTU 8896, slice-to-slice firewall, optional IAP SSH, NAT."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.stack_config.manifest import IAP_SOURCE_RANGE, NETWORK_MTU

# All protocols between slice VMs, no port list: the JAX/megascale ports moved between releases
# (8476 -> 8482 coordinator, 8471, 8080, ...), and a port list would break on upgrade.
SLICE_PROTOCOLS = ("tcp", "udp", "icmp")


@dataclass
class NetworkArgs:
    """What SliceNetwork creates; every name is a GCP name from infra/stack_config/names.py."""

    project: str
    """Google Cloud project id."""
    region: str
    """Region of the subnet, router and NAT (the slices' zone is in it)."""
    subnet_cidr: str
    """Private IPv4 range of the one subnet (every TPU VM of every slice gets an address here)."""
    slice_tag: str
    """Network tag on every TPU VM: the internal rule opens all TCP/UDP/ICMP between these only."""
    ssh_from_iap: bool
    """Also allow SSH (tcp:22), only from the IAP range 35.235.240.0/20."""
    network_name: str
    """VPC name (MTU 8896, no auto subnets)."""
    subnet_name: str
    """Subnet name (Private Google Access on, so VMs without external IPs reach GCS)."""
    firewall_internal_name: str
    """Name of the slice-to-slice ingress rule."""
    firewall_iap_ssh_name: str
    """Name of the IAP SSH rule (created only with ssh_from_iap)."""
    router_name: str
    """Cloud Router carrying the NAT."""
    nat_name: str
    """Cloud NAT: egress for VMs without external IPs (PyPI, the TPU API)."""
    nat: bool = True
    """False (multislice:egress: none): no router and no NAT; the hosts reach Google's APIs
    through Private Google Access only."""


class SliceNetwork(pulumi.ComponentResource):
    network: gcp.compute.Network
    subnet: gcp.compute.Subnetwork

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.network = gcp.compute.Network(
            args.network_name,  # logical name = GCP name (infra/stack_config/names.py)
            name=args.network_name,
            project=args.project,
            auto_create_subnetworks=False,
            mtu=NETWORK_MTU,
            routing_mode="REGIONAL",
            opts=child,
        )
        self.subnet = gcp.compute.Subnetwork(
            args.subnet_name,
            name=args.subnet_name,
            project=args.project,
            region=args.region,
            network=self.network.id,
            ip_cidr_range=args.subnet_cidr,
            private_ip_google_access=True,  # GCS without external IPs
            opts=child,
        )
        self.firewall_internal = gcp.compute.Firewall(
            args.firewall_internal_name,
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
                args.firewall_iap_ssh_name,
                name=args.firewall_iap_ssh_name,
                project=args.project,
                network=self.network.id,
                direction="INGRESS",
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=["22"])],
                source_ranges=[IAP_SOURCE_RANGE],
                target_tags=[args.slice_tag],
                opts=child,
            )
        self.router: gcp.compute.Router | None = None
        self.nat: gcp.compute.RouterNat | None = None
        if args.nat:
            self._nat(args, child)
        self.register_outputs(
            {"network": self.network.id, "subnet": self.subnet.id,
             "nat": self.nat.id if self.nat is not None else None}
        )

    def _nat(self, args: NetworkArgs, child: pulumi.ResourceOptions) -> None:
        """Egress to the internet for hosts without external IPs (multislice:egress: nat)."""
        self.router = gcp.compute.Router(
            args.router_name,
            name=args.router_name,
            project=args.project,
            region=args.region,
            network=self.network.id,
            opts=child,
        )
        self.nat = gcp.compute.RouterNat(
            args.nat_name,
            name=args.nat_name,
            project=args.project,
            region=args.region,
            router=self.router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
            log_config=gcp.compute.RouterNatLogConfigArgs(enable=True, filter="ERRORS_ONLY"),
            opts=child,
        )
