"""Per-rank log files, the console view and the failure summary of ``multigpu run``.

torch's elastic agent asks a ``LogsSpecs`` where each worker's stdout/stderr
go (``reify`` sees every worker's environment, ``RANK`` included). We name the
files by *global* rank and show chosen ranks on the console with torch's own
``TailLog``: unprefixed for rank 0 by default (torch's tee path always
prefixes), ``[rank<r>] `` with ``--all-ranks``. Layout::

    <log_dir>/<run>/launcher.log                     torch's agent log (kept off the console)
    <log_dir>/<run>/attempt_<k>/rank<r>.stdout.log   one pair per worker and restart attempt
    <log_dir>/<run>/attempt_<k>/rank<r>.stderr.log
    <log_dir>/<run>/attempt_<k>/rank<r>.error.json   only for workers decorated with torch's @record

This module imports torch; ``start.py`` imports it only once the arguments
are valid, so usage errors stay fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
from typing import Callable, Iterator, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from ..runtime.contract import read_failure, read_no_group
from .attempts import Attempts, how_short

_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def say(msg: str) -> None:
    """One launcher line on stderr (workers' lines go to stdout/stderr unprefixed)."""
    print(f"multigpu run: {msg}", file=sys.stderr, flush=True)


class _Flushing:
    """A stream wrapper that flushes every write, so tailed lines show up at once even when piped."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self._stream.write(text)
            self._stream.flush()

    def flush(self) -> None:
        self._stream.flush()


class RankLogsSpecs(LogsSpecs):
    """Every worker's stdout/stderr into ``attempt_<k>/rank<r>.{stdout,stderr}.log``; chosen ranks tailed to the console.

    >>> specs = RankLogsSpecs("multigpu_logs/train-1", console_ranks=None)  # None: every rank, prefixed
    """

    def __init__(self, run_dir: str, console_ranks: set[int] | None = frozenset({0}), prefixed: bool = False,
                 attempts: Attempts | None = None):
        super().__init__(log_dir=run_dir)
        self.run_dir = run_dir
        self._console_ranks = console_ranks
        self._prefixed = prefixed
        self._tails: list[TailLog] = []
        # global rank -> stderr path, for the attempt that ran last (the failure summary reads it).
        self.stderr_paths: dict[int, str] = {}
        self.attempts = attempts or Attempts(say)  # numbers the attempts and says why each started

    @property
    def root_log_dir(self) -> str:
        return self.run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        # Called once per attempt, after the previous attempt's workers were stopped.
        self.stop_console()
        _, attempt_dir = self.attempts.begin(envs, self.run_dir)
        stdouts, stderrs, errors = {}, {}, {}
        out_tail, err_tail, prefixes = {}, {}, {}
        self.stderr_paths = {}
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            base = os.path.join(attempt_dir, f"rank{rank}")
            stdouts[local_rank], stderrs[local_rank] = f"{base}.stdout.log", f"{base}.stderr.log"
            errors[local_rank] = f"{base}.error.json"
            env["TORCHELASTIC_ERROR_FILE"] = errors[local_rank]
            self.stderr_paths[rank] = stderrs[local_rank]
            if self._console_ranks is None or rank in self._console_ranks:
                out_tail[local_rank], err_tail[local_rank] = stdouts[local_rank], stderrs[local_rank]
                prefixes[local_rank] = f"[rank{rank}] " if self._prefixed else ""
        # TailLog waits for the files to appear and reads them to the end when stopped.
        self._tails = [
            TailLog("rank", out_tail, _Flushing(sys.stdout), log_line_prefixes=prefixes).start(),
            TailLog("rank", err_tail, _Flushing(sys.stderr), log_line_prefixes=prefixes).start(),
        ]
        # LogsDest gained fields over torch versions (filtered_stdout/stderr): fill what this torch has.
        fields = {f.name for f in dataclasses.fields(LogsDest)}
        dest = dict(stdouts=stdouts, stderrs=stderrs, tee_stdouts={}, tee_stderrs={}, error_files=errors)
        for name in ("filtered_stdout", "filtered_stderr"):
            if name in fields:
                dest[name] = os.path.join(attempt_dir, f"{name}.log")
        return LogsDest(**{k: v for k, v in dest.items() if k in fields})

    def stop_console(self) -> None:
        """Drain the tailed files to the console and stop tailing (idempotent)."""
        for tail in self._tails:
            tail.stop()
        self._tails = []


def _tail(path: str, size: int | None) -> list[str]:
    """The non-blank lines of a text file's last ``size`` bytes (None: all of it), right-stripped; [] if unreadable."""
    try:
        with open(path, "rb") as fp:
            if size is not None:
                fp.seek(0, os.SEEK_END)
                fp.seek(max(0, fp.tell() - size))
            text = fp.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def _clip(text: str, limit: int | None) -> str:
    """``text`` cut to ``limit`` characters in its middle: an error's start names it, its end often says why."""
    if limit is None or len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[len(text) - (limit - head - 5):]}"


