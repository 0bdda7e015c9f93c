"""The ``multigpu`` command: argparse verbs, each one function call.

Every verb's module is imported only when that verb runs, and a
``UsageError`` becomes one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .errors import UsageError, report_usage_error


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what, and where to look), exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _cmd_run(args: argparse.Namespace) -> int:
    from .launch import main as run_main

    return run_main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor_main

    return doctor_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .commbench import main as bench_main

    return bench_main(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .planner import main as plan_main

    return plan_main(args)


def _cmd_ckpt(args: argparse.Namespace) -> int:
    from .checkpoint.tools import main as ckpt_main

    return ckpt_main(args)


def _cmd_study(args: argparse.Namespace) -> int:
    from .study import main as study_main

    return study_main(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    html_path, md_path = write_report(args.results, args.output)
    print(f"multigpu report: {html_path} (self-contained) and {md_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multigpu", description="Scale a PyTorch training script from one GPU to many, and measure it.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True

    from .launch import add_run_arguments

    run = sub.add_parser("run", help="start N worker processes of a script through torchrun's launcher")
    add_run_arguments(run)
    run.set_defaults(func=_cmd_run)

    from .doctor import add_arguments as add_doctor_arguments

    doctor = sub.add_parser("doctor", help="check versions, GPUs, topology, NCCL variables and the host; run a live all-reduce")
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=_cmd_doctor)

    from .commbench import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="time collectives with nccl-tests' algbw/busbw columns, and check their results")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    from .planner import add_plan_arguments

    plan = sub.add_parser("plan", help="translate a 1-GPU recipe (LR, batch, schedule) for N GPUs")
    add_plan_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    ckpt = sub.add_parser("ckpt", help="list, verify and export checkpoints written by mg.Checkpointer")
    ckpt_sub = ckpt.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    ckpt_sub.required = True
    ls = ckpt_sub.add_parser("ls", help="checkpoints with step, world size, size, and valid or why not (sizes only)")
    ls.add_argument("dir", help="run directory (or one checkpoint directory)")
    verify = ckpt_sub.add_parser("verify", help="check every file's sha256; exit status 1 if any checkpoint is damaged")
    verify.add_argument("dir", help="run directory (or one checkpoint directory)")
    exp = ckpt_sub.add_parser("export", help="write one checkpoint's model weights as a plain torch.save file")
    exp.add_argument("checkpoint", help="checkpoint directory, e.g. runs/x/step-120")
    exp.add_argument("out", help="output file, e.g. model.pt")
    ckpt.set_defaults(func=_cmd_ckpt)
    from .study import add_study_arguments

    study = sub.add_parser("study", help="run a workload at several world sizes and batch policies; measure and judge")
    add_study_arguments(study)
    study.set_defaults(func=_cmd_study)

    report = sub.add_parser("report", help="write the HTML report and Markdown summary of a study's results")
    report.add_argument("results", help="the results directory `multigpu study` wrote")
    report.add_argument("-o", "--output", default=None, help="HTML file to write (default: RESULTS/report.html)")
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        report_usage_error(err, prog=f"multigpu {args.verb}")
        return 2
    except KeyboardInterrupt:
        print(f"multigpu {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
