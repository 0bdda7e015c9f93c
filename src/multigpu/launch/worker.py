"""The first code every ``multigpu run`` worker runs: the user's script, then a clean end.

torchrun starts ``python -m multigpu.launch.worker script|module TARGET ARGS...``.
This runs TARGET as ``python TARGET`` / ``python -m TARGET`` would (its module is
``__main__`` to the end, so files it left open flush as under ``python``), and adds three things:

- **A failure record.** An exception that ends the script is written to
  ``<attempt dir>/rank<r>.failure.json`` with the time it was raised (stamped by
  ``mg.init`` before it tears anything down), its type and message. The
  launcher's failure summary orders the failed ranks by these times: torch's
  own record has whole seconds, in which the first failure and its
  symptoms on the other ranks ("Connection reset by peer") tie, and the
  rank that raised first is often still tearing down (so the agent stops it
  with SIGTERM) when a peer's symptom has already ended that peer.
- **No abort at exit.** A process group still alive when the interpreter
  finalizes lets a gloo worker thread drop the last reference to a finished
  collective's tensors after Python is gone; taking the GIL then ends the
  thread with a forced unwind through C++ and ``std::terminate`` ("terminate
  called without an active exception", exit 134, seen with plain torchrun
  too; backtrace in docs/launcher.md). A script that returns without
  ``destroy_process_group`` gets it here, while the interpreter is alive.
- **A usage error is one line.** A ``UsageError`` that ends the script prints its
  line and exits 2, as under ``mg.init`` and the ``multigpu`` verbs (no traceback).
- **A script that never joins.** In a job of several workers, one that ends
  without ever joining the job's process group ran the whole script alone:
  ``<attempt dir>/rank<r>.nogroup.json`` says so, and the launcher refuses
  the run (``--allow-no-group`` accepts independent workers).
- **A stack at an abort.** ``faulthandler`` is on, so an abort (SIGABRT from
  ``std::terminate``) or a crash leaves every thread's Python stack in the
  rank's stderr log: which thread was inside C++ when the process died.
- **A quicker exit.** The collector is frozen before the interpreter's teardown,
  which otherwise spends about 0.9 s of CPU per worker (see ``_prepare_exit``).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import importlib.util
import io
import os
import sys
import traceback
import types

from ..errors import UsageError, report_usage_error
from ..runtime.contract import record_failure, record_no_group


_OURS = {__file__}


def _destroy_process_groups() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _GroupWatch:
    """Whether the script joins the job's process group (one of ``WORLD_SIZE`` ranks), seen as it happens.

    Looking at the end is not enough: a script that calls ``destroy_process_group``
    leaves no trace of its group. So torch's one setter of the default group is watched
    while the script runs (``compat.watch_default_group``). Where this torch has no such
    function the watch is off: no record, no verdict.
    """

    def __init__(self, world_size: int) -> None:
        from ..runtime.compat import watch_default_group

        self.world_size, self.largest = world_size, 0

        def seen(size: int) -> None:
            self.largest = max(self.largest, size)

        self._undo = watch_default_group(seen)

    def end(self) -> None:
        """Stop watching; record this rank if it never joined (only when the watch was on)."""
        if self._undo is None:
            return
        self._undo()
        self._undo = None
        if self.largest < self.world_size:
            record_no_group(self.world_size, self.largest)


def _prepare_exit() -> None:
    """Collect the script's garbage now, then leave what is still alive out of the collector.

    CPython's finalization collects again and again while it clears the modules, and
    with torch loaded that is about 0.9 s of CPU per worker (0.2-0.3 s frozen), paid
    by every rank after its work is done (4 ranks on 2 cores: 2 s). What is left is
    still released by reference count when its module is cleared (files flush,
    ``__del__`` runs), the script's module included; only cycles that form during the
    teardown itself are left to the OS. Garbage made while the script ran is
    collected here, before the freeze.
    """
    gc.collect()
    gc.freeze()


def _main_module(kind: str, target: str) -> tuple[types.ModuleType, types.CodeType]:
    """The script as ``python TARGET`` / ``python -m TARGET`` would make it: a ``__main__`` module and its code."""
    module = types.ModuleType("__main__")
    if kind == "module":  # what runpy does for `python -m` (its own function for it is private)
        spec = importlib.util.find_spec(target)
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{target}.__main__")
            if spec is None:
                raise ImportError(f"no module named {target}.__main__; '{target}' is a package and cannot be run directly")
        code = spec.loader.get_code(spec.name) if spec is not None and spec.loader is not None else None
        if code is None:  # the launcher checked that it exists: an extension module or a namespace package
            raise ImportError(f"no code object available for {target}; -m needs a Python module")
        module.__spec__, module.__loader__, module.__package__ = spec, spec.loader, spec.parent
        module.__file__, module.__cached__ = spec.origin, spec.cached
        sys.argv[0] = spec.origin
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
        with io.open_code(target) as f:
            code = compile(f.read(), target, "exec")
        module.__spec__, module.__loader__, module.__package__, module.__file__ = None, None, None, target
    return module, code


def _release(module: types.ModuleType) -> None:
    """Clear the script's globals as the interpreter clears a module: ``_names`` first, then the rest."""
    names = [n for n in module.__dict__ if n != "__builtins__"]
    for name in sorted(names, key=lambda n: not (n.startswith("_") and not n.startswith("__"))):
        module.__dict__[name] = None


