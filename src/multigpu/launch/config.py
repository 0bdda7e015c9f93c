"""What ``multigpu run`` was asked to do, its checks, and where the workers go.

``resolve`` turns a ``RunConfig`` into a ``Placement`` (workers here, nodes,
rendezvous address) or raises a one-line ``UsageError``; everything that needs
no torch process is checked there, before anything starts. ``add_arguments``
and ``from_args`` are the command line's side.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import os
import socket
import sys
from dataclasses import dataclass
from typing import Iterator

from ..errors import UsageError
from ..runtime.fields import add_field
from ..runtime.values import parse_size

DEFAULT_LOG_DIR = "multigpu_logs"  # in the working directory, next to the project (and in .gitignore)
ELASTIC_RESTARTS = 3  # --max-restarts' default under --nnodes MIN:MAX


@dataclass(frozen=True)
class RunConfig:
    """What ``multigpu run`` was asked to do; ``None`` means "choose for me". Each field's docstring
    is its flag's help in `multigpu run --help` (``add_arguments``)."""

    target: str
    """Script path, or module name when ``module`` is true."""
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = None
    """worker processes on this node (default: visible GPUs, or 2 without GPUs or with --cpu)"""
    cpu: bool = False
    """workers use CPU and gloo even where GPUs exist (hides them)"""
    nnodes: int | str | None = None
    """number of nodes (default: 1, or SLURM's inside srun); MIN:MAX: elastic, training goes on with MIN..MAX nodes
    from the newest checkpoint"""
    node_rank: int | None = None
    """this node's rank in [0, N): node 0 hosts the rendezvous at --master (global ranks are numbered by the
    rendezvous)"""
    master: str | None = None
    """node 0's address and a free port, for --nnodes > 1"""
    max_restarts: int | None = None
    """restart the whole worker group up to R times after a failure, a lost node included (default 0, or
    {ELASTIC_RESTARTS} with --nnodes MIN:MAX)"""
    all_ranks: bool = False
    """show every rank's output on the console, prefixed [rank<r>] (default: rank 0 only)"""
    log_dir: str | None = None
    """where each run's per-rank logs go (default: ./{DEFAULT_LOG_DIR})"""
    profile: str | None = None
    """profile steps START..STOP-1 on every rank (e.g. 10:15; scripts using mg.StepMeter): traces and a summary
    table in the run's log directory"""
    find_batch: bool = False
    """the script's mg.find_micro_batch searches the largest per-rank micro-batch that fits, keeping the global
    batch (scripts that check mg.find_batch_requested()); the launcher prints the result"""
    memory_budget: str | int | None = None
    """--find-batch's memory limit per rank, e.g. 512MB (10^6), 8GiB (2^30) or bytes; required on CPU, optional on
    GPU (out-of-memory decides there)"""
    hang_timeout: float | None = None
    """stop the workers when a rank completes no step for S seconds (scripts using mg.StepMeter; 3*S before the
    first step): the hang verdict is the summary, exit 124, and --max-restarts restarts it"""
    allow_no_group: bool = False
    """accept workers that never join the job's process group (independent runs, e.g. a sweep by RANK); by default
    such a run exits 2 with one line, as each worker ran the whole script alone"""
    rdzv_timeout: float = 600.0
    """how long the nodes wait for MIN of them to join, at the start and after a loss (default %(default)g)"""
    rdzv_last_call: float = 30.0
    """once MIN nodes have joined, how long to wait for more (up to MAX) before training (re)starts (default
    %(default)g)"""
    node_timeout: float = 15.0
    """a node whose launcher sent no heartbeat for S seconds is lost, and the rendezvous goes on without it
    (default %(default)g)"""
    fault_tolerant: int | None = None
    """G replica groups of -n workers each (torchft, pip install 'multigpu[ft]'): a lost group does not stop the
    others, is restarted and heals from a live one; scripts use mg.fault_tolerant (docs/fault-tolerance.md)"""
    lighthouse: str | None = None
    """--fault-tolerant: a torchft lighthouse already running at HOST:PORT (default: one started by the launcher)"""

    @property
    def keep_alive(self) -> tuple[int, int]:
        """c10d's (keep_alive_interval s, keep_alive_max_attempt) for ``node_timeout`` (torch's default 5 s x 3)."""
        interval = 5 if self.node_timeout >= 15 else 1
        return interval, max(1, math.ceil(self.node_timeout / interval))

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``values.parse_size``: 512MB is 10**6, 8GiB 2**30)."""
        return None if self.memory_budget is None else parse_size(self.memory_budget, "--memory-budget")


@dataclass(frozen=True)
class Placement:
    """The resolved layout: how many workers here, how many nodes, where node 0 listens."""

    nproc: int
    nnodes: int  # the most nodes (MAX of MIN:MAX)
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "standalone" | "flags" | "slurm"
    run_id: str = ""  # the rendezvous id, the same on every node
    min_nodes: int = 0  # fewest nodes training goes on with; 0: nnodes (not elastic)
    max_restarts: int = 0

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    @property
    def nodes_text(self) -> str:
        """``--nnodes`` as torchrun takes it: N, or MIN:MAX."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)


