"""A real SLURM cluster for one test: slurmctld and one slurmd per node, each node a network namespace.

Debian's slurm-wlm (22.05) with munge. The nodes are tests/_netns.py's hosts; node 0
also runs the controller (a small cluster's head node). Their SLURM names (n0, n1)
are no host names: only ``NodeAddr`` in slurm.conf says where they are, as on
clusters whose node names are not in DNS. Everything is private to the test: the
munge key and socket, slurm.conf (``SLURM_CONF``), state, spool and logs live in
its directory, so nothing of the machine's own SLURM or munge is used or touched::

    with _netns.Hosts(2) as net, Cluster(net, tmp_path) as slurm:
        proc = slurm.run(0, ["srun", "-N", "2", "--ntasks-per-node=1", "hostname"])

``unavailable()`` says why not (a skip at collection); ``install()``, in a test's
setup, installs the packages with apt when they are missing (root with apt: CI's
fresh machine; `make test` installs them first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from _netns import Scoped

BINARIES = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "munged")


def unavailable() -> str | None:
    """Why no SLURM cluster can be started here (a skip reason), or None: installed, or installable by
    ``install()`` (root on a machine with apt)."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "a real SLURM cluster needs slurm-wlm and munge (apt-get install slurm-wlm munge, as root)"
    return None


def install() -> str | None:
    """Install slurm-wlm and munge with apt when missing (a test's setup, not its collection); why it failed, or None."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"],
                 ["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"]):
        subprocess.run(argv, capture_output=True, env=env, timeout=600)
        if all(shutil.which(b) for b in BINARIES):
            return None
    missing = [b for b in BINARIES if not shutil.which(b)]
    return f"apt-get install slurm-wlm munge left {', '.join(missing)} missing"


CONF = """\
ClusterName=mgtest
SlurmctldHost={host}({ctl_addr})
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig={dir}/plugstack.conf
{nodes}
PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster(Scoped):
    """slurmctld on node 0 and a slurmd on every node of ``net``; all stopped on leaving the block."""

    CTL_PORT, D_PORT = 6817, 6818  # SLURM's defaults: each node has its own network stack

    def __init__(self, net, directory: Path, cpus: int = 2) -> None:
        self.net, self.dir = net, Path(directory)
        self.names = [f"n{i}" for i in range(len(net.nodes))]
        self.cpus = cpus
        self._munged: subprocess.Popen | None = None
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def _open(self) -> None:
        d = self.dir
        for sub in ("state", "munge", *(f"spool-{name}" for name in self.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        socket = d / "munge" / "munge.sock"
        self._munged = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
             f"--pid-file={d / 'munge' / 'munged.pid'}", f"--log-file={d / 'munge' / 'munged.log'}",
             f"--seed-file={d / 'munge' / 'munged.seed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait(lambda: socket.exists(), 10, "munged's socket")
        nodes = "\n".join(f"NodeName={name} NodeAddr={node.addr} CPUs={self.cpus} State=UNKNOWN"
                          for name, node in zip(self.names, self.net.nodes))
        (d / "plugstack.conf").write_text("")
        (d / "slurm.conf").write_text(CONF.format(
            host=os.uname().nodename, ctl_addr=self.net.nodes[0].addr, ctl_port=self.CTL_PORT, d_port=self.D_PORT,
            munge_socket=socket, dir=d, nodes=nodes, names=",".join(self.names)))
        conf = str(d / "slurm.conf")
        self.net.popen(0, ["slurmctld", "-D", "-i", "-f", conf], env=self.env, stdout=subprocess.DEVNULL,
                       stderr=open(d / "slurmctld.stderr", "w"))
        for i, name in enumerate(self.names):
            self.net.popen(i, ["slurmd", "-D", "-N", name, "-f", conf], mounts=True, env=self.env, stdout=subprocess.DEVNULL,
                           stderr=open(d / f"slurmd-{name}.stderr", "w"))
        _wait(self._idle, 60, "both slurmd idle in sinfo", self._logs)

    def _idle(self) -> bool:
        out = self.run(0, ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20).stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(name) == "idle" for name in self.names)

    def _logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.stderr")))

    def run(self, i: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command (srun, sbatch, scontrol ...) run on node ``i``, against this cluster."""
        return subprocess.run(self.net.command(i, argv), env={**self.env, **kwargs.pop("env", {})}, **kwargs)

    def wait(self, job: int, timeout: float) -> tuple[str, str]:
        """Wait for ``job`` to end: (its JobState, its ExitCode) from ``scontrol show job``."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(0, ["scontrol", "show", "job", str(job), "--oneliner"], capture_output=True, text=True,
                           timeout=20).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            state = fields.get("JobState", "?")
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "?") or time.monotonic() > deadline:
                return state, fields.get("ExitCode", "?")
            time.sleep(0.2)

    def close(self) -> None:
        # The daemons run in the nodes' namespaces: _netns.Hosts.close kills them. munged runs here.
        if self._munged is not None and self._munged.poll() is None:
            self._munged.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._munged.wait(timeout=5)
            if self._munged.poll() is None:
                self._munged.kill()
                self._munged.wait()


def _wait(ready, timeout: float, what: str, details=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout:g} s\n{details()}")
