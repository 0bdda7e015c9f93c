"""Turning the gathered per-rank numbers into log records and the run summary (pure functions).

The JSONL schema these records follow is documented in docs/observability.md.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from . import gpumon
from .quorum import text as quorum_text
from .stragglers import find_stragglers

# Per-rank numbers gathered at log steps, in this order, followed by the step_end(**metrics)
# sums (sorted by name) and, on GPU, the monitor's vector. The medians (per step) name
# stragglers: a rank slowed on a few steps by the OS scheduler is noise, one slow on most
# steps is a straggler.
FIELDS = ("n", "wall", "data_wait", "compute", "ready", "loss_sum", "loss_n", "peak_mem",
          "dw_med", "cp_med", "rd_med", "dw_mad", "cp_mad", "rd_mad", "paused")


def mad(values: list[float]) -> float:
    """Median absolute deviation from the median."""
    med = statistics.median(values)
    return statistics.median([abs(v - med) for v in values])


def spread(values: list[float]) -> dict[str, float]:
    """``{mean, std, min, max, n}`` (sample standard deviation)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


# Step metrics named "stage/..." (``Pipeline.stage_times()``) stay per rank in the record's "ranks".
PER_RANK = "stage/"


def interval_record(
    rows: list[list[float]], keys: list[str], *, step: int, n_steps: int, samples_per_step: int, elapsed: float,
    lr: float | None, world_size: int, tokens_per_sample: float | None, flops_per_sample: float | None,
    peak_flops: float | None, hosts: list[str], gpu: bool, straggler_threshold: float,
    streak: dict[tuple[int, str], int], experts: dict[str, Any] | None = None, samples: int | None = None,
    skipped: int = 0,
) -> tuple[dict[str, Any], dict[tuple[int, str], int]]:
    """One ``step`` record from every rank's row; returns it and the updated straggler streaks. ``experts``:
    the expert-parallel dispatch's figures over the interval (``Stats.take``), with the all-to-all's share.
    ``samples``: the interval's samples trained (default ``n_steps * samples_per_step``; fewer where replica
    groups were missing or a step was retried), ``skipped``: every sample skipped so far."""
    b = len(FIELDS)
    per = [dict(zip(FIELDS, r[:b])) for r in rows]
    # The job runs at its slowest rank's pace; time in meter.pause() (eval, checkpoints) is not step time.
    step_time = max((p["wall"] - p["paused"]) / p["n"] for p in per)
    dw = [p["data_wait"] / p["n"] for p in per]
    cp = [p["compute"] / p["n"] for p in per]
    rd = [p["ready"] / p["n"] for p in per]
    loss_n = sum(p["loss_n"] for p in per)
    samples = n_steps * samples_per_step if samples is None else samples
    sps = samples / (step_time * n_steps)
    rec: dict[str, Any] = {
        "type": "step", "step": step, "steps": n_steps, "samples": samples,
        "samples_seen": (step + 1) * samples_per_step - skipped, "time": elapsed,
        "step_time": step_time, "data_wait": sum(dw) / len(dw), "data_wait_max": max(dw),
        "compute": sum(cp) / len(cp), "compute_max": max(cp),
        "data_wait_frac": sum(dw) / len(dw) / step_time, "compute_frac": sum(cp) / len(cp) / step_time,
        "samples_per_s": sps,
        "tokens_per_s": sps * tokens_per_sample if tokens_per_sample else None,
        "loss": sum(p["loss_sum"] for p in per) / loss_n if loss_n else None,
        "lr": lr,
        "peak_mem_gb": max(p["peak_mem"] for p in per) / 1e9,
        "peak_mem_rank": max(range(len(per)), key=lambda r: per[r]["peak_mem"]),
        "paused_s": per[0]["paused"],  # rank 0's: "time" is rank 0's clock
    }
    if flops_per_sample:
        rec["flops_per_s"] = flops_per_sample * sps
        rec["mfu"] = rec["flops_per_s"] / (peak_flops * world_size) if peak_flops else None
    for i, key in enumerate(keys):
        if key.startswith(PER_RANK):  # kept per rank (pipeline stages differ by design): mean per step
            rec.setdefault("ranks", {})[key[len(PER_RANK):]] = [r[b + i] / p["n"] for r, p in zip(rows, per)]
        else:
            rec[key] = sum(r[b + i] for r in rows) / sum(p["n"] for p in per)
    if experts is not None:  # the all-to-all's seconds per rank over the interval's step time
        rec["experts"] = dict(experts, a2a_share=experts["a2a_s"] / (step_time * n_steps))
    g = gpumon.across_ranks([r[b + len(keys):] for r in rows]) if gpu else None
    if g:
        rec["gpu"] = g
    have_ready = not any(math.isnan(x) for x in rd)
    if have_ready:  # fwd+bwd until this rank's own gradients were ready (no waiting for others)
        rec["ready"], rec["ready_max"] = sum(rd) / len(rd), max(rd)
    key = "rd" if have_ready else "cp"
    found = find_stragglers(
        [p["dw_med"] for p in per], [p[key + "_med"] for p in per], hosts, min_excess=straggler_threshold,
        data_jitter=[p["dw_mad"] for p in per], compute_jitter=[p[key + "_mad"] for p in per],
    ) if len(per) > 1 else []
    # A straggler seen in consecutive intervals is real; one interval can be the OS scheduler.
    streak = {(s.rank, s.cause): streak.get((s.rank, s.cause), 0) + 1 for s in found}
    rec["stragglers"] = [dict(s.to_dict(), line=s.line(), intervals=streak[s.rank, s.cause]) for s in found]
    return rec, streak


