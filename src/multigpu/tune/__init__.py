"""`multigpu tune`: which layout of the GPT recipe is fastest on these N devices and fits, predicted and measured.

    space.py   the candidates: DDP / FSDP / HSDP x TP x PP, micro-batch, activation checkpointing, schedule
    probe.py   the measured parts: one micro-batch on one process, the links (cached)
    model.py   memory per rank and step time from those parts (docs/tune.md)
    run.py     predict, prune, measure the top K interleaved, report (tune.json, report.md, report.html)
"""

from __future__ import annotations

import argparse

from .run import TuneConfig, check_args, run_tune

__all__ = ["TuneConfig", "add_arguments", "main", "run_tune"]


def add_arguments(parser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=None, help="ranks to tune for (default: the visible GPUs, or 2 on CPU)")
    parser.add_argument("--cpu", action="store_true", help="CPU workers (gloo) even where GPUs exist")
    parser.add_argument("--memory-budget", default=None, metavar="SIZE", help="the most memory a rank may use, e.g. 2GiB (default: 90 %% of the GPU's; none on CPU)")
    parser.add_argument("--top", default="3", metavar="K", help="measure the K fastest predicted candidates that fit (default 3; 'all': every one)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds of measurement (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="steps per measured run (default 8; the first 2 are warm-up)")
    parser.add_argument("--micro-batches", default=None, metavar="M,M,...", help="micro-batch sizes to consider (default: powers of 2 that divide a rank's share)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker on CPU (default 1: a worker stands for a device)")
    parser.add_argument("--out", default=None, help="results directory (default: studies/tune-<time>)")
    parser.add_argument("workload", help="gpt (the GPT recipe, multigpu.recipes.gpt)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the recipe's model and batch flags (--size, --global-batch, --untied, ...)")


def main(args) -> int:
    from ..errors import UsageError
    from ..values import int_list, parse_size

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
    check_args(TuneConfig(args.workload, tuple(args.args)))
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
                     micro_batches=ints(args.micro_batches, "--micro-batches") if args.micro_batches else None)
    _, report = run_tune(cfg)
    return 0 if report["winner"] else 1
