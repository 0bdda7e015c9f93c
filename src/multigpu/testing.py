"""Run a function on N real processes over gloo, for tests and examples.

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh processes
(forked from a forkserver that only imported torch, or spawned interpreters
where there is none: no inherited threads or OpenMP state), sets the
variables torchrun would set, enters ``mg.init()`` and returns the values of
``fn(dist, *args)`` ordered by rank. ``fn`` must be importable (defined at
module level). A rank that raises or hangs fails the whole call with that
rank's traceback, and no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """Fresh processes forked from a server that imported torch once (Linux), else spawned ones.

    The forkserver only imports (no tensor op has run there, so no OpenMP pool or
    other thread is inherited): each rank starts in ~0.1 s instead of paying
    torch's ~3 s import, which on a 2-core machine is most of a test's time.
    torch._dynamo is preloaded too: every optimizer step imports it (torch.optim's
    dynamo guards), 2-2.5 s per rank otherwise; the distributed APIs after it cost 0.1 s.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "multigpu", "torch._dynamo", "torch.distributed.fsdp",
                               "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
                               "torch.distributed.checkpoint"])
    return ctx


class _CallerStdio:
    """Pickles as the caller's current stdout/stderr descriptors; ``_use_stdio`` puts them in place in the child.

    A forked-from-server child would otherwise write to the server's descriptors,
    fixed when the server started (pytest's capture of some earlier test).
    """

    def __reduce__(self):
        from multiprocessing import reduction

        return (tuple, ([reduction.DupFd(1), reduction.DupFd(2)],))


def _use_stdio(fds) -> None:
    for handle, target in zip(fds, (1, 2)):
        fd = handle.detach() if hasattr(handle, "detach") else handle
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _worker(fn, rank, world_size, port, seed, env, args, kwargs, out, stdio=None, environ=None) -> None:
    if stdio is not None:
        _use_stdio(stdio)
    if environ is not None:  # the caller's environment now, not the forkserver's from when it started
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    reported = False
    try:
        import torch

        torch.set_num_threads(1)
        from .dist import init

        with init(backend="gloo", seed=seed, device="cpu", timeout=120) as dist:
            try:
                result = fn(dist, *args, **kwargs)
            except BaseException:  # reported before the group goes: the other ranks fail when it does
                out.put((rank, False, traceback.format_exc()))
                reported = True
                raise
        # Plain pickle (not torch's shared-memory reductions): the result must
        # outlive this process.
        out.put((rank, True, pickle.dumps(result)))
    except SystemExit:  # mg.init's verdict on a UsageError (exit 2), after its cause
        out.put((rank, False, traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - report everything
        if not reported:
            out.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    seed: int = 0,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    children: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(dist, *args, **kwargs)`` on ``world_size`` gloo ranks; results by rank.

    ``children=True`` lets a rank start processes of its own (DataLoader
    workers): its process is then not daemonic, which ``multiprocessing``
    requires; it is still joined or killed before ``spawn`` returns.

    >>> def step(dist, x):
    ...     return dist.rank * x
    >>> mg.testing.spawn(step, 2, 10)
    [0, 10]
    """
    ctx = _context()
    forked = (_CallerStdio(), dict(os.environ)) if ctx.get_start_method() == "forkserver" else ()
    out = ctx.Queue()
    port = free_port()
    base_env = {"OMP_NUM_THREADS": "1"} | (env or {})
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, seed, base_env, args, kwargs, out, *forked),
                    daemon=not children)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout

    def drain(block: float) -> None:
        """Collect every report that is in (waiting up to ``block`` s for the first)."""
        while True:
            try:
                rank, ok, payload = out.get(timeout=block)
            except queue.Empty:
                return
            if ok:
                results[rank] = pickle.loads(payload)
            else:  # a rank's cause, then what mg.init made of it
                errors[rank] = errors[rank] + payload if rank in errors else payload
            block = 0.01

    try:
        while len(results) + len(errors) < world_size and not errors:
            drain(0.2)
            silent = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results and r not in errors]
            if silent:
                drain(1.0)  # a report may still be in flight from a rank that just exited
                for r in silent:
                    if r not in results and r not in errors:
                        errors[r] = f"rank {r} exited with code {procs[r].exitcode} without a result"
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in results]
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
        if errors:  # the others' fate too: the first failure's cause is often on another rank
            drain(2.0)
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in results and r not in errors:
                    errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = next(iter(errors))  # the first to report: the others usually failed because it did
        others = "".join(f"\n--- rank {r} too:\n{errors[r]}" for r in errors if r != first)
        raise RuntimeError(f"rank {first} failed:\n{errors[first]}{others}")
    return [results[r] for r in range(world_size)]
