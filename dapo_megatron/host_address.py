"""Which address of this host another host can reach it on, and which interface carries it.

Standard library only (``slurm/launch_plan.py`` uses it on nodes that may lack the project's dependencies).

A host name is no answer: on many machines it resolves to a loopback address (Debian's ``127.0.1.1`` line in
/etc/hosts), or not at all (cluster nodes known to SLURM only by NodeAddr). The answer here is the one the kernel
gives: the source address of the route towards the peer (:func:`address_towards`). Two uses:

* the rendezvous of the weight-update group, which SGLang servers on other nodes dial — it must be an address of
  trainer rank 0 that routes to them, not ``127.0.0.1`` (each server would dial its own loopback and the trainer
  would wait out its timeout);
* gloo's interface (``GLOO_SOCKET_IFNAME``, :func:`pin_gloo_interface`): without it gloo binds the address the host
  name resolves to, and falls back to loopback when it resolves to nothing, so peers on other nodes cannot connect.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import MutableMapping
from urllib.parse import urlsplit

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_DISCARD_PORT = 9  # any port: connecting a UDP socket sends nothing, it only picks the route


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (an address is returned as it is)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise OSError(f"cannot resolve host {host!r}: {error.strerror}") from None


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer``: the address ``peer`` can reach this host on."""
    address = resolve(peer)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, _DISCARD_PORT))
        except OSError as error:
            raise OSError(f"no route from this host to {peer!r}: {error.strerror or error}") from None
        return probe.getsockname()[0]


def weight_update_address(server_url: str, override: str | None = None) -> str:
    """Where SGLang servers dial trainer rank 0 for the weight-update group: ``override`` (the config's
    ``rollout.sglang.weight_update_address``) when set, else this host's address on the route to the server (for
    servers on this host that is their loopback address)."""
    return override or address_towards(urlsplit(server_url).hostname or server_url)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def interface_with_address(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address`` (None when no interface does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def pin_gloo_interface(peer: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``peer`` (the rendezvous host; this host itself is
    fine: its own address is on that interface), unless it is set already or the route is loopback (a one-host
    world, where gloo's default works). Returns the interface chosen, or None when nothing was set."""
    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    address = address_towards(peer)
    if is_loopback(address):
        return None
    interface = interface_with_address(address)
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    return interface
