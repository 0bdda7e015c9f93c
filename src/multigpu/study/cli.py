"""`multigpu study` arguments and entry point."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..values import int_list
from .run import RECIPES, StudyConfig, run_study


def _ints(text: str) -> tuple[int, ...]:
    return int_list(text, "--workers must be a comma-separated list of integers", "use e.g. --workers 1,2,4",
                    skip_empty=True)


def default_workers() -> str:
    """1, 2, 4, ... up to the visible GPUs; 1,2 on a machine without GPUs."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return "1,2"
    ws, w = [], 1
    while w < n:
        ws.append(w)
        w *= 2
    return ",".join(map(str, ws + [n]))


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default=None, help="world sizes to run, e.g. 1,2,4 (default: 1,2,4.. up to the GPUs; 1,2 on CPU)")
    parser.add_argument("--policy", default="keep-global", help="batch policies, comma-separated: keep-global, scale-global")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of interleaved runs (1, 2, 1, 2, ...); 2 or more give a 95 %% interval")
    parser.add_argument("--ci", type=float, default=None, metavar="FRAC",
                        help="keep adding rounds until every speedup's 95 %% interval is within +-FRAC (e.g. 0.1)")
    parser.add_argument("--budget", type=float, default=600.0, metavar="S", help="with --ci: start no round after S seconds (default 600)")
    parser.add_argument("--max-repeats", type=int, default=10, help="with --ci: at most this many rounds (default 10)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per worker on CPU runs, the same at every world size (default 1: a worker stands for a device)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (passed as --steps; default: the workload's own)")
    parser.add_argument("--global-batch", type=int, default=None, help="global batch at 1 worker (passed as --global-batch)")
    parser.add_argument("--target", default=None, help="e.g. accuracy>=0.95 or loss<=0.1: time and samples to reach it")
    parser.add_argument("--out", default=None, help="results directory (default: studies/<workload>-<time>)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes (gloo) even where GPUs exist")
    parser.add_argument("--profile", default="20:25", help="profiled steps for the time breakdown, or 'off'")
    parser.add_argument("--no-report", action="store_true", help="skip writing report.html / report.md")
    # One positional for the workload and its arguments: argparse would drop a `--` right after a
    # positional of its own (Python 3.10-3.13 alike), and that `--` is how a workload gets an option
    # spelled like a study option.
    parser.usage = "%(prog)s [options] workload [args ...]  |  %(prog)s [options] workload -- [args ...]"
    parser.add_argument("workload", nargs=argparse.REMAINDER,
                        help=f"a recipe ({', '.join(RECIPES)}), a script path or a module, then its arguments "
                             "(after -- where one is spelled like a study option)")
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    parser.set_defaults(study_flags=frozenset(flags))


def split_command(command: list[str], study_flags: frozenset[str]) -> tuple[str, list[str]]:
    """(workload, its arguments); a study option after the workload is refused unless a ``--`` precedes them.

    argparse hands everything after the workload to it: `study digits --workers 1,2` would run the
    recipe with --workers, fail in every run, and the study would still try them all. An
    abbreviation (`--work`) is caught too, since before the workload argparse would take it as
    --workers.
    """
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError(f"study needs a workload: a recipe ({', '.join(RECIPES)}), a script path or a module; "
                         "e.g. multigpu study --workers 1,2 digits")
    workload, rest = command[0], command[1:]
    if rest[:1] == ["--"]:
        return workload, rest[1:]
    for arg in rest:
        name = arg.split("=", 1)[0]
        hits = sorted(f for f in study_flags if f.startswith(name)) if name.startswith("--") and len(name) > 2 else []
        if name in study_flags or len(hits) == 1:
            flag = name if name in study_flags else hits[0]
            raise UsageError(f"{arg} comes after the workload {workload!r}, so it would go to the workload; study "
                             f"options go before it (multigpu study {flag} ... {workload}), or put -- after the "
                             f"workload to hand it to the workload (multigpu study {workload} -- {arg} ...)")
    return workload, rest


def main(args) -> int:
    workload, workload_args = split_command(args.workload, args.study_flags)
    cfg = StudyConfig(
        workload=workload, args=tuple(workload_args), workers=_ints(args.workers or default_workers()),
        policies=tuple(p.strip() for p in args.policy.split(",") if p.strip()), repeats=args.repeats,
        steps=args.steps, global_batch=args.global_batch, target=args.target, out=args.out, cpu=args.cpu,
        profile=None if args.profile in ("off", "none", "") else args.profile,
        ci=args.ci, budget_s=args.budget, max_repeats=args.max_repeats, threads=args.threads,
    )
    out, study = run_study(cfg, say=lambda s: print(s, flush=True))
    print(f"multigpu study: {study['headline']}")
    for g in study["groups"]:
        if g["workers"] > 1:
            print(f"  {g['workers']} workers {g['policy']}: {g['verdict']}")
    if not args.no_report:
        from ..report import write_report

        html_path, md_path = write_report(out)
        print(f"multigpu study: report {html_path} (and {md_path.name}); data {out / 'study.json'}")
    failed = sum(g["n_failed"] for g in study["groups"])
    return 1 if failed and all(g["n_ok"] == 0 for g in study["groups"]) else 0
