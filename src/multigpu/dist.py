"""The distributed runtime: ``mg.init()`` and the ``Dist`` it yields.

``init()`` reads the environment that the launcher left (torchrun, SLURM's
``srun``, or nothing: one process), picks the backend, sets the device,
seeds every RNG the same way on every rank, creates the process group and
always destroys it. With one process it still creates a (one-rank) process
group, so that DDP, collectives and checkpoints take one code path whatever
the world size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as tdist

from .errors import UsageError, report_usage_error
from .runtime.contract import RAISED_AT, record_failure

BACKENDS = ("nccl", "gloo", "mpi")


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the job. Obtain it from ``mg.init()``.

    >>> with mg.init(seed=0) as dist:
    ...     print(dist.rank, dist.world_size, dist.device)
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that prints, logs and writes summaries."""
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer; unset it or fix the launcher") from None


def slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``'gpu[03-05,07],cpu1'`` -> ``'gpu03'``.

    SLURM compresses node lists; ``scontrol show hostnames`` expands them but
    is not on every compute node, and the first host is all we need.
    """
    first, depth = "", 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    # Each bracket group stands for its first element: "n[01-04,09]" -> "n01".
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def read_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun, SLURM or nothing."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = _env_int("RANK")
        world = _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK", rank)
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
    elif "SLURM_PROCID" in os.environ and _env_int("SLURM_NTASKS", 1) > 1:
        # srun started one task per GPU directly, without torchrun.
        rank = _env_int("SLURM_PROCID")
        world = _env_int("SLURM_NTASKS")
        local_rank = _env_int("SLURM_LOCALID", 0)
        local_world = _env_int("SLURM_NTASKS_PER_NODE", None) or max(1, world // _env_int("SLURM_NNODES", 1))
    else:
        return 0, 0, 1, 1
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside world size {world}; check RANK/WORLD_SIZE set by the launcher")
    return rank, local_rank, world, local_world


def _rendezvous_env(world: int) -> None:
    """Make sure MASTER_ADDR/PORT exist for ``env://`` (SLURM without torchrun)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    if "SLURM_JOB_NODELIST" in os.environ and world > 1:
        addr = slurm_first_host(os.environ["SLURM_JOB_NODELIST"])
        # A port derived from the job id, so two jobs sharing a node differ.
        port = 20000 + (_env_int("SLURM_JOB_ID", 0) % 20000)
        _set_env("MASTER_ADDR", addr)
        _set_env("MASTER_PORT", str(port))
        return
    if world > 1:
        raise UsageError("MASTER_ADDR/MASTER_PORT are not set for a multi-process run; start it with `multigpu run` or torchrun")


def _set_env(name: str, value: str) -> None:
    old = os.environ.get(name)
    if old != value:
        print(f"multigpu: setting {name}: {old!r} -> {value!r}", file=sys.stderr, flush=True)
        os.environ[name] = value


def pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)} (or None to choose automatically)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs a CUDA GPU and none is visible; use backend='gloo' (or None) on CPU")
    if not tdist.is_backend_available(backend):
        raise UsageError(f"backend {backend!r} is not built into this torch {torch.__version__}; use 'gloo'")
    return backend


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) with the same value."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise UsageError(f"timeout must be positive seconds, got {timeout}; use e.g. timeout=600")
    return datetime.timedelta(seconds=float(timeout))