def _run(kind: str, target: str, args: list[str], keep_main: bool) -> None:
    """Run the script in a ``__main__`` module; ``keep_main``: it stays, and its globals go at exit.

    runpy's run_path/run_module use a temporary module and return a copy of its globals;
    the originals then live on only in a cycle with the script's functions. The cycle
    collector finalizes a file's text layer and its buffer in no set order, so a file the
    script left open lost its unflushed end (``log = open(...)`` without ``close()``:
    complete under ``python``, empty under ``multigpu run``). Here the globals are
    released by reference count, as the interpreter releases a module's, after the
    threads are joined and the other atexit handlers have run (registered first, ours
    runs last).
    """
    sys.argv = [target, *args]
    module, code = _main_module(kind, target)
    if keep_main:
        sys.modules["__main__"] = module
        atexit.register(_release, module)
    exec(code, module.__dict__)  # noqa: S102 - running the user's script is this module's job


def main(argv: list[str], keep_main: bool = False) -> int:
    """Run the script; ``keep_main``: leave its module as ``__main__`` (the worker process) rather than
    restore the caller's (a test calling this in its own process)."""
    kind, target, *args = argv
    world_size = os.environ.get("WORLD_SIZE", "")
    watch = _GroupWatch(int(world_size)) if world_size.isdigit() and int(world_size) > 1 else None
    try:
        _run(kind, target, args, keep_main)
    except SystemExit as err:  # sys.exit(0) ends a finished script too: the group must go either way
        if err.code not in (None, 0):
            record_failure(err)
        raise
    except KeyboardInterrupt:
        raise
    except UsageError as err:  # the user's mistake: its one line and exit 2, as mg.init and the verbs do
        record_failure(err)
        report_usage_error(err)
        return err.exit_code
    except BaseException as err:  # noqa: BLE001 - recorded, then reported as Python would
        record_failure(err)
        # The traceback from the user's code on: these frames are not theirs.
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OURS:
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb)
        return 1
    finally:
        if watch is not None:
            watch.end()
        _destroy_process_groups()
    return 0


if __name__ == "__main__":
    if not faulthandler.is_enabled():  # the script's own choice (python -X faulthandler, a file) stays
        faulthandler.enable(all_threads=True)
    try:
        code = main(sys.argv[1:], keep_main=True)
    finally:  # sys.exit(n) from the script passes through too
        _prepare_exit()  # here, not in main(): tests call main() in their own process
    sys.exit(code)
