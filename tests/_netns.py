"""Separate hosts on one machine for the multi-node tests: Linux network namespaces on a private bridge.

Each node is a network namespace with its own ``eth0`` (10.231.X.<i+1>/24) and
loopback; a third namespace holds the bridge (the "switch") the nodes' veth
pairs plug into. Nothing is created in the machine's own namespace and no
address outside these namespaces is used, so rendezvous, stores and gloo
cross a real network stack, and cutting a node off is ``ip link set eth0
down`` inside it. Names carry this process's pid and a random tag, so runs at
the same time never share a namespace::

    with Hosts(2) as net:
        proc = net.popen(1, ["python", "-m", "multigpu", "run", ...])    # ip netns exec <node 1> ...
        net.cut(1)                                                        # node 1's network is gone

Everything is torn down on leaving the block, failures included: the processes
started here (killed), the namespaces (their links go with them). Needs root and
iproute2's ``ip`` (``unavailable()`` says why not, for a one-line skip).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

IFNAME = "eth0"  # every node's interface to the others, as GLOO_SOCKET_IFNAME names it


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Node:
    ns: str  # the network namespace
    addr: str  # its eth0 address, reachable from the other nodes only


class Scoped:
    """A context manager that always undoes what it made: ``_open`` on entry (``close`` if it fails part way),
    ``close`` on exit."""

    def __enter__(self):
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Hosts(Scoped):
    """``n`` nodes on one bridge; a context manager that always removes what it made."""

    def __init__(self, n: int) -> None:
        tag = f"mg{os.getpid()}-{secrets.token_hex(3)}"
        subnet = f"10.231.{secrets.randbelow(254) + 1}"
        self.switch = f"{tag}-sw"
        self.nodes = [Node(f"{tag}-n{i}", f"{subnet}.{i + 1}") for i in range(n)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def _open(self) -> None:
        for ns in (self.switch, *(node.ns for node in self.nodes)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            port = f"port{i}"  # the switch's end of node i's cable
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", node.ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
            _ip("-n", node.ns, "link", "set", IFNAME, "up")

    def command(self, i: int, argv: list[str], mounts: bool = False) -> list[str]:
        """``argv`` run inside node ``i``. ``ip netns exec`` mounts a fresh /sys (the node's own network
        devices) and with it no /sys/fs/cgroup; ``mounts``: keep the machine's mounts (nsenter, network
        only), for daemons such as slurmd that need the cgroups."""
        if mounts:
            return [shutil.which("nsenter") or "nsenter", f"--net=/run/netns/{self.nodes[i].ns}", *argv]
        return [shutil.which("ip") or "ip", "netns", "exec", self.nodes[i].ns, *argv]  # found here, not on env's PATH

    def popen(self, i: int, argv: list[str], mounts: bool = False, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``; it is killed on close if still running."""
        proc = subprocess.Popen(self.command(i, argv, mounts), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Node ``i``'s network is gone: its eth0 goes down (its processes live on, cut off)."""
        _ip("-n", self.nodes[i].ns, "link", "set", IFNAME, "down")

    def reconnect(self, i: int) -> None:
        """Node ``i``'s eth0 up again (its address and route come back with it)."""
        _ip("-n", self.nodes[i].ns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        # Every process inside a node (the launchers, and the workers torch's agent started in their own
        # sessions), then the namespaces: deleting one only unmounts it while a process still lives there.
        for _ in range(50):  # again until none is left: a process may fork while the others are killed
            pids = [pid for ns in self._made for pid in _pids(ns)]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in self._procs:
            proc.wait()
        self._procs.clear()
        errors = []
        for ns in reversed(self._made):
            try:
                _ip("netns", "delete", ns)
            except RuntimeError as err:
                errors.append(str(err))
        self._made.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


def _pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def leftovers(tag_prefix: str = f"mg{os.getpid()}-") -> list[str]:
    """This process's namespaces still present (for a test's check that nothing was left)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag_prefix)]
