"""`multigpu run`: start N worker processes of a script through torchrun's own launcher.

We build a torchrun command line, let ``torch.distributed.run`` turn it into a
``LaunchConfig`` and call ``elastic_launch`` in this process: torch supervises
the workers, runs the rendezvous and handles restarts. We add what torchrun
leaves to the user: sensible defaults (one worker per GPU, 2 on CPU), argument
checks that fail in one line, per-rank log files named by global rank, rank 0
on the console, SLURM, and one summary line when a worker fails.

Rendezvous is always torchrun's c10d: one node uses ``--standalone`` (the
store on a free port of localhost, so two runs never collide); several nodes
meet at ``--master HOST:PORT``, where node 0 hosts the store. torchrun's
``--node-rank`` only means something to its static rendezvous, whose store is
shared by every restart attempt; so here ``--node-rank 0`` marks the node that
hosts the store (c10d's ``is_host``), and the rendezvous numbers the nodes
(sorted by host name). c10d restarts all nodes together when one fails, which
is what ``--max-restarts`` needs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import secrets
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import UsageError

SHUTDOWN_GRACE_S = 10  # SIGTERM -> SIGKILL for the surviving workers (torch's default is 30 s)
DEFAULT_LOG_DIR = "multigpu_logs"  # in the working directory, next to the project (and in .gitignore)


@dataclass(frozen=True)
class RunConfig:
    """What ``multigpu run`` was asked to do; ``None`` means "choose for me"."""

    target: str
    """Script path, or module name when ``module`` is true."""
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = None
    """Worker processes on this node (default: visible GPUs, or 2 on CPU)."""
    cpu: bool = False
    """Hide GPUs from the workers (CUDA_VISIBLE_DEVICES=""): CPU tensors, gloo."""
    nnodes: int | None = None
    node_rank: int | None = None
    master: str | None = None
    """HOST:PORT of node 0, where the rendezvous store listens."""
    max_restarts: int = 0
    all_ranks: bool = False
    log_dir: str | None = None
    profile: str | None = None
    """START:STOP: torch.profiler over those steps in every worker's StepMeter."""
    find_batch: bool = False
    """Ask the workers' ``mg.find_micro_batch`` for the largest micro-batch that fits; report it."""
    memory_budget: str | int | None = None
    """--find-batch's memory budget per rank: bytes, or a size like ``512MB``, ``8GiB`` (required on CPU)."""


@dataclass(frozen=True)
class Placement:
    """The resolved layout: how many workers here, how many nodes, where node 0 listens."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "standalone" | "flags" | "slurm"
    run_id: str = ""  # the rendezvous id, the same on every node


def _parse_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29500
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--master must be HOST:PORT with a port in 1..65535, got {master!r}; use e.g. --master node0:29500")
    return host, int(port)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]i?b)?", re.IGNORECASE)
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``512MB`` (10**6) or ``8GiB`` (2**30); ``UsageError`` for anything else.

    >>> parse_size("1.5GiB"), parse_size("512MB"), parse_size("4096")
    (1610612736, 512000000, 4096)
    """
    got = str(text)
    match = _SIZE.fullmatch(got)
    # A fraction only with a unit: "1.5" bytes means nothing; "1.5GiB" is 1.5 * 2**30 rounded down.
    size = None
    if match and (match.group(2) or "." not in match.group(1)):
        unit = _UNITS[match.group(2).lower()] if match.group(2) else 1
        size = int(float(match.group(1)) * unit) if "." in match.group(1) else int(match.group(1)) * unit
    if not size:
        raise UsageError(f"--memory-budget must be a positive size like 512MB, 8GiB or a number of bytes, got {got!r}; "
                         "use e.g. --memory-budget 8GiB")
    return size