def last_line(path: str, limit: int | None = 300, *, tail: int | None = 8192,
              prefer: Callable[[str], bool] | None = None) -> str:
    """The last non-blank line of a text file, stripped; "" when there is none or the file cannot be read.

    ``tail``: read only the file's last ``tail`` bytes (None: all of it); ``prefer``: the last
    line for which it is true, where one is; ``limit``: cut longer lines to that many characters.

    >>> last_line("multigpu_logs/train-x/attempt_0/rank1.stderr.log")
    'RuntimeError: boom'
    """
    lines = [ln.strip() for ln in _tail(path, tail)]
    if prefer is not None:
        lines = [ln for ln in lines if prefer(ln)] or lines
    return _clip(lines[-1], limit) if lines else ""


# faulthandler's first line after an abort, a segfault, ... (worker.py turns it on); the dump follows it.
_DUMP = "Fatal Python error: "
_THROWN = re.compile(r"terminate called after throwing an instance of '(.+)'")
_FRAME = re.compile(r'File "(.+)", line (\d+) in (.+)')


def _crash_cause(lines: list[str], dump: int) -> str:
    """The line that explains the crash whose dump starts at ``lines[dump]``.

    ``std::terminate`` prints the C++ exception's type and its ``what()`` before the abort
    (c10 errors follow with their C++ frames, hence the search back); without one, the
    dump's own first line and where the current thread was.
    """
    for i in range(dump - 1, max(-1, dump - 80), -1):
        text = lines[i].strip()
        if text.startswith("what():"):
            thrown = _THROWN.search(lines[i - 1]) if i else None
            what = text[len("what():"):].strip()
            return f"{thrown.group(1)}: {what}" if thrown else what
        if text.startswith("terminate called"):  # "... without an active exception": no what() follows
            return text
    cause = lines[dump].strip()
    current = next((i for i in range(dump + 1, len(lines)) if lines[i].startswith("Current thread ")), None)
    frame = _FRAME.search(lines[current + 1]) if current is not None and current + 1 < len(lines) else None
    if frame:
        cause += f" (current thread in {frame.group(3)}, {os.path.basename(frame.group(1))}:{frame.group(2)})"
    return cause


def log_quote(path: str, limit: int | None = 300) -> tuple[str, str]:
    """What a failed worker's stderr log says about its end, for the failure summary: ``("last line", X)``,
    or ``("cause", X)`` for a log that ends in faulthandler's dump (an abort, a segfault), whose own
    last line ("Extension modules: numpy._core...") says nothing; ``("", "")`` for an empty log.

    >>> log_quote("multigpu_logs/mismatch-x/attempt_0/rank0.stderr.log")
    ('cause', "gloo::EnforceNotMet: [enforce fail at .../pair.cc:456] ... Is there a distributed collective mismatch in your code?")
    """
    lines = _tail(path, 64 << 10)  # a dump of a few dozen threads' stacks fits
    dumps = [i for i, ln in enumerate(lines) if ln.startswith(_DUMP)]
    if dumps:
        return "cause", _clip(_crash_cause(lines, dumps[-1]), limit)
    return ("last line", _clip(lines[-1].strip(), limit)) if lines else ("", "")


def failure_line(console: str) -> str:
    """Why a launch whose console went to ``console`` failed: the launcher's summary (the failing rank's
    exception) or an error line, else the last line; "" for an empty or unreadable file."""
    return last_line(console, limit=None, tail=None,
                     prefer=lambda ln: ln.startswith("multigpu run:") or "error:" in ln)


# Last lines that say "another rank died first": gloo's and NCCL's reports of a lost peer, store timeouts.
_SECONDARY = re.compile(
    r"connection closed by peer|connection reset by peer|remote worker|remote process|broken pipe"
    r"|communicator was aborted|DistNetworkError|DistBackendError|timed out|watchdog",
    re.IGNORECASE,
)


