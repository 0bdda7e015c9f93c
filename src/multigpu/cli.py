"""The ``multigpu`` command: argparse verbs, each one function call.

Each verb's module supplies ``add_arguments``-style setup and a ``main(args)``;
a ``UsageError`` becomes one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

from .errors import UsageError, report_usage_error


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what, and where to look), exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from . import commbench, doctor, launch, planner, report, study, tune, verify
    from .checkpoint import tools as ckpt

    parser = _Parser(prog="multigpu", description="Scale a PyTorch training script from one GPU to many, and measure it.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    verbs = [
        ("run", "start N worker processes of a script through torchrun's launcher", launch.add_arguments, launch.main),
        ("doctor", "check versions, GPUs, topology, NCCL variables and the host; run a live all-reduce",
         doctor.add_arguments, doctor.main),
        ("bench", "time collectives with nccl-tests' algbw/busbw columns, and check their results",
         commbench.add_arguments, commbench.main),
        ("plan", "translate a 1-GPU recipe (LR, batch, schedule) for N GPUs", planner.add_arguments, planner.main),
        ("ckpt", "list, verify and export checkpoints written by mg.Checkpointer", ckpt.add_arguments, ckpt.main),
        ("study", "run a workload at several world sizes and batch policies; measure and judge",
         study.add_arguments, study.main),
        ("report", "write the HTML report and Markdown summary of a study's results", report.add_arguments, report.main),
        ("verify", "run a script on 1 and N ranks with the same global batch; compare losses, samples and parameters",
         verify.add_arguments, verify.main),
        ("tune", "find the fastest layout of the GPT recipe that fits N devices: predicted, then measured",
         tune.add_arguments, tune.main),
    ]
    for name, help_text, add_arguments, run in verbs:
        verb = sub.add_parser(name, help=help_text)
        add_arguments(verb)
        verb.set_defaults(func=run, verb_parser=verb)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        report_usage_error(UsageError(in_flags(str(err), args.verb_parser)), prog=f"multigpu {args.verb}")
        return 2
    except KeyboardInterrupt:
        print(f"multigpu {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