def figures(stats: list) -> dict[str, Any] | None:
    """The interval's expert figures (parallel/experts.py's ``figures``), None without expert parallelism."""
    if not stats:
        return None
    from ..parallel.experts import figures as take

    return take(stats)


def experts_stats(model: Any) -> list:
    """The expert-parallel dispatch's figures of ``model`` or its pipeline's stages (parallel/experts.py's
    ``Stats``); none for any other model."""
    from ..spreads import spread_of

    spread = None if model is None else spread_of(model)
    return [] if spread is None else list(spread.experts)


def router_note(model: Any, plan: Any) -> None:
    """Say in one line when the run's router loss is not one process's: a mixture of experts' load-balancing
    loss is each micro-batch's (over every data-parallel rank's part of it), so under accumulation the
    ranks' k-th micro-batches make another batch than one process's k-th."""
    if model is None or plan is None or plan.accum_steps == 1 or plan.world_size == 1:
        return
    from ..parallel.wrap import unwrap
    from .probe import is_pipeline

    inner = model if is_pipeline(model) else unwrap(model)
    if getattr(getattr(inner, "config", None), "output_router_logits", False):
        from ..dist import print0

        print0(f"mg.StepMeter: note: the router's load-balancing loss is each micro-batch's, and this run takes "
               f"{plan.accum_steps} a step on {plan.world_size} data-parallel ranks: it trains another loss than one "
               f"process with the same global batch; for the same, give each rank's share in one micro-batch "
               f"(micro_batch={plan.global_batch // plan.world_size}) or output_router_logits=False")


def measured(records: list[dict[str, Any]]) -> list[tuple[int, float, dict[str, Any]]]:
    """(samples, seconds, record) of every measured interval, from the records' own clock.

    An interval runs from the previous record's ``time`` to its own (rank 0's
    clock: everything in between counts, the log step's gather included) less
    the time spent in ``meter.pause()``. The first interval (warm-up, FLOP
    counting) and the profiled ones are left out when others remain.
    """
    # An interval's own samples where it has them: under replicas a healed group's step jumps the steps it missed
    spans = [(r.get("samples", r["samples_seen"] - p["samples_seen"]), r["time"] - p["time"] - r.get("paused_s", 0.0), r)
             for p, r in zip(records, records[1:]) if not r.get("profiled")]
    if not spans and records:  # one record: measured from the meter's start (its own samples: a resumed or
        r = records[0]      # healed run's samples_seen counts the steps before it)
        spans = [(r.get("samples", r["samples_seen"]), r["time"] - r.get("paused_s", 0.0), r)]
    return [s for s in spans if s[1] > 0]


