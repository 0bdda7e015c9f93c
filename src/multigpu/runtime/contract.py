"""The launcher -> worker contract of ``multigpu run``: the one module that encodes and decodes it.

The launcher talks to the workers it starts through environment variables it
sets for them (as torchrun does with ``RANK`` and ``WORLD_SIZE``): a
launcher-to-worker channel, never a user setting. The workers answer through a
file in the run directory::

    MULTIGPU_RUN_DIR         always: the run's log directory (StepMeters log there, watchdogs report there)
    MULTIGPU_PROFILE         --profile START:STOP: the steps every StepMeter profiles
    MULTIGPU_FIND_BATCH      "1" under --find-batch: the script should call mg.find_micro_batch
    MULTIGPU_MEMORY_BUDGET   --memory-budget SIZE, in bytes: the search's budget when the call gives none
    MULTIGPU_VERIFY          "1" under `multigpu verify`: StepMeters log every step and probe (meter/probe.py)
    MULTIGPU_VERIFY_FLOOR    "1" in verify's floor run: StepMeter.steps hands the script each batch's samples in
                             another order, and each gradient is rounded once more (meter/probe.py)
    MULTIGPU_ATTEMPT         always: 0, 1, ... for each start of the workers (restarts, and nodes joining)
    MULTIGPU_LAUNCH_ID       always: a fresh id per `multigpu run` (per node), the same in all its attempts
                             (a StepMeter appends to a metrics.jsonl only after an earlier attempt of it: sinks.py)
    MULTIGPU_HANG_TIMEOUT    --hang-timeout S: every StepMeter's watchdog reports a stall after S seconds at most
    MULTIGPU_REPLICA_GROUP   --fault-tolerant G: which replica group (0..G-1) this worker's torch job is
    MULTIGPU_REPLICA_GROUPS  --fault-tolerant G: G, the replica groups the launcher started
    MULTIGPU_REPLICAS_DIR    --fault-tolerant G: where each group's rank 0 appends its committed steps
                             (group<g>.jsonl, parallel/fault_tolerant.py); TORCHFT_LIGHTHOUSE is torchft's own
    MULTIGPU_REPLICA_HOST    --fault-tolerant G on several nodes: this node's address the other nodes reach, which
                             the groups' torchft Managers advertise (their store, quorum server and state transfer)
    MULTIGPU_MEMORY_STEP     "1" under `multigpu tune`: every StepMeter takes one warm-up step's real peak memory
                             (meter/footprint.py's MemoryStep) into its summary
    <run dir>/find_batch.json  the agreed search result (local rank 0 of each node), for the launcher's last line
    <attempt dir>/rank<r>.failure.json  the exception that ended a worker, with the time it was raised and the
                                        exit code it ends with (written by worker.py, read by the failure summary)
    <attempt dir>/rank<r>.nogroup.json  a worker of a job of several that never joined the job's process group
                                        (written by worker.py, read by the launcher at the end of a run)

Launcher side: ``worker_env`` and ``read_find_batch``. Worker side: ``run_dir``,
``attempt``, ``launch_id``, ``profile_window``, ``memory_step_requested``, ``find_batch_requested``, ``memory_budget``, ``hang_timeout`` and
``write_find_batch``; ``failure_path`` and ``no_group_path`` for both. The standard library and ``errors`` only: meter/, the finder and the
recipes read it in every worker, so it sits in the runtime, below the launcher (``multigpu.launch``) that writes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterator

from ..errors import UsageError

RUN_DIR_ENV = "MULTIGPU_RUN_DIR"
PROFILE_ENV = "MULTIGPU_PROFILE"
FIND_BATCH_ENV = "MULTIGPU_FIND_BATCH"
MEMORY_BUDGET_ENV = "MULTIGPU_MEMORY_BUDGET"
VERIFY_ENV = "MULTIGPU_VERIFY"  # "1" under `multigpu verify`: every StepMeter probes (meter/probe.py)
VERIFY_FLOOR_ENV = "MULTIGPU_VERIFY_FLOOR"  # "1": ... and perturbs the run by rounding only (verify's floor run)
HANG_TIMEOUT_ENV = "MULTIGPU_HANG_TIMEOUT"
MEMORY_STEP_ENV = "MULTIGPU_MEMORY_STEP"  # "1": StepMeters measure a warm-up step's peak memory (tune's runs)
ATTEMPT_ENV = "MULTIGPU_ATTEMPT"  # set per attempt by launch/logs.py (torch's restart count misses joins)
LAUNCH_ID_ENV = "MULTIGPU_LAUNCH_ID"  # set with it: which launch the attempt belongs to
REPLICA_GROUP_ENV = "MULTIGPU_REPLICA_GROUP"  # --fault-tolerant: this torch job's replica group
REPLICA_GROUPS_ENV = "MULTIGPU_REPLICA_GROUPS"  # --fault-tolerant: how many the launcher started
REPLICAS_DIR_ENV = "MULTIGPU_REPLICAS_DIR"  # --fault-tolerant: the groups' step records
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the lighthouse's address
REPLICA_HOST_ENV = "MULTIGPU_REPLICA_HOST"  # --fault-tolerant on several nodes: what the other nodes reach here at
VERIFY_DIR = "verify"  # <run dir>/verify/: the probe's records
FIND_BATCH_FILE = "find_batch.json"
RAISED_AT = "_multigpu_raised_at"  # set on an exception by the code that caught it first (mg.init)


def failure_path(attempt_dir: str, rank: int) -> str:
    """Where the worker of global ``rank`` records the exception that ended it."""
    return os.path.join(attempt_dir, f"rank{rank}.failure.json")


def no_group_path(attempt_dir: str, rank: int) -> str:
    """Where the worker of global ``rank`` records that it never joined the job's process group."""
    return os.path.join(attempt_dir, f"rank{rank}.nogroup.json")


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fp:
            return json.load(fp)
    except (OSError, ValueError):
        return None


