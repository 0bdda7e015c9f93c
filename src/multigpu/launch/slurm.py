"""Where the job's first SLURM node is, asked of SLURM itself (``multigpu run`` inside ``srun``).

SLURM's node names need not be host names: a cluster may declare ``NodeName=n0
NodeAddr=10.1.0.7``, and only SLURM knows the address. Given a name that does not
resolve, torch's store client waits 60 s on every node and prints a C++ stack
trace before giving up. So the launcher takes the address from ``scontrol show
node NAME`` (its ``NodeAddr``, which is the name itself where none was declared),
falls back to the name where ``scontrol`` is missing, and refuses in one line,
before anything starts, when neither resolves.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

from ..errors import UsageError

SCONTROL_TIMEOUT_S = 15  # one RPC to slurmctld; it answers in milliseconds when it is up


def node_addr(name: str) -> tuple[str | None, str]:
    """(NodeAddr of SLURM node ``name``, or None; where the answer came from, or why there was none)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None, "no scontrol on this node"
    command = f"`scontrol show node {name}`"
    try:
        proc = subprocess.run([scontrol, "show", "node", name, "--oneliner"], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{command} did not answer in {SCONTROL_TIMEOUT_S} s"
    except OSError as err:
        return None, f"{command} failed: {err.strerror or err}"
    found = re.search(r"(?:^|\s)NodeAddr=(\S+)", proc.stdout)
    if proc.returncode != 0 or found is None:
        why = (proc.stderr.strip().splitlines() or ["no NodeAddr in its output"])[-1]
        return None, f"{command} gave no address ({why})"
    return found.group(1), f"{command}: NodeAddr"


def _resolve_error(host: str, port: int) -> str | None:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        return err.strerror or str(err)
    return None


def master_address(name: str, port: int, nodes: str) -> tuple[str, str]:
    """(address of the job's first node ``name``, how it was found); ``UsageError`` in one line when SLURM's
    address and the name both fail to resolve."""
    addr, how = node_addr(name)
    if addr is not None and _resolve_error(addr, port) is None:
        return addr, how
    failed = _resolve_error(name, port)
    if failed is None:
        return name, "its node name" if addr is None else f"its node name ({how} {addr} does not resolve)"
    slurm = how if addr is None else f"{how} {addr} does not resolve either"
    raise UsageError(
        f"the job's first SLURM node {name!r}, where node 0 hosts the rendezvous, does not resolve ({failed}), and "
        f"{slurm}; give its address yourself on every node: multigpu run --nnodes {nodes} --node-rank "
        f"$SLURM_NODEID --master ADDRESS:{port} ...")