def failure_summary(err: ChildFailedError, specs: RankLogsSpecs) -> tuple[int, str]:
    """(exit code, one summary line) for the worker whose failure started ``err``.

    torch records the worker that ended first and the ones its agent then
    stopped with SIGTERM, all with a timestamp in whole seconds. In the real
    race that is often the wrong order: rank 1 raises, and while it prints its
    traceback and tears down, a peer's lost-peer error ("Connection reset by
    peer") ends the peer first, and the agent stops rank 1. So the workers' own
    records come first (worker.py: the exception and the time it was raised,
    written before any teardown): the earliest one that is not a lost-peer
    report names the rank. Without records (a killed worker, a script outside
    worker.py), ranks the agent did not stop and whose last stderr line is no
    lost-peer report come first, by torch's timestamp. The exit code is the
    worker's own (a usage error's 2 stays 2), or for a rank the agent stopped
    while it was exiting the one its record says it was exiting with; a worker
    killed by signal N gives 128+N, the shell's convention. The line quotes the
    rank's log (``log_quote``: the cause of a crash, else the last line).
    """
    quotes = {rank: log_quote(specs.stderr_paths.get(rank, "")) for rank in err.failures}
    records = {rank: read_failure(os.path.dirname(specs.stderr_paths.get(rank, "")), rank) for rank in err.failures}
    cause = {rank: not _SECONDARY.search(f"{rec['type']}: {rec['message']}") for rank, rec in records.items() if rec}

    def key(item):
        index, (rank, failure) = item
        if cause.get(rank):
            return (0, records[rank]["time"], index)
        stopped = failure.exitcode == -signal.SIGTERM
        return (1, stopped, rank in cause or bool(_SECONDARY.search(quotes[rank][1])), failure.timestamp, index)

    ordered = [ri for _, ri in sorted(enumerate(err.failures.items()), key=key)]
    rank, failure = ordered[0]
    if failure.exitcode == -signal.SIGTERM and cause.get(rank):
        code = records[rank].get("exit_code", 1)  # what it was exiting with (a usage error's 2)
        how = f"failed ({records[rank]['type']}; the launcher stopped it while it was exiting)"
    elif failure.exitcode < 0:
        code = 128 - failure.exitcode
        how = f"was killed by {failure.signal_name()}"
    else:
        code = failure.exitcode
        how = f"failed with exit code {code}"
    log = specs.stderr_paths.get(rank, "?")
    line = f"rank {rank} {how} on host {socket.gethostname()} (pid {failure.pid}); log: {log}"
    label, text = quotes[rank]
    if text:
        line += f"; {label}: {text}"
    others = [f"{r} ({how_short(f.exitcode)})" for r, f in ordered[1:] if f.exitcode != -signal.SIGTERM]
    if others:
        line += f"; also failed: rank {', '.join(others)}"
    return code, line


def no_group_line(specs: RankLogsSpecs) -> str | None:
    """The launcher's verdict on a finished run with workers that never joined the job's process group (their
    ``nogroup`` records, worker.py's): each ran the whole script alone; None when all joined (or none could tell)."""
    records = {rank: read_no_group(os.path.dirname(path), rank) for rank, path in specs.stderr_paths.items()}
    alone = sorted(rank for rank, rec in records.items() if rec)
    if not alone:
        return None
    world = records[alone[0]]["world_size"]
    if len(alone) == world:
        who = (f"the {world} workers never joined a process group: each ran the whole script alone ({world} copies "
               f"of one job, not one job on {world} processes)")
    else:
        who = (f"rank{'s' if len(alone) > 1 else ''} {','.join(map(str, alone))} of {world} never joined the job's "
               f"process group and ran the whole script alone")
    return (f"{who}; call mg.init() or torch.distributed.init_process_group() in the script, run it with -n 1, or "
            f"pass --allow-no-group if the workers are meant to run independently")


@contextlib.contextmanager
def torch_logs_to(path: str, *watchers: logging.Handler) -> Iterator[None]:
    """Send torch's elastic agent logging to ``path`` instead of the console, restoring it afterwards.

    The agent logs every worker start, signal and failure with tracebacks;
    our one summary line replaces that on the console (the details stay in the file).
    """
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    manager = logging.Logger.manager
    for name in list(manager.loggerDict):
        logger = manager.loggerDict[name]
        if isinstance(logger, logging.Logger) and name.startswith(_TORCH_LOGGERS):
            saved.append((logger, logger.level, logger.propagate, list(logger.handlers)))
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate, list(logger.handlers)))
    for logger, *_ in saved:
        logger.setLevel(logging.INFO)
    for name in _TORCH_LOGGERS:
        # Loggers created later propagate to these parents, which stop here.
        top = logging.getLogger(name)
        top.handlers = [handler, *watchers]
        top.propagate = False
    try:
        yield
    finally:
        for logger, level, propagate, handlers in saved:
            logger.setLevel(level)
            logger.propagate = propagate
            logger.handlers = handlers
        handler.close()


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    """torch's process context installs SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers and never removes them.

    Its ``launch_agent`` also leaves ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in ``os.environ``
    (its own bookkeeping for those handlers); that goes back too.
    """
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (getattr(signal, n) for n in names if hasattr(signal, n))} if main else {}
    env_name = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    env_value = os.environ.get(env_name)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if env_value is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = env_value
