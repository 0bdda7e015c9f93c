"""The ``multigpu`` command: argparse verbs, each one function call.

Each verb's module supplies ``add_arguments``-style setup and a ``main(args)``;
a ``UsageError`` becomes one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import re
import sys
import threading

from .errors import UsageError, report_usage_error


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what, and where to look), exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr, flush=True)
        raise SystemExit(2)


# (verb, help, module with add_arguments(parser) and main(args)). Only the chosen verb's module is
# imported: `ckpt` alone pulls in torch.distributed.checkpoint (and DTensor, sympy), 1.8 s that every
# `multigpu run` paid before it started a worker.
VERBS = [
    ("run", "start N worker processes of a script through torchrun's launcher", "multigpu.launch"),
    ("doctor", "check versions, GPUs, topology, NCCL variables and the host; run a live all-reduce", "multigpu.doctor"),
    ("bench", "time collectives with nccl-tests' algbw/busbw columns, and check their results", "multigpu.commbench"),
    ("plan", "translate a 1-GPU recipe (LR, batch, schedule) for N GPUs", "multigpu.planner"),
    ("ckpt", "list, verify, export and import checkpoints of mg.Checkpointer", "multigpu.checkpoint.tools"),
    ("study", "run a workload at several world sizes and batch policies; measure and judge", "multigpu.study"),
    ("report", "write the HTML report and Markdown summary of a study's results or of one run", "multigpu.report"),
    ("verify", "run a script on 1 and N ranks with the same global batch; compare losses, samples and parameters",
     "multigpu.verify"),
    ("forecast", "predict memory per GPU and speed of every layout of a model on a cluster you describe, ranked",
     "multigpu.forecast"),
    ("tune", "find the fastest layout that fits N devices, of the GPT recipe or your script: predicted, then measured",
     "multigpu.tune"),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the verb it names gets its arguments (and its module imported).

    The top-level parser has no options but ``-h``, so the verb is argv's first word without a dash.
    """
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    parser = _Parser(prog="multigpu", description="Scale a PyTorch training script from one GPU to many, and measure it.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    for name, help_text, module in VERBS:
        verb = sub.add_parser(name, help=help_text)
        if chosen is None or name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(verb)
            verb.set_defaults(func=mod.main, verb_parser=verb)
    return parser


def in_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """A library error in this verb's spelling: ``per_gpu_batch=8`` becomes ``--per-gpu-batch 8``.

    Library functions name the fix in Python (what their callers write); on the
    command line the same fix is the verb's flag, whose ``dest`` is that name.
    """
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        longest = max(action.option_strings, key=len, default="")
        if longest.startswith("--"):
            message = re.sub(rf"\b{action.dest}=(['\"]?)([^'\"\s,;]+)\1", rf"{longest} \2", message)
    return message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        report_usage_error(UsageError(in_flags(str(err), args.verb_parser)), prog=f"multigpu {args.verb}")
        return 2
    except KeyboardInterrupt:
        print(f"multigpu {args.verb}: interrupted", file=sys.stderr)
        return 130


def command() -> None:
    """The ``multigpu`` console script: ``main()``, then an exit without the interpreter's teardown.

    With torch imported, CPython's finalization spends about a second of CPU clearing
    module objects (0.9-1.2 s on a 2-core VM, no system call in it), after the work
    is done: every ``multigpu run`` ended that much later than its workers. What the
    teardown would do for us is done first: other threads joined, atexit handlers
    run (logging's flush among them), stdout and stderr flushed. Tests and the Python
    API call ``main()``, which returns.
    """
    try:
        code = main()
    except SystemExit as stop:  # argparse's usage errors and --help
        code = stop.code
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own, what finalization would run
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    command()
