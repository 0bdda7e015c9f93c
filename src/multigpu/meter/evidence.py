"""Whether a run's meter records are evidence enough for a verdict (study, tune, verify, report).

A verdict is never drawn from a run that stopped early or measured nothing past its warm-up: these say so
in one line, with the fix.
"""

from __future__ import annotations

from typing import Any, Iterable


def steps_asked(args: Iterable[str]) -> int | None:
    """The steps a run was asked for: the last ``--steps N`` (or ``--steps=N``) among its arguments, argparse's
    rule; None when none is given (the workload's own length, which only the workload knows)."""
    args, asked = list(args), None
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--steps" and i + 1 < len(args) else arg[8:] if arg.startswith("--steps=") else None
        if value is not None and value.isdigit():
            asked = int(value)
    return asked


def thin_evidence(records: list[dict[str, Any]], asked: int | None, *, rate: bool = True) -> str | None:
    """Why a run's meter records are no evidence for a verdict, as one line (what was asked, what was got, the fix);
    None when they are.

    A run must record the ``asked`` steps: fewer means its data ran out or it stopped early, and a verdict
    would judge a run nobody asked for. With ``rate`` (study, tune: the verdict reads the meter's samples/s
    or step time) at least one step must be measured after the warm-up interval: with a single record the
    meter measures from its start, so the rate would include the first steps' one-off costs (allocation,
    FLOP counting), which is no steady-state figure.
    """
    summary = next((r for r in reversed(records) if r.get("type") == "summary"), None)
    if summary is not None:
        recorded = summary.get("steps", 0)
    else:  # no summary (the meter was not closed): the step records' own count
        recorded = sum(r.get("steps", 1) for r in records if r.get("type") == "step")
    measured = (summary or {}).get("measured") or {}
    warmup = measured.get("warmup_steps") or [0, -1]
    after = measured.get("steps", 0) if measured.get("from_step", 0) > warmup[1] else 0
    got = f"{recorded} recorded" + (f", {after} measured after warm-up" if rate else "")
    if asked is not None and recorded < asked:
        return (f"{asked} steps asked, {got} (its data ran out or it stopped early); give the script more data or "
                "ask fewer --steps")
    if rate and after == 0:
        header = next((r for r in records if r.get("type") == "header"), {})
        every = (header.get("meter") or {}).get("log_every")
        # the meter leaves profiled intervals out too: with every later one profiled, only the warm-up is left
        profiled = [o["steps"] for o in measured.get("left_out", ()) if o.get("why") == "profiled"]
        why = ([f"log_every {every}"] if every else []) + [f"steps {a}-{b} profiled" for a, b in profiled]
        fix = ("ask more --steps, past the profiled ones, or profile other steps (--profile)" if profiled else
               "ask more --steps" + (f" (at least {2 * every})" if every else "") + " or log more often")
        return (f"a rate needs steps after the meter's warm-up interval, got {got}"
                + (f" ({', '.join(why)})" if why else "") + f"; {fix}")
    return None
