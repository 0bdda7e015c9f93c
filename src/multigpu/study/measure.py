"""Reading a study's runs back: one run's figures from its metrics.jsonl and profile, and the groups."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable

from ..errors import UsageError
from ..meter.evidence import thin_evidence
from ..meter.records import read_records
from .verdict import findings, verdict

TARGET_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}


def _reached(evals: list[dict], steps: list[dict], target: tuple[str, str, float] | None) -> dict | None:
    if target is None:
        return None
    metric, op, value = target
    for rec in evals + ([] if any(metric in e for e in evals) else steps):
        v = rec.get(metric)
        if v is not None and TARGET_OPS[op](v, value):
            return {"samples": rec.get("samples_seen"), "wall_s": rec.get("time")}
    return None


def measure_run(run_dir: Path, target: tuple[str, str, float] | None, steps: int | None = None) -> dict[str, Any]:
    """The figures of one finished run, from its metrics.jsonl and profile summary; ``thin``: why they are no
    evidence for a verdict (``thin_evidence``, ``steps``: the steps asked), else None."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl: the workload must use mg.StepMeter (see docs/study.md)")
    recs = read_records(metrics)
    steps_recs = [r for r in recs if r.get("type") == "step"]
    evals = [r for r in recs if r.get("type") == "eval"]
    summary = next((r for r in reversed(recs) if r.get("type") == "summary"), None)
    if summary is None:
        raise UsageError(f"{metrics} has no summary record: the run ended before meter.close()")
    out: dict[str, Any] = {
        "thin": thin_evidence(recs, steps),
        "samples_per_s": summary.get("samples_per_s"),
        "step_time_s": summary.get("step_time"),
        "wall_s": summary.get("wall_time"),
        "samples_seen": summary.get("samples_seen"),
        "step_peak_bytes": (summary.get("step_peak") or {}).get("bytes"),  # MULTIGPU_MEMORY_STEP's (tune's runs)
        "curve": {"samples": [r["samples_seen"] for r in steps_recs if r.get("loss") is not None],
                  "loss": [r["loss"] for r in steps_recs if r.get("loss") is not None],
                  "wall_s": [r["time"] for r in steps_recs if r.get("loss") is not None]},
        "evals": [{k: e.get(k) for k in ("samples_seen", "time", "accuracy", "loss")} for e in evals],
        "final": {k: v for k, v in (evals[-1] if evals else {}).items() if k in ("accuracy", "loss")},
        "to_target": _reached(evals, steps_recs, target),
    }
    noise = [r for r in steps_recs if r.get("noise/b_simple") is not None]
    out["noise"] = {"samples": [r["samples_seen"] for r in noise], "b_simple": [r["noise/b_simple"] for r in noise]}
    out["noise_scale"] = noise[-1]["noise/b_simple"] if noise else None
    out["breakdown"] = breakdown(summary.get("fractions") or {}, run_dir / "profile" / "summary.json")
    if summary.get("experts"):  # expert parallelism: what the all-to-all costs, and how even the routing was
        out["breakdown"]["all_to_all"] = summary["experts"]["a2a_share"]
        out["expert_imbalance"] = summary["experts"]["imbalance"]
    return out


def breakdown(fractions: dict[str, float], profile_summary: Path) -> dict[str, Any]:
    """Fractions of step time: compute, exposed communication, data wait, idle.

    Data wait comes from the meter (every unprofiled step; the profiler slows
    the Python loader and would overstate it). The rest of the step, which the
    meter cannot split, is divided in the proportions the profiler measured
    over its window: compute (with communication it overlaps), exposed
    communication, and idle. Without a profile, exposed communication is unknown.
    """
    wait = fractions.get("data_wait")
    rest = (fractions.get("compute") or 0.0) + (fractions.get("other") or 0.0)
    if not profile_summary.is_file():
        return {"compute": fractions.get("compute"), "comm_exposed": None, "data_wait": wait,
                "idle": fractions.get("other"), "source": "meter"}
    ranks = json.loads(profile_summary.read_text())
    parts = {"compute": ("compute", "overlapped_comm"), "comm_exposed": ("exposed_comm",), "idle": ("idle",)}
    share = {k: statistics.fmean(sum(r[p] for p in ps) for r in ranks) for k, ps in parts.items()}
    total = sum(share.values()) or 1.0
    return {k: rest * v / total for k, v in share.items()} | {"data_wait": wait, "source": "meter+profiler"}


# --- grouping and judging ---------------------------------------------------------

