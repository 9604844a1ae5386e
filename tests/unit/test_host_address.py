"""dapo_megatron.host_address: this host's address towards a peer, the interface holding an address, and the gloo
interface pin — against this machine's real interfaces (``ip -o -4 addr`` is the independent reference). The
cross-node behaviour (servers on other nodes dialling it) is tested on the namespace cluster in
test_slurm_multinode.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dapo_megatron.host_address import (address_towards, interface_with_address, is_loopback, pin_gloo_interface,
                                        weight_update_address)


def _interfaces() -> dict[str, str]:
    """IPv4 address -> interface, as iproute2 lists them."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed: no independent list of this machine's addresses")
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        words = line.split()
        found[words[words.index("inet") + 1].split("/")[0]] = words[1]
    return found


def _routable() -> tuple[str, str]:
    routable = [(address, name) for address, name in _interfaces().items() if not is_loopback(address)]
    if not routable:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return routable[0]


def test_every_address_maps_to_the_interface_that_holds_it():
    for address, name in _interfaces().items():
        assert interface_with_address(address) == name, (address, name)
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_towards_loopback_is_loopback_and_towards_an_own_address_is_that_address():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    address, _ = _routable()
    assert address_towards(address) == address


def test_unresolvable_peer_is_named():
    with pytest.raises(OSError, match="cannot resolve host 'no-such-host.invalid'"):
        address_towards("no-such-host.invalid")


def test_gloo_interface_is_pinned_towards_a_routable_peer_only():
    address, name = _routable()
    env: dict[str, str] = {}
    assert pin_gloo_interface(address, env) == name and env == {"GLOO_SOCKET_IFNAME": name}
    loopback_env: dict[str, str] = {}
    assert pin_gloo_interface("127.0.0.1", loopback_env) is None and loopback_env == {}  # one host: gloo's default
    chosen = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert pin_gloo_interface(address, chosen) is None and chosen == {"GLOO_SOCKET_IFNAME": "ib0"}  # user's choice


def test_weight_update_address_routes_to_the_servers_unless_overridden():
    """The distributed transport's rendezvous (used by SGLangEngine; the cross-node case and its control — the old
    127.0.0.1 — are the namespace-cluster tests in test_slurm_multinode.py)."""
    assert weight_update_address("http://127.0.0.1:30000") == "127.0.0.1"  # servers launched on this host
    address, _ = _routable()
    assert weight_update_address(f"http://{address}:30000") == address
    assert weight_update_address(f"http://{address}:30000", override="10.1.2.3") == "10.1.2.3"

