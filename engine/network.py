"""This host's network: free ports and the interface that holds an address."""

from __future__ import annotations

import fcntl
import random
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Where free_port_range looks: below the kernel's ephemeral range, from which every outgoing connection and every
# port-0 bind (Ray's own listeners, free_port) takes its local port. A port picked in that range at start and
# listened on only later (Serve's fallback proxy, each time a Serve starts in the same Ray) was found taken by one
# of those in between, minutes at a time.
LISTEN_PORTS_LOW = 10000


def ephemeral_ports_low() -> int:
    """The first port of the kernel's ephemeral range (Linux reports it; 32768 is its default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int, tries: int = 200) -> range:
    """``count`` consecutive TCP ports nothing is bound to now on any interface, outside the ephemeral range
    (LISTEN_PORTS_LOW says why; another process may still take one before use, as with free_port)."""
    high = ephemeral_ports_low() - count
    for _ in range(tries):
        ports = range(first := random.randrange(LISTEN_PORTS_LOW, high), first + count)
        if all(_bindable(port) for port in ports):
            return ports
    raise RuntimeError(
        f"no {count} consecutive free TCP ports found in {LISTEN_PORTS_LOW}-{high + count} in {tries} tries"
    )


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
