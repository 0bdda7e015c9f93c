"""`multigpu tune`: which layout of a workload is fastest on these N devices and fits, predicted and measured.
The workload is the GPT recipe, or a script that reads its layout with ``mg.layout_from_args()`` (predicted too
when told its model: ``--model``; else measured): one path (``run.py``) for both.

    space.py   the recipe's candidates, mg.parallel.Layouts: DDP / FSDP / HSDP x TP x PP, micro-batch, checkpointing
    probe.py   the measured parts: one micro-batch on one process, the links (every group at once), the wrappers'
               and the loop's fixed costs (one process), the collectives' waits in a busy step (the real ranks)
    machine.py this machine as multigpu forecast describes a cluster (measure_parts: the probes it rests on): its
               model predicts each candidate
    run.py     the one path: the workload (the recipe's here), predict, prune, measure interleaved, one report
               (tune.json, report.md, report.html)
    script.py  a script as a workload: its candidates, its refusals, its retry with checkpointing
    rounds.py  the pieces that stand alone: a row, the device, one launch and its failure, the rounds, the summary,
               the files
"""

from __future__ import annotations

import argparse
import functools

from ..runtime.fields import add_field
from .run import TuneConfig, check_args, run_tune

__all__ = ["TuneConfig", "add_arguments", "main", "run_tune"]


def add_arguments(parser) -> None:
    tune = functools.partial(add_field, parser, config=TuneConfig)
    tune("-n", "--nproc", field="nproc", type=int, default=None)  # None: the visible GPUs, chosen in main
    tune("--cpu", field="cpu", action="store_true")
    tune("--memory-budget", field="memory_budget", metavar="SIZE")  # a size (2GiB), parsed in main
    tune("--top", field="top", default=str(TuneConfig.top), metavar="K")  # a number or 'all'
    tune("--repeats", field="repeats", type=int)
    tune("--steps", field="steps", type=int)
    tune("--micro-batches", field="micro_batches", metavar="M,M,...")
    tune("--experts", field="experts", action="store_true")
    tune("--context", field="context", action="store_true")
    tune("--threads", field="threads", type=int)
    tune("--model", field="model", metavar="SPEC")
    tune("--seq-len", field="seq_len", type=int, metavar="N")
    tune("--out", field="out")
    parser.add_argument("workload", help="gpt (the GPT recipe, multigpu.recipes.gpt), or a script.py that reads its "
                                         "layout with mg.layout_from_args() and measures with mg.StepMeter")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the recipe's model and batch flags (--size, --global-batch, "
                                                               "--untied, ...), or the script's own")


def main(args) -> int:
    from ..errors import UsageError
    from ..runtime.values import int_list, parse_size

    def ints(text, flag):
        values = int_list(text, f"{flag} takes comma-separated integers like 2,4")
        if any(v < 1 for v in values):
            raise UsageError(f"{flag} values must be at least 1, got {text!r}")
        return values

    if args.top != "all" and not (args.top.isdigit() and int(args.top) >= 1):
        raise UsageError(f"--top takes a number of candidates (at least 1) or 'all', got {args.top!r}")
    for flag, value in (("--repeats", args.repeats), ("--steps", args.steps), ("--threads", args.threads)):
        if value < 1 or (flag == "--steps" and value < 4):
            raise UsageError(f"{flag} must be at least {4 if flag == '--steps' else 1}, got {value}")
    check_args(TuneConfig(args.workload, tuple(args.args),
                          memory_budget=parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None,
                          model=args.model, seq_len=args.seq_len))
    nproc = args.nproc
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 2
    if nproc < 1:
        raise UsageError(f"-n must be at least 1, got {nproc}")
    cfg = TuneConfig(workload=args.workload, args=tuple(args.args), nproc=nproc, cpu=args.cpu,
                     memory_budget=parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None,
                     top=0 if args.top == "all" else int(args.top), repeats=args.repeats, steps=args.steps,
                     out=args.out, threads=args.threads,
                     micro_batches=ints(args.micro_batches, "--micro-batches") if args.micro_batches else None,
                     experts=args.experts, context=args.context, model=args.model, seq_len=args.seq_len)
    _, report = run_tune(cfg)
    return 0 if report["winner"] else 1
