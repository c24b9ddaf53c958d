"""This host's network: free ports and the interface that holds an address."""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(count: int, tries: int = 100) -> range:
    """``count`` consecutive TCP ports nothing is bound to now on any interface (the caveat of free_port holds for
    each)."""
    for _ in range(tries):
        ports = range(first := free_port(), first + count)
        if ports[-1] < 1 << 16 and all(_bindable(port) for port in ports[1:]):
            return ports
    raise RuntimeError(f"no {count} consecutive free TCP ports found in {tries} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def interface_of(ip: str) -> str | None:
    """The network interface whose (primary) IPv4 address is ``ip`` on this host, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None