def _parse_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29500
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--master must be HOST:PORT with a port in 1..65535, got {master!r}; use e.g. --master node0:29500")
    return host, int(port)


def parse_nnodes(value: int | str | None) -> tuple[int, int] | None:
    """(MIN, MAX) from ``--nnodes`` N or MIN:MAX (None: not given); one-line errors otherwise.

    >>> parse_nnodes("1:3"), parse_nnodes(2)
    ((1, 3), (2, 2))
    """
    if value is None:
        return None
    text = str(value).strip()
    low, sep, high = text.partition(":")
    if not low.strip().lstrip("-").isdigit() or (sep and not high.strip().lstrip("-").isdigit()):
        raise UsageError(f"--nnodes takes N or MIN:MAX (e.g. 2, or 1:3 for an elastic job), got {text!r}")
    lo, hi = int(low), int(high) if sep else int(low)
    if lo < 1:
        raise UsageError(f"--nnodes needs at least 1 node, got {text!r}; use e.g. --nnodes {max(hi, 1)} or --nnodes 1:{max(hi, 2)}")
    if lo > hi:
        raise UsageError(f"--nnodes MIN:MAX needs MIN <= MAX, got {text!r}; use --nnodes {hi}:{lo}")
    return lo, hi


def _slurm_nodes(environ) -> tuple[int, int, str, int, str] | None:
    """(nnodes, node_rank, master host, port, run id) inside ``srun``, else None."""
    keys = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
    if not all(environ.get(k) for k in keys):
        return None
    from ..dist import slurm_first_host

    try:
        job, nnodes, node = int(environ["SLURM_JOB_ID"]), int(environ["SLURM_NNODES"]), int(environ["SLURM_NODEID"])
        ntasks = int(environ.get("SLURM_NTASKS", nnodes))
    except ValueError:
        raise UsageError("SLURM_JOB_ID/SLURM_NNODES/SLURM_NODEID are not integers; run `multigpu run` inside `srun`") from None
    if ntasks != nnodes:
        raise UsageError(
            f"`multigpu run` starts the workers itself and needs one srun task per node, got SLURM_NTASKS={ntasks} "
            f"on {nnodes} nodes; use `srun --ntasks-per-node=1 multigpu run ...`"
        )
    # The same port on every node, different for jobs sharing a node (as mg.init does for plain srun).
    return nnodes, node, slurm_first_host(environ["SLURM_JOB_NODELIST"]), 20000 + job % 20000, f"slurm-{job}"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_target(cfg: RunConfig) -> None:
    if not cfg.target:
        raise UsageError("expected a script (`multigpu run train.py`) or a module (`multigpu run -m pkg.train`), got neither")
    if cfg.module:
        if cfg.target.endswith(".py") or os.sep in cfg.target:
            raise UsageError(f"-m expects a module name like pkg.train, got the path {cfg.target!r}; drop -m to run a script file")
        with _cwd_on_path():
            found = importlib.util.find_spec(cfg.target.split(".")[0]) is not None  # top level only: imports nothing
        if not found:
            raise UsageError(f"module {cfg.target!r} was not found from {os.getcwd()}; check the name, the directory or PYTHONPATH")
    elif not os.path.isfile(cfg.target):
        raise UsageError(f"script {cfg.target!r} does not exist (working directory {os.getcwd()}); check the path")