def read_failure(attempt_dir: str, rank: int) -> dict[str, Any] | None:
    """The record worker.py left for ``rank`` (None: it ended without one: killed, or not started by us)."""
    return _read(failure_path(attempt_dir, rank))


def read_no_group(attempt_dir: str, rank: int) -> dict[str, Any] | None:
    """The record of a worker that never joined the job's process group (None: it joined, or could not tell)."""
    return _read(no_group_path(attempt_dir, rank))


def exit_code_of(err: BaseException) -> int:
    """The status a worker ended by ``err`` exits with: ``sys.exit``'s, 2 for a ``UsageError`` (worker.py and
    ``mg.init`` print its line and exit 2), else 1, Python's status for an uncaught exception."""
    if isinstance(err, SystemExit):
        return 0 if err.code is None else err.code if isinstance(err.code, int) else 1
    code = getattr(err, "exit_code", 1)
    return code if isinstance(code, int) else 1


def _attempt_record(path_of, rec: dict[str, Any]) -> None:
    """Write ``rec`` as this worker's record (``path_of(attempt dir, rank)``), atomically; nothing outside the launcher."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # the launcher puts it in the attempt's folder
    if not error_file:
        return
    path = path_of(os.path.dirname(error_file), int(os.environ.get("RANK", "0")))
    try:
        with open(f"{path}.tmp", "w") as fp:
            json.dump(rec, fp)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass  # the launcher falls back to what it sees itself


def record_failure(err: BaseException) -> None:
    """Worker side: write ``err`` to this rank's failure record at once (once per exception).

    Called where the exception is first caught (``mg.init``; worker.py for other
    scripts), before any teardown: the peers see its symptoms only after that,
    and the agent may SIGTERM this rank before it gets further. The record keeps
    the exit code the rank is on its way to, so a rank stopped while exiting is
    reported with it (a usage error's 2, not 1).
    """
    if getattr(err, RAISED_AT, None) is not None:
        return
    now = time.time()
    try:
        setattr(err, RAISED_AT, now)
    except (AttributeError, TypeError):  # an exception type with __slots__
        pass
    message = " ".join(str(err).split())
    _attempt_record(failure_path, {"time": now, "type": type(err).__name__, "exit_code": exit_code_of(err),
                                   "message": message if len(message) <= 500 else message[:497] + "...", "pid": os.getpid()})


def record_no_group(world_size: int, largest: int) -> None:
    """Worker side: this rank of a ``world_size``-rank job ended without joining its process group (the largest
    group it made had ``largest`` ranks, 0: none): it ran the script alone."""
    _attempt_record(no_group_path, {"world_size": world_size, "largest_group": largest, "pid": os.getpid()})


# -- launcher side ----------------------------------------------------------------------------
@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, with None, leave alone) variables the workers of launches inside will inherit; restore after.

    >>> with environ(OMP_NUM_THREADS="1", MULTIGPU_VERIFY="1"):
    ...     run("train.py", nproc=2, cpu=True)
    """
    values = {k: v for k, v in values.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def worker_env(run_dir: str, *, profile: tuple[int, int] | None = None, find_batch: bool = False,
               memory_budget: int | None = None, verify: bool = False,
               hang_timeout: float | None = None) -> dict[str, str]:
    """The ``MULTIGPU_*`` variables for the workers (values already checked by the launcher).

    >>> worker_env("runs/x", profile=(10, 15), find_batch=True, memory_budget=2 << 20)
    {'MULTIGPU_RUN_DIR': '/abs/runs/x', 'MULTIGPU_PROFILE': '10:15', 'MULTIGPU_FIND_BATCH': '1', 'MULTIGPU_MEMORY_BUDGET': '2097152'}
    """
    env = {RUN_DIR_ENV: os.path.abspath(run_dir)}
    if profile is not None:
        env[PROFILE_ENV] = f"{profile[0]}:{profile[1]}"
    if find_batch:
        env[FIND_BATCH_ENV] = "1"
    if memory_budget is not None:
        env[MEMORY_BUDGET_ENV] = str(memory_budget)
    if verify:
        env[VERIFY_ENV] = "1"
    if hang_timeout is not None:
        env[HANG_TIMEOUT_ENV] = f"{hang_timeout:g}"
    return env


def find_batch_path(run_dir: str) -> str:
    return os.path.join(run_dir, FIND_BATCH_FILE)


def read_find_batch(run_dir: str) -> dict[str, Any]:
    """The record ``write_find_batch`` left in ``run_dir``; ``FileNotFoundError`` when no search wrote one."""
    with open(find_batch_path(run_dir)) as fp:
        return json.load(fp)


# -- worker side ------------------------------------------------------------------------------
def run_dir() -> str | None:
    """The run directory of ``multigpu run`` (None outside it)."""
    return os.environ.get(RUN_DIR_ENV)


def replica_host() -> str | None:
    """This node's address for the other nodes' replica groups (``--fault-tolerant`` on several nodes), else None."""
    return os.environ.get(REPLICA_HOST_ENV) or None


def replica_group() -> tuple[int, int, str, str] | None:
    """(group, groups, lighthouse address, record directory) under ``multigpu run --fault-tolerant``, else None."""
    group, groups = os.environ.get(REPLICA_GROUP_ENV, ""), os.environ.get(REPLICA_GROUPS_ENV, "")
    if not (group.isdigit() and groups.isdigit()):
        return None
    return int(group), int(groups), os.environ.get(LIGHTHOUSE_ENV, ""), os.environ.get(REPLICAS_DIR_ENV, "")


def attempt() -> int:
    """Which start of the workers this is under ``multigpu run`` (0 outside it, and for the first)."""
    text = os.environ.get(ATTEMPT_ENV, "0")
    return int(text) if text.isdigit() else 0


def launch_id() -> str | None:
    """The id of the ``multigpu run`` that started this worker, the same in each of its attempts (None outside it)."""
    return os.environ.get(LAUNCH_ID_ENV) or None


def memory_step_requested() -> bool:
    """Whether the launch asked StepMeters for a step's real peak memory (``multigpu tune``'s runs of a script)."""
    return os.environ.get(MEMORY_STEP_ENV) == "1"


def profile_window() -> str | None:
    """``"START:STOP"`` from ``multigpu run --profile`` (None without it)."""
    return os.environ.get(PROFILE_ENV) or None


def verify_requested() -> bool:
    """True in a worker started by ``multigpu verify``."""
    return os.environ.get(VERIFY_ENV) == "1"


def verify_floor_requested() -> bool:
    """True in a worker of verify's floor run: the probe reorders each batch's samples, rounds each gradient."""
    return verify_requested() and os.environ.get(VERIFY_FLOOR_ENV) == "1"


def hang_timeout() -> float | None:
    """Seconds from ``multigpu run --hang-timeout`` (None without it): the longest a watchdog may wait to report."""
    text = os.environ.get(HANG_TIMEOUT_ENV)
    try:
        value = float(text) if text else None
    except ValueError:
        value = -1.0
    if value is not None and not value > 0:
        raise UsageError(f"{HANG_TIMEOUT_ENV} must be a positive number of seconds (`multigpu run --hang-timeout` "
                         f"sets it), got {text!r}; unset it")
    return value


def find_batch_requested() -> bool:
    """True in a worker started by ``multigpu run --find-batch``: the script should run ``find_micro_batch``.

    >>> plan = mg.BatchPlan(global_batch=1024, world_size=dist.world_size)
    >>> if mg.find_batch_requested():
    ...     plan = mg.find_micro_batch(step, dist, plan=plan).plan
    """
    return os.environ.get(FIND_BATCH_ENV) == "1"


def memory_budget() -> int | None:
    """Bytes from ``multigpu run --memory-budget`` (None without it); ``UsageError`` for a value it did not write."""
    text = os.environ.get(MEMORY_BUDGET_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{MEMORY_BUDGET_ENV} must be a positive number of bytes (`multigpu run --memory-budget` "
                         f"sets it), got {text!r}; unset it or pass memory_budget= to find_micro_batch")
    return int(text)


def write_find_batch(run_dir: str, record: dict[str, Any]) -> str:
    """``record`` as ``find_batch.json`` in ``run_dir``, atomically (tmp + rename: the launcher never reads half a file)."""
    path = find_batch_path(run_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fp:
        json.dump(record, fp, indent=1)
        fp.write("\n")
    os.replace(tmp, path)
    return path