def _slurm_nodes(environ) -> tuple[int, int, str, int, str] | None:
    """(nnodes, node_rank, master host, port, run id) inside ``srun``, else None."""
    keys = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
    if not all(environ.get(k) for k in keys):
        return None
    from .dist import slurm_first_host

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


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(cfg: RunConfig, environ=os.environ, gpu_count=_visible_gpus) -> Placement:
    """Check ``cfg`` and decide the layout; raises ``UsageError`` (one line) for bad input.

    Everything that needs no torch is checked first, so a typo fails in well under a second.
    """
    if cfg.nproc is not None and cfg.nproc < 1:
        raise UsageError(f"-n/--nproc must be at least 1, got {cfg.nproc}; use e.g. -n 2")
    if cfg.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {cfg.max_restarts}")
    if cfg.nnodes is not None and cfg.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {cfg.nnodes}")
    if cfg.memory_budget is not None:
        if not cfg.find_batch:
            raise UsageError(f"--memory-budget is the budget of --find-batch's search, got it without --find-batch; "
                             f"add --find-batch or drop --memory-budget {cfg.memory_budget}")
        parse_size(cfg.memory_budget)
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

    slurm = _slurm_nodes(environ) if cfg.nnodes is None and cfg.master is None else None
    if slurm is not None and slurm[0] > 1:  # one SLURM node: a standalone run like any other
        nnodes, node_rank, addr, port, run_id = slurm
        source = "slurm"
    else:
        nnodes = cfg.nnodes or 1
        node_rank = cfg.node_rank if cfg.node_rank is not None else 0
        addr, port = _parse_master(cfg.master) if cfg.master is not None else (None, None)
        source = "flags" if addr is not None else "standalone"
        run_id = f"multigpu-{addr}-{port}" if addr is not None else ""
        if nnodes > 1 and addr is None:
            raise UsageError(f"--nnodes {nnodes} needs --master HOST:PORT (node 0's address and a free port), or run inside srun")
    if cfg.node_rank is not None and source != "slurm" and not 0 <= cfg.node_rank < nnodes:
        raise UsageError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {cfg.node_rank}")

    gpus = 0 if cfg.cpu else gpu_count()
    if gpus and cfg.nproc is not None and cfg.nproc > gpus:
        raise UsageError(f"-n {cfg.nproc} is more than the {gpus} visible GPUs; use -n {gpus} or fewer, or --cpu for CPU workers")
    if cfg.find_batch and cfg.memory_budget is None and not gpus:
        # Checked here, not in N workers: a CPU process gets no out-of-memory error to search
        # against, the kernel's OOM killer ends it instead.
        why = "--cpu" if cfg.cpu else "no visible GPU"
        raise UsageError(f"--find-batch on CPU workers ({why}) needs --memory-budget SIZE, the most memory a rank may use "
                         "(CPU has no out-of-memory signal to search against), got none; add e.g. --memory-budget 2GiB")
    nproc = cfg.nproc or gpus or 2
    return Placement(nproc, nnodes, node_rank, addr, port, source, run_id)


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    # `python -m` in the worker searches the working directory first; so do we.
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path.remove(os.getcwd())


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def _worker_env(changes: dict[str, tuple[str, str]]) -> Iterator[None]:
    """Set variables the workers inherit, logging old -> new; restore them afterwards."""
    from .launch_logs import say

    saved = {name: os.environ.get(name) for name in changes}
    for name, (value, why) in changes.items():
        old = os.environ.get(name)
        if old != value:
            say(f"{name}: {'unset' if old is None else repr(old)} -> {value!r} ({why})")
            os.environ[name] = value
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _run_dir(cfg: RunConfig, place: Placement) -> str:
    root = os.path.abspath(cfg.log_dir or DEFAULT_LOG_DIR)
    stem = cfg.target.rsplit(".", 1)[-1] if cfg.module else os.path.splitext(os.path.basename(cfg.target))[0]
    node = f"-node{place.node_rank}" if place.nnodes > 1 else ""
    path = os.path.join(root, f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}{node}-{secrets.token_hex(3)}")
    try:
        os.makedirs(path)
    except OSError as err:
        raise UsageError(f"cannot create the log directory {path}: {err.strerror}; pass a writable --log-dir") from None
    return path


def _torchrun_argv(cfg: RunConfig, place: Placement) -> list[str]:
    argv = [f"--nproc-per-node={place.nproc}", f"--max-restarts={cfg.max_restarts}", "--monitor-interval=0.1"]
    # DefaultLogsSpecs (built by config_from_args, replaced by ours) would otherwise mkdtemp in /tmp.
    argv.append(f"--log-dir={os.devnull}")
    if place.master_addr is not None:
        host = f"[{place.master_addr}]" if ":" in place.master_addr else place.master_addr
        argv += [f"--nnodes={place.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{place.master_port}"]
        argv += [f"--rdzv-id={place.run_id}", f"--rdzv-conf=is_host={'true' if place.node_rank == 0 else 'false'}"]
    if cfg.module:
        argv.append("--module")
    return argv + [cfg.target, *cfg.args]


