"""The first code every ``multigpu run`` worker runs: the user's script, then a clean end.

torchrun starts ``python -m multigpu.launch.worker script|module TARGET ARGS...``.
This runs TARGET as ``python TARGET`` / ``python -m TARGET`` would, and adds two things:

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
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from .contract import record_failure


_OURS = {__file__, runpy.__file__, "<frozen runpy>"}


def _destroy_process_groups() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _run(kind: str, target: str, args: list[str]) -> None:
    sys.argv = [target, *args]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str]) -> int:
    kind, target, *args = argv
    try:
        _run(kind, target, args)
    except SystemExit as err:  # sys.exit(0) ends a finished script too: the group must go either way
        if err.code not in (None, 0):
            record_failure(err)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - recorded, then reported as Python would
        record_failure(err)
        # The traceback from the user's code on: these frames and runpy's are not theirs.
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OURS:
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb)
        return 1
    finally:
        _destroy_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
