"""What ``multigpu run`` needs from the instruments: worker variables, ``--profile``, the hang verdict.

The launcher tells its workers where the run directory is and which steps to
profile through variables it sets when it starts them (like torchrun's own
RANK/WORLD_SIZE): a launcher-to-worker channel, never a user setting. It
watches the run directory for the watchdogs' reports and prints one verdict.

    env.update(worker_env(run_dir, profile=cfg.profile))
    with hang_monitor(run_dir, world_size):
        run_workers(...)
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from .meter import PROFILE_ENV, RUN_DIR_ENV
from .profile import parse_steps
from .watchdog import HangMonitor, flight_recorder_env


def worker_env(run_dir: str, profile: str | None = None, cuda: bool = True) -> dict[str, str]:
    """Variables for the workers: the run directory, the profiled steps, NCCL's flight recorder.

    >>> worker_env("runs/x", profile="10:15", cuda=False)
    {'MULTIGPU_RUN_DIR': '/abs/runs/x', 'MULTIGPU_PROFILE': '10:15'}
    """
    env = {RUN_DIR_ENV: os.path.abspath(run_dir)}
    if profile:
        start, stop = parse_steps(profile)  # a bad spec fails in the launcher, not in N workers
        env[PROFILE_ENV] = f"{start}:{stop}"
    if cuda:
        env.update(flight_recorder_env(run_dir))
    return env


@contextlib.contextmanager
def hang_monitor(run_dir: str, world_size: int | None, **kw) -> Iterator[HangMonitor]:
    """Watch ``run_dir`` while the workers run; prints the verdict once if ranks report a stall.

    ``world_size=None`` on one node of several (its reports cover its own ranks only);
    ``expect`` is then the number of local ranks to wait for.
    """
    mon = HangMonitor(run_dir, world_size, **kw).start()
    try:
        yield mon
    finally:
        mon.stop()