def launch(cfg: RunConfig) -> int:
    """Run ``cfg`` to completion and return the exit code (0, the failed worker's, or 128+signal)."""
    from .finder import FIND_BATCH_ENV, MEMORY_BUDGET_ENV, launcher_line
    from .meter.launcher import hang_monitor, worker_env
    from .meter.profile import parse_steps

    if cfg.profile:
        parse_steps(cfg.profile)  # a bad --profile fails here, before anything starts
    place = resolve(cfg)
    run_dir = _run_dir(cfg, place)

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from . import launch_logs as logs

    args = torchrun.get_args_parser().parse_args(_torchrun_argv(cfg, place))
    if place.master_addr is None:
        # What torchrun --standalone does: c10d store on a free port of localhost, a fresh run id.
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    env: dict[str, tuple[str, str]] = {}
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, _cpu_count() // place.nproc)
        env["OMP_NUM_THREADS"] = (str(threads), f"{_cpu_count()} CPUs // {place.nproc} workers")
    if cfg.max_restarts and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        # By default the workers of every attempt use the agent's one store, where the previous
        # attempt's keys are still set: the next attempt's gloo connects to dead ports and fails
        # or hangs (seen with torch 2.13, torchrun too). Opting out gives each attempt a fresh store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = ("1", "--max-restarts: a fresh store per attempt")
    if cfg.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ("", "--cpu: workers see no GPU and use gloo")

    gpus = "" if cfg.cpu else _visible_gpus()
    # The workers' StepMeters log into the run directory and profile --profile's steps; on GPU,
    # NCCL's flight recorder keeps the last collectives for the hang report (user settings win).
    for name, value in worker_env(run_dir, cfg.profile, cuda=bool(gpus)).items():
        if name.startswith("MULTIGPU_") or name not in os.environ:
            why = {"MULTIGPU_RUN_DIR": "the workers' metrics and hang reports", "MULTIGPU_PROFILE": "--profile"}
            env[name] = (value, why.get(name, "NCCL flight recorder for hang reports"))
    if cfg.find_batch:
        env[FIND_BATCH_ENV] = ("1", "--find-batch: the workers' mg.find_micro_batch searches and reports")
        if cfg.memory_budget is not None:
            env[MEMORY_BUDGET_ENV] = (str(parse_size(cfg.memory_budget)), f"--memory-budget {cfg.memory_budget} in bytes")
    device = f"{gpus} GPU{'s' if gpus > 1 else ''}" if gpus else "CPU"
    world = place.nproc * place.nnodes
    where = f"node {place.node_rank} of {place.nnodes} ({place.source}, master {place.master_addr}:{place.master_port})" if place.nnodes > 1 else "1 node"
    logs.say(f"{place.nproc} worker{'s' if place.nproc > 1 else ''} on {device}, {where}, world size {world}; logs: {run_dir}")

    specs = logs.RankLogsSpecs(run_dir, console_ranks=None if cfg.all_ranks else {0}, prefixed=cfg.all_ranks)
    code, summary = 0, ""
    with _worker_env(env), logs.torch_logs_to(os.path.join(run_dir, "launcher.log"), specs.watch), logs.restored_signal_handlers(), \
            hang_monitor(run_dir, world if place.nnodes == 1 else None, expect=place.nproc):
        try:
            config, cmd, cmd_args = torchrun.config_from_args(args)
            config.logs_specs = specs
            if hasattr(config, "shutdown_timeout"):  # torch >= 2.9
                config.shutdown_timeout = SHUTDOWN_GRACE_S
            elastic_launch(config, cmd)(*cmd_args)
        except ChildFailedError as err:
            specs.stop_console()
            code, summary = logs.failure_summary(err, specs)
        except SignalException as err:
            code, summary = 128 + int(err.sigval), f"stopped by {err.sigval.name}; all workers were stopped"
        except Exception as err:  # rendezvous timeouts, unreachable master, ...
            import logging
            import traceback

            logging.getLogger("torch.distributed.launcher").error("launcher failed:\n%s", traceback.format_exc())
            code = 1
            text = " ".join(str(err).split())
            if err.__cause__ is not None:  # e.g. "connection to the C10d store has failed" <- the socket's timeout
                text += " <- " + " ".join(str(err.__cause__).split("\n", 1)[0].split())
            text = text if len(text) <= 300 else text[:297] + "..."
            summary = f"launcher failed: {type(err).__name__}: {text} (details in {run_dir}/launcher.log)"
        finally:
            specs.stop_console()
    if cfg.find_batch:
        found = launcher_line(run_dir, cfg.target if cfg.module else os.path.basename(cfg.target), code)
        if found:
            logs.say(found)  # before the failure summary, which stays the last line
    if summary:
        logs.say(summary)
    return code