def _stat(values: Iterable[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def label(group: dict[str, Any]) -> str:
    """A group's name in lines and tables: ``2 workers keep-global``, ``4 workers tp=2 keep-global``."""
    layout = group.get("layout") or ""
    return f"{group['workers']} worker{'s' if group['workers'] > 1 else ''}{' ' + layout if layout else ''} {group['policy']}"


def summarize(runs: list[dict[str, Any]], workers: Iterable[int | tuple[int, str]],
              policies: Iterable[str]) -> list[dict[str, Any]]:
    """One group per (workers, layout, policy): means and spreads over repeats, speedup, efficiency, verdict.
    ``workers``: world sizes, or (world size, layout label) pairs (a layout study; "" for the baseline)."""
    keys = list(dict.fromkeys(w if isinstance(w, tuple) else (w, "") for w in sorted(workers, key=lambda w: (
        w if isinstance(w, int) else 0))))  # world sizes in order; a layout study's in the order it names them
    groups = []
    for pol in policies:
        for w, layout in keys:
            mine = [r for r in runs if r["workers"] == w and r.get("layout", "") == layout and pol in r["policies"]]
            ok = [r for r in mine if r["status"] == "ok"]
            short = [r["error"] for r in mine if r["status"] == "short"]  # finished, too short to judge
            g: dict[str, Any] = {
                "workers": w, "layout": layout, "policy": pol, "global_batch": mine[0]["global_batch"] if mine else None,
                "n_ok": len(ok), "n_failed": len(mine) - len(ok) - len(short), "n_short": len(short), "short": short,
                "errors": [r["error"] for r in mine if r["status"] not in ("ok", "short")],
                "samples_per_s": _stat(r["samples_per_s"] for r in ok),
                "step_time_s": _stat(r["step_time_s"] for r in ok),
                "accuracy": _stat(r["final"].get("accuracy") for r in ok),
                "loss": _stat(r["final"].get("loss") for r in ok),
                "to_target_s": _stat((r["to_target"] or {}).get("wall_s") for r in ok),
                "to_target_samples": _stat((r["to_target"] or {}).get("samples") for r in ok),
                "noise_scale": (_stat(r["noise_scale"] for r in ok) or {}).get("mean"),
                "breakdown": {k: (_stat(r["breakdown"].get(k) for r in ok) or {}).get("mean")
                              for k in ("compute", "comm_exposed", "data_wait", "idle")} if ok else {},
            }
            groups.append(g)
    for g in groups:
        base = next((b for b in groups if b["policy"] == g["policy"] and b["workers"] == 1 and not b["layout"]), None)
        g["speedup"] = g["efficiency"] = None
        if base and g is not base:
            g["speedup"] = paired_speedup(runs, g["workers"], g["policy"], g["layout"])
            if g["speedup"]:
                g["efficiency"] = {k: (v / g["workers"] if isinstance(v, float) else v)
                                   for k, v in g["speedup"].items() if k != "ratios"}
        g["findings"] = [f.text for f in findings(g, base)]
        g["verdict"] = verdict(g, base)
    return groups


def paired_speedup(runs: list[dict[str, Any]], workers: int, policy: str, layout: str = "") -> dict[str, Any] | None:
    """Speedup over 1 worker from the runs of the same round, with a 95 % interval from 2 rounds on.

    Each round ran both world sizes back to back (interleaved), so their ratio
    cancels what drifts between rounds. The interval is Student's t on the log
    ratios (a ratio is not symmetric around its mean); ``low``/``high`` are None
    with one round.
    """
    def rates(w: int, lay: str) -> dict[int, float]:
        return {r["repeat"]: r["samples_per_s"] for r in runs if r["workers"] == w and r.get("layout", "") == lay
                and policy in r["policies"] and r["status"] == "ok" and r["samples_per_s"]}

    one, many = rates(1, ""), rates(workers, layout)
    ratios = [many[k] / one[k] for k in sorted(one.keys() & many.keys())]
    if not ratios:
        return None
    mean, low, high = ratio_interval(ratios)
    return {"mean": mean, "low": low, "high": high, "n": len(ratios),
            "std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0, "ratios": ratios}


def ratio_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """(geometric mean, low, high): Student's t 95 % interval on the log ratios; no interval for one ratio."""
    logs = [math.log(x) for x in ratios]
    mean = math.exp(statistics.fmean(logs))
    if len(logs) < 2:
        return mean, None, None
    from scipy.stats import t

    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return mean, mean * math.exp(-half), mean * math.exp(half)


def headline(groups: list[dict[str, Any]]) -> str:
    parts, seen_baseline = [], False
    for g in groups:
        baseline = g["workers"] == 1 and not g.get("layout")
        if baseline:
            if seen_baseline:
                continue  # every policy shares the 1-worker run
            seen_baseline = True
        acc = g["accuracy"]["mean"] if g.get("accuracy") else None
        name = "1 worker" if baseline else label(g)
        if g["n_ok"] == 0:
            parts.append(f"{name}: {'failed' if g['n_failed'] else 'no evidence (too short to judge)'}")
            continue
        speed = f"{g['samples_per_s']['mean']:,.0f} samples/s"
        if g["speedup"]:
            sp = g["speedup"]
            interval = f" (95 % interval {sp['low']:.2f}-{sp['high']:.2f}x, {sp['n']} rounds)" if sp["low"] else " (1 round)"
            speed = f"{sp['mean']:.2f}x{interval}, {100 * g['efficiency']['mean']:.0f} % efficiency"
        parts.append(f"{name}: {speed}" + (f", accuracy {100 * acc:.2f} %" if acc is not None else ""))
    return "; ".join(parts)


