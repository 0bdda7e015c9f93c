"""Which of this node's addresses the other nodes reach, and on which interface (several-node runs).

torch names a node by ``socket.getfqdn()`` unless told otherwise: the rendezvous hands
that name to every node's workers as ``MASTER_ADDR`` (the store of their process
group), and gloo binds to what the host name resolves to. On a host whose name
resolves to a loopback address (Debian's ``127.0.1.1 node1`` in /etc/hosts, a
container's ``127.0.0.1``) the other nodes then dial their own loopback and wait
for minutes. The address the kernel routes to the master from is one the master's
network can reach, so the launcher passes it (torchrun's ``--local-addr``) and names
its interface to gloo (``GLOO_SOCKET_IFNAME``) unless the user set one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def route_source(host: str, port: int) -> str | None:
    """This machine's source address for packets to ``host`` (None: no route, or it does not resolve).

    A UDP ``connect`` sends nothing; the kernel only picks the route and the source address.
    """
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds ``addr`` (Linux; None where it cannot be told)."""
    if ":" in addr:  # IPv6: /proc/net/if_inet6 lists each address as 32 hex digits, the name last
        want = socket.inet_pton(socket.AF_INET6, addr).hex()
        with contextlib.suppress(OSError):
            for line in open("/proc/net/if_inet6"):
                fields = line.split()
                if fields and fields[0] == want:
                    return fields[-1]
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                if socket.inet_ntoa(packed[20:24]) == addr:
                    return name
    return None


def node_address(master_addr: str, port: int) -> tuple[str, str | None] | None:
    """(address, interface) the other nodes reach this node at, or None: torch's default (the host name).

    A loopback source means the master is this machine: right when the master was given as a loopback
    address (every node on one machine), a misconfigured host name otherwise (node 0's own
    /etc/hosts maps its name to 127.0.1.1), where the other nodes may still resolve torch's default.
    """
    local = route_source(master_addr, port)
    if local is None:
        return None
    if ipaddress.ip_address(local.split("%")[0]).is_loopback and not _is_loopback(master_addr):
        return None
    return local, interface_of(local)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
