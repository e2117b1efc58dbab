import pytest

from infra.stack_config.topology import (
    UnknownAcceleratorError,
    flop_per_dcn_bit_per_host,
    known_families,
    parse_accelerator_type,
)


@pytest.mark.parametrize(
    ("name", "chips", "hosts", "devices"),
    [
        ("v4-8", 4, 1, 4),
        ("v4-16", 8, 2, 8),
        ("v4-128", 64, 16, 64),
        ("v5p-8", 4, 1, 4),
        ("v5p-128", 64, 16, 64),
        ("v5litepod-1", 1, 1, 1),
        ("v5litepod-4", 4, 1, 4),
        ("v5litepod-8", 8, 1, 8),
        ("v5litepod-16", 16, 4, 16),
        ("v5litepod-256", 256, 64, 256),
        ("v6e-8", 8, 1, 8),
        ("v6e-32", 32, 8, 32),
    ],
)
def test_accelerator_names_count_chips_hosts_and_devices(name, chips, hosts, devices):
    topo = parse_accelerator_type(name)
    assert (topo.chips, topo.hosts, topo.devices) == (chips, hosts, devices)
    assert topo.hosts * topo.chips_per_host == topo.chips


def test_v5e_alias_is_canonicalised_to_v5litepod():
    assert parse_accelerator_type("v5e-16").accelerator_type == "v5litepod-16"


def test_seed_v4_flop_per_dcn_bit_is_22000():
    assert flop_per_dcn_bit_per_host(parse_accelerator_type("v4-32")) == pytest.approx(22_000)


def test_eight_chip_single_host_has_twice_the_dcn_of_a_four_chip_host():
    eight = parse_accelerator_type("v5litepod-8")
    sixteen = parse_accelerator_type("v5litepod-16")
    assert eight.host_dcn_bits_per_s == 2 * sixteen.host_dcn_bits_per_s
    assert flop_per_dcn_bit_per_host(eight) == pytest.approx(flop_per_dcn_bit_per_host(sixteen))


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("v3-8", "needs v4 or later"),
        ("v8x-8", "unknown TPU family 'v8x'"),
        ("v4-12", "valid sizes: 8, 16"),
        ("tpu", "not of the form FAMILY-SIZE"),
    ],
)
def test_unknown_names_fail_listing_known_families(name, fragment):
    with pytest.raises(UnknownAcceleratorError) as err:
        parse_accelerator_type(name)
    assert fragment in str(err.value)
    assert name in str(err.value)
    if "valid sizes" not in fragment:
        assert all(f in str(err.value) for f in known_families())