def resolve(cfg: RunConfig, environ=os.environ, gpu_count=visible_gpus) -> Placement:
    """Check ``cfg`` and decide the layout; raises ``UsageError`` (one line) for bad input.

    Everything that needs no torch is checked first, so a typo fails in well under a second.
    """
    if cfg.nproc is not None and cfg.nproc < 1:
        raise UsageError(f"-n/--nproc must be at least 1, got {cfg.nproc}; use e.g. -n 2")
    if cfg.lighthouse is not None and cfg.fault_tolerant is None:
        raise UsageError(f"--lighthouse is where --fault-tolerant's groups meet, got it without --fault-tolerant; "
                         f"add --fault-tolerant G or drop --lighthouse {cfg.lighthouse}")
    if cfg.max_restarts is not None and cfg.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {cfg.max_restarts}")
    nodes = parse_nnodes(cfg.nnodes)
    elastic = nodes is not None and nodes[0] < nodes[1]
    for flag, value in (("--hang-timeout", cfg.hang_timeout), ("--rdzv-timeout", cfg.rdzv_timeout),
                        ("--rdzv-last-call", cfg.rdzv_last_call), ("--node-timeout", cfg.node_timeout)):
        if value is not None and not 0 < value < 10**7:
            raise UsageError(f"{flag} takes seconds, more than 0, got {value}; use e.g. {flag} 60")
    if cfg.memory_budget is not None and not cfg.find_batch:
        raise UsageError(f"--memory-budget is the budget of --find-batch's search, got it without --find-batch; "
                         f"add --find-batch or drop --memory-budget {cfg.memory_budget}")
    budget = cfg.memory_budget_bytes  # a bad size fails here, before anything starts
    _check_target(cfg)

    # Inside srun, SLURM says where node 0 is; it also gives the node count unless --nnodes MIN:MAX does.
    slurm = _slurm_nodes(environ) if cfg.master is None and (nodes is None or elastic) else None
    if slurm is not None and (slurm[0] > 1 or elastic):  # one SLURM node: a standalone run like any other
        nnodes, node_rank, addr, port, run_id = slurm
        min_nodes, nnodes = nodes if elastic else (nnodes, nnodes)
        source = "slurm"
    else:
        min_nodes, nnodes = nodes or (1, 1)
        node_rank = cfg.node_rank if cfg.node_rank is not None else 0
        addr, port = _parse_master(cfg.master) if cfg.master is not None else (None, None)
        source = "flags" if addr is not None else "standalone"
        run_id = f"multigpu-{addr}-{port}" if addr is not None else ""
        if nnodes > 1 and addr is None:
            raise UsageError(f"--nnodes {cfg.nnodes} needs --master HOST:PORT (node 0's address and a free port, where "
                             "the rendezvous is hosted), or run inside srun")
    if cfg.node_rank is not None and source != "slurm" and not 0 <= cfg.node_rank < nnodes:
        raise UsageError(f"--node-rank must be in [0, {nnodes}) for --nnodes {cfg.nnodes}, got {cfg.node_rank}")

    gpus = 0 if cfg.cpu else gpu_count()
    if gpus and cfg.nproc is not None and cfg.nproc > gpus:
        raise UsageError(f"-n {cfg.nproc} is more than the {gpus} visible GPUs; use -n {gpus} or fewer, or --cpu for CPU workers")
    if cfg.find_batch and budget is None and not gpus:
        # Checked here, not in N workers: a CPU process gets no out-of-memory error to search
        # against, the kernel's OOM killer ends it instead.
        why = "--cpu" if cfg.cpu else "no visible GPU"
        raise UsageError(f"--find-batch on CPU workers ({why}) needs --memory-budget SIZE, the most memory a rank may use "
                         "(CPU has no out-of-memory signal to search against), got none; add e.g. --memory-budget 2GiB")
    nproc = cfg.nproc or gpus or 2
    if not gpus and nproc > CPU_WORKERS_PER_CPU * cpu_count():
        raise UsageError(f"-n {nproc} CPU workers on {cpu_count()} CPUs is more than {CPU_WORKERS_PER_CPU} per CPU "
                         f"({CPU_WORKERS_PER_CPU * cpu_count()}); each is a full Python process: use -n {min(cpu_count(), 8)} or a few more")
    if source == "flags":
        _check_resolves(addr, port)
    # An elastic job is kept going by restarts: a lost node fails the survivors' workers, who restart smaller.
    restarts = cfg.max_restarts if cfg.max_restarts is not None else (ELASTIC_RESTARTS if elastic else 0)
    return Placement(nproc, nnodes, node_rank, addr, port, source, run_id, min_nodes, restarts)