@contextlib.contextmanager
def init(
    backend: str | None = None,
    seed: int | None = 0,
    timeout: float | datetime.timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[Dist]:
    """Start the process group, set the device, seed; always tear down.

    ``backend=None`` picks nccl with CUDA, gloo on CPU. ``device="cpu"``
    forces CPU on a machine with GPUs. ``seed=None`` leaves the RNGs alone.
    ``timeout`` (seconds) bounds every collective (default: PyTorch's, 10 min).
    A ``UsageError`` raised inside the block ends the process with its one
    line on stderr and exit status 2.

    >>> with mg.init(seed=0) as dist:
    ...     model = mg.wrap(Net().to(dist.device), "ddp")
    """
    try:
        rank, local_rank, world, local_world = read_env()
        if device is not None and torch.device(device).type == "cpu":
            backend = backend or "gloo"
        backend = pick_backend(backend)
        device = _device(device, backend, local_rank)
        created = _start_group(backend, rank, world, timeout)
        if seed is not None:
            seed_everything(seed)
        dist = Dist(rank, local_rank, world, local_world, device, backend)
    except UsageError as err:
        report_usage_error(err)
        raise SystemExit(2) from None
    clean_exit = None
    try:
        try:
            yield dist
        except SystemExit as err:
            if err.code not in (0, None):
                raise
            clean_exit = err  # sys.exit(0) inside the block: a normal end
        run_teardown()  # still inside: a failure here (a background checkpoint write) is reported like any
    except UsageError as err:
        _abandon(err, created)
        report_usage_error(err)
        stop = SystemExit(2)
        setattr(stop, RAISED_AT, getattr(err, RAISED_AT, None))
        raise stop from None
    except BaseException as err:
        _abandon(err, created)
        raise
    if created and tdist.is_initialized():
        # Leave together: a rank that tears down its gloo pairs while a peer is
        # still finishing its last collective can abort that peer at exit
        # ("terminate called without an active exception", seen here in 1 of
        # ~20 two-rank demo runs before this barrier).
        if world > 1:
            tdist.barrier()
        tdist.destroy_process_group()
    if clean_exit is not None:
        raise clean_exit


def _device(device: str | torch.device | None, backend: str, local_rank: int) -> torch.device:
    """This rank's device (a GPU by local rank under nccl), made current on CUDA."""
    if device is None:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise UsageError(
                f"local rank {local_rank} needs GPU {device.index} but {torch.cuda.device_count()} are visible; "
                f"start at most {torch.cuda.device_count()} processes per node (-n {torch.cuda.device_count()})"
            )
        torch.cuda.set_device(device)
    return device


def _start_group(backend: str, rank: int, world: int, timeout: float | datetime.timedelta | None) -> bool:
    """Create the default process group unless one exists; True when this call created it (and so ends it)."""
    if tdist.is_initialized():
        return False
    kwargs = {"timeout": _timeout(timeout)} if timeout is not None else {}
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # One process: an in-memory store, no port, nothing to collide with.
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        _rendezvous_env(world)
        tdist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, **kwargs)
    return True


def _abandon(err: BaseException, created: bool) -> None:
    """After a failure in the block: record it, then drop the process group without waiting for anyone."""
    _TEARDOWN.clear()  # nothing collective after a failure (a later mg.init block must not inherit it)
    # Recorded first (the failure summary orders ranks by it): tearing down closes the
    # connections, and the peers' "Connection reset by peer" must come after.
    record_failure(err)
    # No barrier here: the other ranks may be inside a collective, and
    # waiting for them would turn a crash into a hang (torchtitan #1342).
    if created and tdist.is_initialized():
        tdist.destroy_process_group()


# Work to finish on every rank before ``mg.init`` tears the process group down (a checkpoint
# written in the background: its completion is collective).
_TEARDOWN: list[Callable[[], Any]] = []


def at_teardown(fn: Callable[[], Any]) -> None:
    """Run ``fn`` (once) when the ``mg.init`` block ends normally, before the process group goes."""
    if fn not in _TEARDOWN:
        _TEARDOWN.append(fn)


def run_teardown() -> None:
    while _TEARDOWN:
        _TEARDOWN.pop(0)()


def get_rank() -> int:
    """This process's global rank (0 outside a process group)."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank()
    return _env_int("RANK", 0) or 0


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (flushed, so launcher logs stay ordered).

    >>> mg.print0(f"step {step} loss {loss:.3f}")
    """
    if get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