def _fractions(data_wait: float, compute: float, seconds: float) -> dict[str, float]:
    """The measured time's shares, summing to 1. The ranks' mean data wait and compute can pass rank 0's
    measured time: a rank that leaves ``meter.pause()`` (an evaluation) first waits for the other in its next
    step's collectives, and counts that as compute. Then the two are shares of their own sum, other 0."""
    whole = max(seconds, data_wait + compute)
    return {"data_wait": data_wait / whole, "compute": compute / whole, "other": 1 - (data_wait + compute) / whole}


def first_step(record: dict[str, Any]) -> int:
    """The first step of a ``step`` record's interval (``step`` is its last)."""
    return record["step"] - record["steps"] + 1


def left_out(records: list[dict[str, Any]], spans: list[tuple[int, float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The step records ``measured`` did not count, as ``{"steps": [first, last], "why": ...}``.

    Consecutive records left out for the same reason are one entry; ``why`` is
    ``warm-up`` (the meter's first interval), ``profiled`` or ``no time``.
    """
    counted = {id(r) for _, _, r in spans}
    out: list[dict[str, Any]] = []
    for i, r in enumerate(records):
        if id(r) in counted:
            continue
        why = "warm-up" if i == 0 else "profiled" if r.get("profiled") else "no time"
        if out and out[-1]["why"] == why and out[-1]["steps"][1] == first_step(r) - 1:
            out[-1]["steps"][1] = r["step"]
        else:
            out.append({"steps": [first_step(r), r["step"]], "why": why})
    return out


def run_summary(records: list[dict[str, Any]], *, steps: int, samples_per_step: int, wall_time: float,
                flops_per_sample: float | None, peak_flops: float | None, world_size: int = 1,
                paused: dict[str, float] | None = None, skipped: int = 0) -> dict[str, Any] | None:
    """The ``summary`` record: throughput as total samples / total time over the measured intervals.

    ``rate_steps`` names the steps the rate covers, first and last; inside
    ``measured``, ``left_out`` names the step records it did not count (the
    warm-up interval, profiled ones) and ``paused_s`` the ``meter.pause()``
    time it took out of them, so the records alone give the same figure.

    The per-interval rates are kept as a spread (``intervals``), never as the
    value: their mean overstates a run whose intervals differ (a slow one
    weighs as much as a fast one).
    """
    spans = measured(records)
    if not spans:
        return None
    samples = sum(s for s, _, _ in spans)
    seconds = sum(t for _, t, _ in spans)
    n_steps = sum(r["steps"] for _, _, r in spans)
    # data wait and compute are per step run: a retried one too (``attempts``, under replicas)
    dw = sum(r["data_wait"] * r.get("attempts", r["steps"]) for _, _, r in spans)
    cp = sum(r["compute"] * r.get("attempts", r["steps"]) for _, _, r in spans)
    sps = samples / seconds
    rate_steps = [first_step(spans[0][2]), spans[-1][2]["step"]]
    out = {
        "type": "summary", "steps": steps, "samples_seen": steps * samples_per_step - skipped, "wall_time": wall_time,
        "samples_per_s": sps, "step_time": seconds / n_steps, "rate_steps": rate_steps,
        "measured": {"steps": n_steps, "samples": samples, "time_s": seconds, "intervals": len(spans),
                     "from_step": rate_steps[0], "to_step": rate_steps[1],
                     "paused_s": sum(r.get("paused_s", 0.0) for _, _, r in spans),
                     "warmup_steps": [first_step(records[0]), records[0]["step"]],
                     "left_out": left_out(records, spans)},
        "intervals": {"samples_per_s": spread([s / t for s, t, _ in spans]),
                      "step_time": spread([t / r["steps"] for _, t, r in spans])},
        "paused_s": dict(paused or {}),
        "fractions": _fractions(dw, cp, seconds),
        "peak_mem_gb": max(r["peak_mem_gb"] for r in records),
        "stragglers": sorted({(s["rank"], s["cause"]) for r in records for s in r["stragglers"] if s["intervals"] >= 2}),
        "flops_per_sample": flops_per_sample, "peak_flops": peak_flops,
    }
    if flops_per_sample:
        out["flops_per_s"] = flops_per_sample * sps
        out["mfu"] = out["flops_per_s"] / (peak_flops * world_size) if peak_flops else None
    stages = _stage_shares(spans, seconds)
    if stages:
        out["stages"] = stages
    if all("experts" in r for _, _, r in spans):
        out["experts"] = _experts_summary([r["experts"] for _, _, r in spans], seconds)
    return out


def _experts_summary(intervals: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Expert parallelism over the measured intervals: tokens per expert (summed), the worst interval's
    imbalance (max / mean tokens of an expert, its worst layer), the pairs dropped, the all-to-all's share."""
    return {"tokens": [sum(t) for t in zip(*(e["tokens"] for e in intervals))],
            "imbalance": max(e["imbalance"] for e in intervals), "dropped": sum(e["dropped"] for e in intervals),
            "a2a_share": sum(e["a2a_s"] for e in intervals) / seconds}


def _stage_shares(spans: list, seconds: float) -> list[dict[str, Any]]:
    """Per rank: its stage and the shares of the measured time in compute, in p2p (send, receive,
    waiting for the neighbours: the bubble) and the rest (optimizer, clipping, data, log steps)."""
    if not all("ranks" in r and "compute" in r["ranks"] for _, _, r in spans):
        return []
    n_ranks = len(spans[0][2]["ranks"]["compute"])
    out = []
    for rank in range(n_ranks):
        compute = sum(r["ranks"]["compute"][rank] * r.get("attempts", r["steps"]) for _, _, r in spans) / seconds
        p2p = sum(r["ranks"].get("p2p", [0.0] * n_ranks)[rank] * r.get("attempts", r["steps"]) for _, _, r in spans) / seconds
        stage = spans[-1][2]["ranks"].get("id", [math.nan] * n_ranks)[rank]
        out.append({"rank": rank, "stage": None if math.isnan(stage) else int(stage), "compute": compute,
                    "p2p": p2p, "other": max(0.0, 1.0 - compute - p2p)})
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The console's closing line for a ``summary`` record."""
    m, f = summary["measured"], summary["fractions"]
    spread = summary["intervals"]["samples_per_s"]
    paused = "".join(f"; {k} {v:.1f} s" for k, v in summary["paused_s"].items())
    out = ", ".join(f"{o['why']} {o['steps'][0]}-{o['steps'][1]}" for o in m.get("left_out", ()))
    return (f"multigpu: {summary['steps']} steps, {summary['samples_per_s']:,.0f} samples/s "
            f"({m['samples']:,} samples in {m['time_s']:.2f} s, steps {m['from_step']}-{m['to_step']}"
            f"{f' ({out} left out)' if out else ''}; "
            f"intervals {spread['min']:,.0f}-{spread['max']:,.0f}); time: compute {100 * f['compute']:.0f}%, "
            f"data wait {100 * f['data_wait']:.0f}%, other {100 * f['other']:.0f}%{paused}{_stages_text(summary)}"
            + (f"; {quorum_text(summary['replicas'])}" if summary.get("replicas") else ""))


def _stages_text(summary: dict[str, Any]) -> str:
    stages = summary.get("stages")
    if not stages:
        return ""
    parts = [f"rank {s['rank']} (stage {s['stage']}) {100 * s['compute']:.0f}/{100 * s['p2p']:.0f}/{100 * s['other']:.0f}"
             for s in stages]
    return "; pipeline compute/p2p+bubble/other %: " + ", ".join(parts)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a metrics.jsonl, skipping a last line a crash cut short."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash; the rest still counts
    return out