# More CPU workers than this per core only time-slice: a typo such as -n 99999 must not start forking.
CPU_WORKERS_PER_CPU = 8


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, which a scheduler may narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _check_resolves(host: str, port: int) -> None:
    """A master host that does not resolve would make torch retry its socket for minutes: say it at once."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise UsageError(f"--master host {host!r} does not resolve ({err.strerror or err}); use node 0's host name "
                         f"or IP address, e.g. --master 10.0.0.1:{port}") from None


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    # `python -m` in the worker searches the working directory first; so do we.
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path.remove(os.getcwd())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "multigpu run [options] script.py [args ...]  |  multigpu run [options] -m module [args ...]"
    # The named values are the ones the help quotes from constants written once (``{DEFAULT_LOG_DIR}``).
    run = functools.partial(add_field, parser, config=RunConfig,
                            values={"DEFAULT_LOG_DIR": DEFAULT_LOG_DIR, "ELASTIC_RESTARTS": ELASTIC_RESTARTS})
    run("-n", "--nproc", field="nproc", type=int, metavar="N")
    run("--cpu", field="cpu", action="store_true")
    run("--all-ranks", field="all_ranks", action="store_true")
    run("--log-dir", field="log_dir", metavar="DIR")
    run("--max-restarts", field="max_restarts", type=int, metavar="R")
    run("--hang-timeout", field="hang_timeout", type=float, metavar="S")
    run("--nnodes", field="nnodes", metavar="N|MIN:MAX")
    run("--rdzv-timeout", field="rdzv_timeout", type=float, metavar="S")
    run("--rdzv-last-call", field="rdzv_last_call", type=float, metavar="S")
    run("--node-timeout", field="node_timeout", type=float, metavar="S")
    run("--node-rank", field="node_rank", type=int, metavar="R")
    run("--master", field="master", metavar="HOST:PORT")
    run("--profile", field="profile", metavar="START:STOP")
    run("--find-batch", field="find_batch", action="store_true")
    run("--memory-budget", field="memory_budget", metavar="SIZE")
    run("--allow-no-group", field="allow_no_group", action="store_true")
    run("--fault-tolerant", field="fault_tolerant", type=int, metavar="G")
    run("--lighthouse", field="lighthouse", metavar="HOST:PORT")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE", help="run a module like `python -m` (the rest of the line is its arguments)")
    parser.add_argument("script", nargs="?", help="the training script (the rest of the line is its arguments)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def from_args(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` of a parsed ``multigpu run`` command line."""
    if args.module is not None:
        if not args.module:
            raise UsageError("-m needs a module name, got nothing; use e.g. `multigpu run -m pkg.train`")
        target, rest, module = args.module[0], args.module[1:], True
    else:
        target, rest, module = args.script or "", args.script_args, False
    return RunConfig(target=target, args=tuple(str(a) for a in rest), module=module, nproc=args.nproc, cpu=args.cpu,
                     nnodes=args.nnodes, node_rank=args.node_rank, master=args.master, max_restarts=args.max_restarts,
                     all_ranks=args.all_ranks, log_dir=args.log_dir, profile=args.profile, find_batch=args.find_batch,
                     memory_budget=args.memory_budget, hang_timeout=args.hang_timeout,
                     allow_no_group=args.allow_no_group, rdzv_timeout=args.rdzv_timeout,
                     rdzv_last_call=args.rdzv_last_call, node_timeout=args.node_timeout,
                     fault_tolerant=args.fault_tolerant, lighthouse=args.lighthouse)
