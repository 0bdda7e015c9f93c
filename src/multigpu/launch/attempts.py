"""What one ``multigpu run`` knows across the attempts of its workers.

torch's agent starts the workers again after a failure (``--max-restarts``), a node
that joins or leaves (``--nnodes MIN:MAX``) or a hang the launcher ended
(``--hang-timeout``). Each start is an attempt: numbered here (torch's restart count
misses joins), with its own log directory, and announced in one line that says why
it started. The log files themselves are ``logs.RankLogsSpecs``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
from typing import Callable

from ..runtime import contract


def how_short(exitcode: int) -> str:
    """How a worker ended, in a few words: ``SIGKILL``, ``exit code 1``."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class FailureWatch(logging.Handler):
    """Remembers the failure torch's process context reports before a restart.

    torch logs ``"failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"``
    with the values as arguments; reading ``record.args`` (not the text) lets the
    restart line name the rank. If a torch version words it otherwise, the line
    just says "a worker failed".
    """

    def __init__(self):
        super().__init__(logging.ERROR)
        self.last: tuple[int, int] | None = None  # (exit code, local rank)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("failed (exitcode") and len(args) >= 2:
            with contextlib.suppress(TypeError, ValueError):
                self.last = (int(args[0]), int(args[1]))


class Attempts:
    """The attempts of one launch: their count, torch's restarts, the nodes and world size of the
    last one, and why it ended (``hang``: the verdict when ``--hang-timeout`` stopped its workers).

    >>> attempts = Attempts(say=print); attempt, attempt_dir = attempts.begin(envs, "multigpu_logs/train-1")
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self.watch = FailureWatch()  # torch's log of the worker that failed, for the restart line
        self.hang: str | None = None
        self.launch_id = secrets.token_hex(8)  # this launch's, in every attempt (contract.LAUNCH_ID_ENV)
        self.global_ranks: dict[int, int] = {}  # local rank -> global rank, last attempt
        self._count = self._restarts = 0
        self._sizes: tuple[int, int] | None = None  # (nodes, world size) of the last attempt

    def begin(self, envs: dict[int, dict[str, str]], run_dir: str) -> tuple[int, str]:
        """Number the attempt whose workers' environments are ``envs`` (each gets the attempt and the
        launch id), make its directory, and say why it starts when it is not the first."""
        env0 = next(iter(envs.values()), {})
        restart = int(env0.get("TORCHELASTIC_RESTART_COUNT", "0"))
        attempt, self._count = self._count, self._count + 1
        attempt_dir = os.path.join(run_dir, f"attempt_{attempt}")
        os.makedirs(attempt_dir, exist_ok=True)
        if restart > self._restarts:
            self._restarts = restart
            what = "a worker failed"
            if self.hang:
                what, self.hang = "the workers were stopped for a hang (--hang-timeout)", None
            elif self.watch.last is not None and self.watch.last[1] in self.global_ranks:
                code, local_rank = self.watch.last
                what = f"rank {self.global_ranks[local_rank]} failed ({how_short(code)})"
            self.watch.last = None
            self._say(f"{what}; restart {restart} of {env0.get('TORCHELASTIC_MAX_RESTARTS', '?')}, logs in {attempt_dir}")
        self._say_membership(env0, attempt_dir)
        self.global_ranks = {local_rank: int(env["RANK"]) for local_rank, env in envs.items()}
        for env in envs.values():
            env[contract.ATTEMPT_ENV] = str(attempt)
            env[contract.LAUNCH_ID_ENV] = self.launch_id
        return attempt, attempt_dir

    def _say_membership(self, env: dict[str, str], attempt_dir: str) -> None:
        """One line when an attempt has other nodes than the last: a node left, or joined (elastic --nnodes)."""
        with contextlib.suppress(KeyError, ValueError):
            sizes = int(env["GROUP_WORLD_SIZE"]), int(env["WORLD_SIZE"])
            if self._sizes is not None and sizes != self._sizes:
                (n0, w0), (n1, w1) = self._sizes, sizes
                change = f"{abs(n1 - n0)} node{'s' if abs(n1 - n0) != 1 else ''} {'joined' if n1 > n0 else 'left'}" if n1 != n0 else "membership changed"
                self._say(f"{change}: {n0} -> {n1} node{'s' if n1 != 1 else ''}, world size {w0} -> {w1}; "
                          f"the workers start again (a script with mg.Checkpointer resumes from its newest checkpoint), logs in {attempt_dir}")
            self._sizes = sizes
