"""Start N local ranks in-process through PyTorch's elastic launcher and collect their return values.

This is ``torch.distributed.launcher.api.elastic_launch`` (the engine under
torchrun) with its worker output captured to files, so the parent prints one
clean table; on failure the first failing rank's error (or its stderr tail)
comes back in a ``LaunchError``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable


class LaunchError(RuntimeError):
    """A rank failed: which one, its exit code and its error text."""

    def __init__(self, rank: int, exitcode: int, message: str):
        super().__init__(f"rank {rank} failed (exit code {exitcode}): {message.strip().splitlines()[-1] if message.strip() else ''}")
        self.rank, self.exitcode, self.message = rank, exitcode, message


def _failure_text(failure) -> str:
    if not failure.error_file or not os.path.isfile(failure.error_file):
        return ""  # the rank died without recording an exception (SystemExit, a signal): use its stderr
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "") or ""
        if isinstance(msg, dict):
            msg = msg.get("message", "")
    return str(msg or "")


def _stderr_tail(log_dir: str, local_rank: int, lines: int = 30) -> str:
    for root, _, files in os.walk(log_dir):
        if os.path.basename(root) == str(local_rank) and "stderr.log" in files:
            with open(os.path.join(root, "stderr.log"), errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
    return ""


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks; ``{rank: return value}``.

    ``fn`` must be a module-level function (each worker imports it). The
    workers' stdout/stderr go to a temporary directory that is removed
    afterwards; ``timeout`` bounds the rendezvous.

    >>> launch_local(smoke_rank, 2, None, 30.0)[0]["latency_us"]
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = tempfile.mkdtemp(prefix="multigpu_launch_")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        run_id=str(uuid.uuid4()), max_restarts=0, monitor_interval=0.1,
        rdzv_configs={"join_timeout": int(timeout or 600)},
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL),
    )
    # The agent logs every start and failure at INFO/ERROR; we report failures ourselves, once.
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    old_levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, fn)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        text = _failure_text(failure) or _stderr_tail(log_dir, failure.local_rank)
        raise LaunchError(rank, failure.exitcode, text) from None
    finally:
        for lg, level in zip(loggers, old_levels):
            lg.setLevel(level)
        shutil.rmtree(log_dir, ignore_errors=True)
