"""One run of a workload through the launcher, for the verbs that measure runs (study, tune, verify).

Each run gets a log directory of its own: the launcher's console (its lines and rank
0's output) goes to ``console.log`` there, and the run directory is the one the launcher
created in it during this call. Found by what is new, not by the newest name, so a
directory left there by an earlier run (or a clock that steps) is never read as this one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import UsageError
from ..runtime.contract import environ


@dataclass(frozen=True)
class Launched:
    """What one launch left behind."""

    exit_code: int  # 2 when the launcher refused the arguments
    run_dir: Path | None  # None: the launcher made none (refused, or failed before)
    console: Path
    elapsed_s: float
    refusal: UsageError | None = None  # the launcher's one-line refusal; nothing started

    def failure(self) -> str:
        """Why it failed in one line: the refusal, else the launcher's summary or an error line; "" if none."""
        from .logs import failure_line

        return str(self.refusal) if self.refusal is not None else failure_line(str(self.console))


def run_once(target: str, args: Sequence[str], *, module: bool, log_dir: Path, nproc: int, cpu: bool,
             profile: str | None = None, env: dict[str, str | None] | None = None) -> Launched:
    """Launch ``target`` once with its console captured in ``log_dir/console.log``; ``env`` is set
    (None: unset) for the launch only. A ``UsageError`` of the launcher comes back as ``refusal``.

    >>> done = run_once("train.py", ["--steps", "5"], module=False, log_dir=Path("runs/a"), nproc=2, cpu=True)
    >>> done.exit_code, done.run_dir
    (0, PosixPath('runs/a/train-20260101-120000-3fa2c1'))
    """
    from . import run as launch_run  # looked up per call: the package's run, which tests may replace

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    console = log_dir / "console.log"
    before = {p.name for p in log_dir.iterdir()}
    refusal = None
    t0 = time.perf_counter()
    with open(console, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f), environ(**(env or {})):
        try:
            code = launch_run(target, list(args), module=module, nproc=nproc, cpu=cpu, log_dir=str(log_dir),
                              profile=profile)
        except UsageError as err:
            code, refusal = 2, err
    elapsed = time.perf_counter() - t0
    new = sorted(p for p in log_dir.iterdir() if p.is_dir() and p.name not in before)
    # One launch makes one run directory per node, and this node's is the only one here.
    assert len(new) <= 1, f"one launch made {len(new)} run directories in {log_dir}: {new}"
    return Launched(code, new[0] if new else None, console, elapsed, refusal)
