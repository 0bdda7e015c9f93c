"""Starting the workers: torchrun's ``elastic_launch`` in this process, with our logs and summaries.

We build a torchrun command line, let ``torch.distributed.run`` turn it into a
``LaunchConfig`` and call ``elastic_launch``: torch supervises the workers,
runs the rendezvous and handles restarts. torch is imported only once
``resolve`` accepted the arguments, so usage errors stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import math
import os
import secrets
import signal
import time
import uuid
from typing import Iterator, Sequence

from ..errors import UsageError
from ..runtime import contract
from .config import DEFAULT_LOG_DIR, Placement, RunConfig, cpu_count, from_args, resolve, visible_gpus
from . import slurm
from .network import node_address

HANG_EXIT = 124  # a job ended by --hang-timeout, as timeout(1) ends a command
SHUTDOWN_GRACE_S = 10  # SIGTERM -> SIGKILL for the surviving workers (torch's default is 30 s)


@contextlib.contextmanager
def _worker_env(changes: dict[str, tuple[str, str]]) -> Iterator[None]:
    """Set variables the workers inherit, logging old -> new; restore them afterwards."""
    from .logs import say

    for name, (value, why) in changes.items():
        old = os.environ.get(name)
        if old != value:
            say(f"{name}: {'unset' if old is None else repr(old)} -> {value!r} ({why})")
    with contract.environ(**{name: value for name, (value, _) in changes.items()}):
        yield


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


def _torchrun_argv(cfg: RunConfig, place: Placement, local_addr: str | None = None) -> list[str]:
    argv = [f"--nproc-per-node={place.nproc}", f"--max-restarts={place.max_restarts}", "--monitor-interval=0.1"]
    # DefaultLogsSpecs (built by config_from_args, replaced by ours) would otherwise mkdtemp in /tmp.
    argv.append(f"--log-dir={os.devnull}")
    if place.master_addr is not None:
        host = f"[{place.master_addr}]" if ":" in place.master_addr else place.master_addr
        argv += [f"--nnodes={place.nodes_text}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{place.master_port}"]
        interval, attempts = cfg.keep_alive
        # torch reads whole seconds (int()) and wants them positive: round up.
        join, last_call = (max(1, math.ceil(v)) for v in (cfg.rdzv_timeout, cfg.rdzv_last_call))
        conf = f"is_host={'true' if place.node_rank == 0 else 'false'},join_timeout={join}," \
               f"last_call_timeout={last_call},keep_alive_interval={interval},keep_alive_max_attempt={attempts}"
        argv += [f"--rdzv-id={place.run_id}", f"--rdzv-conf={conf}"]
        if local_addr is not None:  # what the other nodes reach this one at (network.node_address)
            argv.append(f"--local-addr={local_addr}")
    # Every worker starts in worker.py, which runs the target (failure records, a clean exit).
    return argv + ["--module", "multigpu.launch.worker", "module" if cfg.module else "script", cfg.target, *cfg.args]


def _torchrun_args(cfg: RunConfig, place: Placement, local_addr: str | None) -> argparse.Namespace:
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(_torchrun_argv(cfg, place, local_addr))
    if place.master_addr is None:
        # What torchrun --standalone does: c10d store on a free port of localhost, a fresh run id.
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    return args


def _worker_variables(cfg: RunConfig, place: Placement, run_dir: str, steps: tuple[int, int] | None,
                      gpus: int, node: tuple[str, str | None] | None = None) -> dict[str, tuple[str, str]]:
    """name -> (value, why) for every variable the workers get from us (``node``: network.node_address)."""
    from ..meter.watchdog import flight_recorder_env

    env: dict[str, tuple[str, str]] = {}
    if node is not None and node[1] is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Left alone, gloo binds to what the host name resolves to, a loopback address on many hosts.
        env["GLOO_SOCKET_IFNAME"] = (node[1], f"gloo's interface: {node[0]}, this node's route to the master")
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, cpu_count() // place.nproc)
        env["OMP_NUM_THREADS"] = (str(threads), f"{cpu_count()} CPUs // {place.nproc} workers")
    if (place.max_restarts or place.elastic) and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        # By default the workers of every attempt use the agent's one store, where the previous
        # attempt's keys are still set: the next attempt's gloo connects to dead ports and fails
        # or hangs (seen with torch 2.13, torchrun too). Opting out gives each attempt a fresh store.
        # A node joining an elastic job restarts the workers too, restarts or not.
        why = "--max-restarts" if place.max_restarts else "--nnodes MIN:MAX"
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = ("1", f"{why}: a fresh store per attempt")
    if cfg.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ("", "--cpu: workers see no GPU and use gloo")
    # The workers' StepMeters log into the run directory and profile --profile's steps; the finder
    # searches under --find-batch. These are ours to set, whatever the environment holds.
    why = {contract.RUN_DIR_ENV: "the workers' metrics and hang reports", contract.PROFILE_ENV: "--profile",
           contract.FIND_BATCH_ENV: "--find-batch: the workers' mg.find_micro_batch searches and reports",
           contract.MEMORY_BUDGET_ENV: f"--memory-budget {cfg.memory_budget} in bytes",
           contract.HANG_TIMEOUT_ENV: "--hang-timeout: the workers' watchdogs report a stall by then"}
    ours = contract.worker_env(run_dir, profile=steps, find_batch=cfg.find_batch, memory_budget=cfg.memory_budget_bytes,
                               hang_timeout=cfg.hang_timeout)
    env.update((name, (value, why[name])) for name, value in ours.items())
    # On GPU, NCCL's flight recorder keeps the last collectives for the hang report (user settings win).
    for name, value in (flight_recorder_env(run_dir) if gpus else {}).items():
        if name not in os.environ:
            env[name] = (value, "NCCL flight recorder for hang reports")
    return env


def _worker_pids(reported: list[int]) -> list[int]:
    """The workers torch's agent started: children of this process that lead their own process group (as
    the agent starts them; Linux's /proc), else the pids the watchdogs reported."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids |= {int(p) for p in open(path).read().split()}
    leaders = [p for p in pids if _pgid(p) == p]
    return sorted(leaders or reported)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _stop_workers(specs, timeout: float, verdict: str, reported: list[int]) -> bool:
    """--hang-timeout: SIGKILL every worker's process group (loader workers included); the agent sees them
    fail and restarts them (--max-restarts) or ends the job, whose summary is the verdict. False: none found."""
    from . import logs

    stopped = 0
    for pid in _worker_pids(reported):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL) if _pgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            stopped += 1
    if not stopped:
        logs.say(f"--hang-timeout {timeout:g} s: found no worker process to stop; the job stays hung")
        return False
    specs.attempts.hang = verdict
    logs.say(f"--hang-timeout {timeout:g} s: stopped this node's {stopped} worker{'s' if stopped != 1 else ''}")
    return True


