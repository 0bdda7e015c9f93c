"""What ``multigpu run`` needs from the instruments: worker variables, ``--profile``, the hang verdict.

The launcher tells its workers where the run directory is and which steps to
profile through variables it sets when it starts them (like torchrun's own
RANK/WORLD_SIZE): a launcher-to-worker channel, never a user setting, encoded
in ``multigpu.launch.contract``. It watches the run directory for the
watchdogs' reports and prints one verdict.

    env.update(worker_env(run_dir, profile=cfg.profile))
    with hang_monitor(run_dir, world_size):
        run_workers(...)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..launch.contract import worker_env as _multigpu_env
from .profile import parse_steps
from .watchdog import HangMonitor, flight_recorder_env


def worker_env(run_dir: str, profile: str | None = None, cuda: bool = True) -> dict[str, str]:
    """Variables for the workers: the run directory, the profiled steps, NCCL's flight recorder.

    >>> worker_env("runs/x", profile="10:15", cuda=False)
    {'MULTIGPU_RUN_DIR': '/abs/runs/x', 'MULTIGPU_PROFILE': '10:15'}
    """
    # A bad --profile spec fails in the launcher, not in N workers.
    env = _multigpu_env(run_dir, profile=parse_steps(profile) if profile else None)
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