def run(
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    nproc: int | None = None,
    cpu: bool = False,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    max_restarts: int = 0,
    all_ranks: bool = False,
    log_dir: str | None = None,
    profile: str | None = None,
    find_batch: bool = False,
    memory_budget: str | int | None = None,
) -> int:
    """Run ``target`` on ``nproc`` processes per node via torch's elastic launcher; return the exit code.

    Raises ``UsageError`` for bad arguments (nothing has started then).

    >>> from multigpu.launch import run
    >>> code = run("train.py", ["--epochs", "2"], nproc=2, cpu=True)
    >>> code = run("pkg.train", module=True, nnodes=2, node_rank=0, master="node0:29500")
    >>> code = run("train.py", nproc=2, cpu=True, find_batch=True, memory_budget="2GiB")
    """
    cfg = RunConfig(target, tuple(str(a) for a in args), module, nproc, cpu, nnodes, node_rank, master, max_restarts, all_ranks, log_dir,
                    profile, find_batch, memory_budget)
    return launch(cfg)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "multigpu run [options] script.py [args ...]  |  multigpu run [options] -m module [args ...]"
    parser.add_argument("-n", "--nproc", type=int, metavar="N", help="worker processes on this node (default: visible GPUs, or 2 without GPUs or with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="workers use CPU and gloo even where GPUs exist (hides them)")
    parser.add_argument("--all-ranks", action="store_true", help="show every rank's output on the console, prefixed [rank<r>] (default: rank 0 only)")
    parser.add_argument("--log-dir", metavar="DIR", help=f"where each run's per-rank logs go (default: ./{DEFAULT_LOG_DIR})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R", help="restart the whole worker group up to R times after a failure (torchrun's elastic restarts)")
    parser.add_argument("--nnodes", type=int, metavar="N", help="number of nodes (default: 1, or SLURM's inside srun)")
    parser.add_argument("--node-rank", type=int, metavar="R", help="this node's rank in [0, N): node 0 hosts the rendezvous at --master (global ranks are numbered by the rendezvous)")
    parser.add_argument("--master", metavar="HOST:PORT", help="node 0's address and a free port, for --nnodes > 1")
    parser.add_argument("--profile", metavar="START:STOP", help="profile steps START..STOP-1 on every rank (e.g. 10:15; scripts using mg.StepMeter): traces and a summary table in the run's log directory")
    parser.add_argument("--find-batch", action="store_true", help="the script's mg.find_micro_batch searches the largest per-rank micro-batch that fits, keeping the global batch (scripts that check mg.find_batch_requested()); the launcher prints the result")
    parser.add_argument("--memory-budget", metavar="SIZE", help="--find-batch's memory limit per rank, e.g. 512MB (10^6), 8GiB (2^30) or bytes; required on CPU, optional on GPU (out-of-memory decides there)")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE", help="run a module like `python -m` (the rest of the line is its arguments)")
    parser.add_argument("script", nargs="?", help="the training script (the rest of the line is its arguments)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.module is not None:
        if not args.module:
            raise UsageError("-m needs a module name, got nothing; use e.g. `multigpu run -m pkg.train`")
        target, rest, module = args.module[0], args.module[1:], True
    else:
        target, rest, module = args.script or "", args.script_args, False
    return run(
        target, rest, module=module, nproc=args.nproc, cpu=args.cpu, nnodes=args.nnodes, node_rank=args.node_rank,
        master=args.master, max_restarts=args.max_restarts, all_ranks=args.all_ranks, log_dir=args.log_dir,
        profile=args.profile, find_batch=args.find_batch, memory_budget=args.memory_budget,
    )