def _launcher_failure(err: Exception, run_dir: str) -> str:
    """The summary line of a launcher that failed itself (rendezvous timeouts, unreachable master, ...)."""
    import logging
    import traceback

    logging.getLogger("torch.distributed.launcher").error("launcher failed:\n%s", traceback.format_exc())
    text = " ".join(str(err).split())
    if err.__cause__ is not None:  # e.g. "connection to the C10d store has failed" <- the socket's timeout
        text += " <- " + " ".join(str(err.__cause__).split("\n", 1)[0].split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"launcher failed: {type(err).__name__}: {text} (details in {run_dir}/launcher.log)"


def _supervise(torchrun_args: argparse.Namespace, specs) -> tuple[int, str]:
    """Run the workers to the end under torch's agent: (exit code, summary line or "")."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from . import logs

    try:
        config, cmd, cmd_args = torchrun.config_from_args(torchrun_args)
        config.logs_specs = specs
        if hasattr(config, "shutdown_timeout"):  # torch >= 2.9
            config.shutdown_timeout = SHUTDOWN_GRACE_S
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as err:
        specs.stop_console()
        return logs.failure_summary(err, specs)
    except SignalException as err:
        return 128 + int(err.sigval), f"stopped by {err.sigval.name}; all workers were stopped"
    except Exception as err:  # noqa: BLE001 - rendezvous timeouts, unreachable master, ...
        return 1, _launcher_failure(err, specs.run_dir)
    finally:
        specs.stop_console()
    return 0, ""


def launch(cfg: RunConfig) -> int:
    """Run ``cfg`` to completion and return the exit code (0, the failed worker's, 128+signal, or 2 for workers that
    never joined the job's process group)."""
    from .hang import hang_monitor
    from ..meter.profile import parse_steps

    steps = parse_steps(cfg.profile) if cfg.profile else None  # a bad --profile fails here, before anything starts
    if cfg.fault_tolerant is not None:  # G torch jobs and a lighthouse; each job comes back here without the flag
        from . import replicas

        replicas.check(cfg)
        return replicas.launch(cfg, functools.partial(_run_dir, cfg, resolve(cfg)))
    place = resolve(cfg)
    found = None
    if place.source == "slurm":  # SLURM's node name -> its address (fails in one line, before anything starts)
        addr, how = slurm.master_address(place.master_addr, place.master_port, place.nodes_text)
        found = f"the job's first node {place.master_addr} is at {addr} ({how})" if addr != place.master_addr else None
        place = dataclasses.replace(place, master_addr=addr)
    node = node_address(place.master_addr, place.master_port) if place.master_addr is not None else None
    run_dir = _run_dir(cfg, place)
    torchrun_args = _torchrun_args(cfg, place, node[0] if node else None)

    from . import logs

    gpus = 0 if cfg.cpu else visible_gpus()
    env = _worker_variables(cfg, place, run_dir, steps, gpus, node)
    device = f"{gpus} GPU{'s' if gpus > 1 else ''}" if gpus else "CPU"
    world = place.nproc * place.nnodes
    here = f", this node {node[0]}" if node else ""
    where = f"node {place.node_rank} of {place.nodes_text} ({place.source}, master {place.master_addr}:{place.master_port}{here})" if place.nnodes > 1 else "1 node"
    size = f"{place.nproc * place.min_nodes}..{world} (elastic, --max-restarts {place.max_restarts})" if place.elastic else str(world)
    logs.say(f"{place.nproc} worker{'s' if place.nproc > 1 else ''} on {device}, {where}, world size {size}; logs: {run_dir}")
    if found:
        logs.say(found)

    specs = logs.RankLogsSpecs(run_dir, console_ranks=None if cfg.all_ranks else {0}, prefixed=cfg.all_ranks)
    end_hang = functools.partial(_stop_workers, specs, cfg.hang_timeout) if cfg.hang_timeout else None
    settle = min(30.0, cfg.hang_timeout or 30.0)  # a rank that cannot report (stuck holding the GIL) delays the verdict so long
    with _worker_env(env), logs.torch_logs_to(os.path.join(run_dir, "launcher.log"), specs.attempts.watch), logs.restored_signal_handlers(), \
            hang_monitor(run_dir, world if place.nnodes == 1 else None, expect=place.nproc, end_hang=end_hang, settle=settle):
        code, summary = _supervise(torchrun_args, specs)
    if code != 0 and specs.attempts.hang:  # the last attempt was stopped for a hang: that is the story, not SIGKILL
        code, summary = HANG_EXIT, f"hang: {specs.attempts.hang}; stopped after --hang-timeout {cfg.hang_timeout:g} s"
    alone = logs.no_group_line(specs) if code == 0 and not cfg.allow_no_group else None
    if alone:  # N copies of a one-process script, each writing the same outputs, are no N-rank job: refused
        code, summary = 2, alone
    if cfg.find_batch:
        found = find_batch_line(run_dir, cfg.target if cfg.module else os.path.basename(cfg.target), code)
        if found:
            logs.say(found)  # before the failure summary, which stays the last line
    if summary:
        logs.say(summary)
    return code


def find_batch_line(run_dir: str, script: str, exit_code: int) -> str | None:
    """The launcher's closing line for ``--find-batch`` (None: nothing to add to a failure summary).

    >>> find_batch_line("multigpu_logs/train-x", "train.py", 0)
    '--find-batch: micro-batch 37 per rank fits on all 2 ranks (...); plan: global batch 128 = 2 ranks x 32 x 2 accumulation; ...'
    """
    path = contract.find_batch_path(run_dir)
    try:
        rec = contract.read_find_batch(run_dir)
    except FileNotFoundError:
        if exit_code != 0:
            return None  # the failure summary says what happened; the search may never have been reached
        # The exit code stays the workers' 0: the script trained to the end with its own batch
        # plan, and a job scheduler or a CI step should not see a finished run as failed; the
        # launcher's exit code is always the workers' (docs/launcher.md). This line says what to fix.
        return (f"--find-batch: {script} did not call mg.find_micro_batch (or mg.find_sequence_length), so nothing was "
                f"searched; in the script, call it when mg.find_batch_requested() is true (docs/batch-size.md)")
    except (OSError, ValueError) as err:
        return f"--find-batch: cannot read {path}: {err}"
    trials = rec["trials"]
    budget = f", budget {rec['memory_budget'] / 2**20:,.1f} MiB" if rec.get("memory_budget") else ""
    if "sequence_length" in rec:  # mg.find_sequence_length's search (long sequences, docs/context.md)
        return (f"--find-batch: a sequence of {rec['sequence_length']} tokens fits on all {rec['world_size']} ranks "
                f"(limit: {rec['limit']}{budget}, {len(trials)} trials); details: {path}")
    line = (f"--find-batch: micro-batch {rec['micro_batch']} per rank fits on all {rec['world_size']} ranks "
            f"(limit: {rec['limit']}{budget}, {len(trials)} trials); ")
    plan = rec["plan"]
    if plan is None:
        line += "no plan: the script passed no global_batch; "
    else:
        line += (f"plan: global batch {plan['global_batch']} = {plan['world_size']} ranks x {plan['micro_batch']} x "
                 f"{plan['accum_steps']} accumulation; ")
    return line + f"details: {path}"


def run(
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    nproc: int | None = None,
    cpu: bool = False,
    nnodes: int | str | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    max_restarts: int | None = None,
    all_ranks: bool = False,
    log_dir: str | None = None,
    profile: str | None = None,
    find_batch: bool = False,
    memory_budget: str | int | None = None,
    hang_timeout: float | None = None,
    allow_no_group: bool = False,
    rdzv_timeout: float = RunConfig.rdzv_timeout,
    rdzv_last_call: float = RunConfig.rdzv_last_call,
    node_timeout: float = RunConfig.node_timeout,
    fault_tolerant: int | None = None,
    lighthouse: str | None = None,
) -> int:
    """Run ``target`` on ``nproc`` processes per node via torch's elastic launcher; return the exit code.

    Raises ``UsageError`` for bad arguments (nothing has started then).

    >>> from multigpu.launch import run
    >>> code = run("train.py", ["--epochs", "2"], nproc=2, cpu=True)
    >>> code = run("pkg.train", module=True, nnodes=2, node_rank=0, master="node0:29500")
    >>> code = run("train.py", nproc=2, cpu=True, find_batch=True, memory_budget="2GiB")
    >>> code = run("train.py", nnodes="1:3", node_rank=0, master="node0:29500", hang_timeout=600)
    """
    cfg = RunConfig(target=target, args=tuple(str(a) for a in args), module=module, nproc=nproc, cpu=cpu, nnodes=nnodes,
                    node_rank=node_rank, master=master, max_restarts=max_restarts, all_ranks=all_ranks, log_dir=log_dir,
                    profile=profile, find_batch=find_batch, memory_budget=memory_budget, hang_timeout=hang_timeout,
                    allow_no_group=allow_no_group, rdzv_timeout=rdzv_timeout, rdzv_last_call=rdzv_last_call, node_timeout=node_timeout,
                    fault_tolerant=fault_tolerant, lighthouse=lighthouse)
    return launch(cfg)


def main(args: argparse.Namespace) -> int:
    """Entry of ``multigpu run``."""
    return launch(from_args(args))
