"""`multigpu study` arguments and entry point."""

from __future__ import annotations

import argparse
import functools

from ..errors import UsageError
from ..runtime.fields import add_field
from ..runtime.values import int_list
from .measure import label
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
    study = functools.partial(add_field, parser, config=StudyConfig)
    study("--workers", field="workers", default=None)  # None: default_workers(), which looks at the GPUs
    study("--policy", field="policies", default=",".join(StudyConfig.policies))
    study("--repeats", field="repeats", type=int)
    study("--ci", field="ci", type=float, metavar="FRAC")
    study("--budget", field="budget_s", dest="budget", type=float, metavar="S")
    study("--max-repeats", field="max_repeats", type=int)
    study("--threads", field="threads", type=int)
    study("--steps", field="steps", type=int)
    study("--global-batch", field="global_batch", type=int)
    study("--target", field="target")
    study("--out", field="out")
    study("--cpu", field="cpu", action="store_true")
    study("--profile", field="profile")
    study("--layouts", field="layouts", metavar="LAYOUTS")
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
    if args.layouts is not None and args.workers is not None:
        raise UsageError("--layouts runs each layout on the ranks it spans (and one worker); --workers runs world "
                         "sizes: pass one of them")
    cfg = StudyConfig(
        workload=workload, args=tuple(workload_args), workers=_ints(args.workers or default_workers()),
        policies=tuple(p.strip() for p in args.policy.split(",") if p.strip()), repeats=args.repeats,
        steps=args.steps, global_batch=args.global_batch, target=args.target, out=args.out, cpu=args.cpu,
        profile=None if args.profile in ("off", "none", "") else args.profile,
        ci=args.ci, budget_s=args.budget, max_repeats=args.max_repeats, threads=args.threads, layouts=args.layouts,
    )
    out, study = run_study(cfg, say=lambda s: print(s, flush=True))
    print(f"multigpu study: {study['headline']}")
    for g in study["groups"]:
        if g["workers"] > 1:
            print(f"  {label(g)}: {g['verdict']}")
    if not args.no_report:
        from ..report import write_report

        html_path, md_path = write_report(out)
        print(f"multigpu study: report {html_path} (and {md_path.name}); data {out / 'study.json'}")
    # No group with a run to judge: nothing was measured (every run failed, or was too short to judge).
    return 1 if all(g["n_ok"] == 0 for g in study["groups"]) else 0
