"""Which address a process's data plane binds to: the node IP Ray knows, or the interface the config names.

Left alone, gloo picks its device from the hostname, which /etc/hosts maps to 127.0.0.1 on many machines
(127.0.1.1 on Debian/Ubuntu): every rank then advertises loopback and no group across hosts connects. NCCL's
socket transport guesses an interface too. So every rank, the client's included, binds explicitly: to the
address of ``data_plane_interface`` when set (machines with several networks), else to its node IP.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from cpattn.errors import DataPlaneError

SIOCGIFADDR = 0x8915   # Linux ioctl: an interface's IPv4 address


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` on this machine, None if it has none (or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(ip: str) -> str | None:
    """The interface holding IPv4 address ``ip`` here (None for IPv6 or an address no interface holds)."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == ip:
            return name
    return None


def bind_address(node_ip: str, interface: str | None) -> tuple[str, str | None]:
    """(address, interface) for this process's data plane: ``interface``'s address when configured, else
    ``node_ip`` (Ray's) and the interface holding it. Raises DataPlaneError naming the interfaces there are."""
    if interface:
        address = interface_address(interface)
        if address is None:
            names = ", ".join(f"{n} ({interface_address(n) or 'no IPv4'})" for _, n in socket.if_nameindex())
            raise DataPlaneError(f"data_plane_interface {interface!r} has no IPv4 address on {socket.gethostname()} "
                                 f"({node_ip}); interfaces there: {names}. Name an interface every node has on the "
                                 "network they share, or unset data_plane_interface to use each node's Ray IP")
        return address, interface
    return node_ip, interface_of(node_ip)


def use_nccl_interface(interface: str | None, explicit: bool) -> None:
    """NCCL's socket transport on ``interface``; a NCCL_SOCKET_IFNAME already set wins unless the config named
    the interface (``explicit``). Process-wide, read when a communicator is created (one node, one address)."""
    if interface and (explicit or "NCCL_SOCKET_IFNAME" not in os.environ):
        os.environ["NCCL_SOCKET_IFNAME"] = interface
