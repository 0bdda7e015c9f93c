"""Is `multigpu tune`'s choice the fastest layout? Ground truth from measuring every candidate.

1. the exhaustive search: ``run_tune(top=all)``, every candidate that fits
   measured in ``--repeats`` interleaved rounds;
2. tune as a user runs it (``--top K``), timed end to end.

Printed: the true fastest (exhaustive median), tune's choice and how far its
measured step time is from the fastest (goal: within 5 %), where the true
fastest stood in the prediction's ranking, the cost model's median and worst
error for step time and memory over every measured candidate, both wall
times, and the environment fingerprint.

    python benchmarks/tune_exhaustive.py                               # 4 CPU ranks, GPT tiny, global batch 16
    python benchmarks/tune_exhaustive.py -n 2 --micro-batches 4,8 --repeats 1 --global-batch 16
    python benchmarks/tune_exhaustive.py --measured studies/tune-exhaustive/all-HHMMSS   # re-predict, no re-measuring

    python benchmarks/tune_exhaustive.py --script examples/hf_model.py --micro-batches ''   # a script's layouts

``--script PATH``: a script that follows the layout contract (docs/your-model.md) instead of the recipe;
tune measures its layouts (no prediction), so the comparison is of tune's choice (every layout once,
the top K again) against every layout measured in every round. ``--micro-batches ''``: the script's own.

``--measured DIR``: an earlier exhaustive run's measurements, predicted again by
the current cost model from a fresh probe and the cached links (the model
changed, the machine did not), then tune --top K as usual.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import multigpu as mg
from multigpu.runtime.fingerprint import format_fingerprint
from multigpu.tune import TuneConfig, run_tune


def repredict(report: dict, a) -> dict:
    """``report``'s candidates predicted again by the current model (a fresh probe, the cached links), re-sorted."""
    from multigpu.recipes.gpt.model import config
    from multigpu.tune import machine
    from multigpu.tune.machine import measure_parts
    from multigpu.tune.run import recipe
    from multigpu.tune.wrappers import gpt
    from multigpu.parallel.space import name

    cfg = config(a.size)
    found = recipe(TuneConfig("gpt", ("--size", a.size, "--global-batch", str(a.global_batch)), nproc=a.n,
                              micro_batches=tuple(int(v) for v in a.micro_batches.split(",")))).found
    by_name = {key: c for c in found for key in (c.label, name(c))}  # a tune.json from before named them so
    # Measured again: the probe is part of the model under test.
    parts = measure_parts(gpt(cfg), found, a.n, "cpu", 1, workload="multigpu.recipes.gpt", module=True,
                          recipe_args=("--size", a.size), root=Path(a.measured) / "reprobe")
    counts = machine.count_recipe(cfg)
    here = machine.measured_cluster(counts, parts, a.n, None)
    for r in report["candidates"]:
        r["predicted"] = machine.predict(by_name[r["candidate"]].resolve(a.n), counts, here, parts, a.global_batch)
        if r.get("result"):
            r["error"] = {"step_time": r["predicted"]["step_time_s"] / r["result"]["step_time_s"] - 1,
                          "memory": r["predicted"]["memory_bytes"] / r["result"]["memory_bytes"] - 1}
    report["candidates"].sort(key=lambda r: r["predicted"]["step_time_s"])
    report["probe"] = {"fixed": parts["fixed"], "busy": parts["busy"]}
    print("probe: busy", {k: v for k, v in parts["busy"].items()}, "\nprobe: loop", parts["loop"], "\nprobe: fixed",
          {k: {a: round(b * 1e3, 2) for a, b in v.items() if a.endswith("_s")} for k, v in parts["fixed"].items()})
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batches", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--out", default="studies/tune-exhaustive")
    ap.add_argument("--measured", default=None, metavar="DIR", help="an exhaustive run to re-predict instead of measuring")
    ap.add_argument("--script", default=None, metavar="PATH", help="a script of the layout contract instead of the recipe")
    ap.add_argument("--no-tune", action="store_true", help="with --measured: re-predict only, no tune --top K run")
    a = ap.parse_args()
    micro = tuple(int(v) for v in a.micro_batches.split(",") if v) or None
    workload = a.script or "gpt"
    common = dict(args=(() if a.script else ("--size", a.size)) + ("--global-batch", str(a.global_batch)), nproc=a.n,
                  cpu=True, repeats=a.repeats, steps=a.steps, micro_batches=micro)
    t0 = time.perf_counter()
    if a.measured:
        full = repredict(json.loads((Path(a.measured) / "tune.json").read_text()), a)
        exhaustive_s = full["wall_s"]
    else:
        _, full = run_tune(TuneConfig(workload, top=0, out=f"{a.out}/all-{time.strftime('%H%M%S')}", **common))
        exhaustive_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if a.no_tune:
        tuned = {"winner": None}
    else:
        _, tuned = run_tune(TuneConfig(workload, top=a.top, out=f"{a.out}/top{a.top}-{time.strftime('%H%M%S')}", **common))
    tune_s = time.perf_counter() - t0

    measured = [c for c in full["candidates"] if c.get("result")]
    best = min(measured, key=lambda c: c["result"]["step_time_s"])
    truth = {c["candidate"]: c["result"]["step_time_s"] for c in measured}
    if a.script:  # measured, not predicted: the choice against the exhaustive run, and the walls
        return _script_verdict(a, full, tuned, best, truth, exhaustive_s, tune_s)
    rank = [c["candidate"] for c in full["candidates"]].index(best["candidate"]) + 1
    print(f"\n{len(measured)} candidates measured ({a.repeats} rounds of {a.steps} steps) on {a.n} CPU ranks, gpt {a.size}, "
          f"global batch {a.global_batch}")
    print(f"true fastest: {best['candidate']}: {truth[best['candidate']] * 1e3:.1f} ms/step "
          f"(rank {rank} of {len(full['candidates'])} in the prediction)")
    chosen = tuned["winner"]
    if chosen in truth:
        gap = truth[chosen] / truth[best["candidate"]] - 1
        print(f"tune --top {a.top} chose: {chosen}: {truth[chosen] * 1e3:.1f} ms/step in the exhaustive run, "
              f"{gap:+.1%} from the fastest (goal: within 5 %)")
    else:
        print(f"tune --top {a.top} chose: {chosen} (not measured in the exhaustive run)")
    # The top-K selection of the exhaustive run's own predictions, judged by its own measurements.
    top = full["candidates"][:a.top]
    pick = min((c for c in top if c.get("result")), key=lambda c: c["result"]["step_time_s"])
    print(f"the same selection over the exhaustive run's data: {pick['candidate']}, "
          f"{truth[pick['candidate']] / truth[best['candidate']] - 1:+.1%} from the fastest")
    errs_t = [abs(c["error"]["step_time"]) for c in measured]
    errs_m = [abs(c["error"]["memory"]) for c in measured]
    for c in sorted(measured, key=lambda c: c["error"]["step_time"]):
        p = c["predicted"]
        print(f"  {c['candidate']:<34} measured {c['result']['step_time_s'] * 1e3:7.1f} predicted {p['step_time_s'] * 1e3:7.1f} "
              f"ms ({c['error']['step_time']:+.0%}): compute {p['compute_s'] * 1e3:.1f} + comm {p['comm_s'] * 1e3:.1f} + "
              f"fixed {p.get('overhead_s', 0.0) * 1e3:.1f}")
    print(f"prediction error, step time: median {statistics.median(errs_t):.0%}, worst {max(errs_t):.0%}; "
          f"memory: median {statistics.median(errs_m):.0%}, worst {max(errs_m):.0%}")
    order = sorted(measured, key=lambda c: c["result"]["step_time_s"])
    pred_rank = {c["candidate"]: i for i, c in enumerate(full["candidates"])}
    print("measured order (predicted rank):", ", ".join(f"{c['candidate']} ({pred_rank[c['candidate']] + 1})" for c in order[:8]))
    print(f"wall: exhaustive {exhaustive_s:.0f} s, tune --top {a.top} {tune_s:.0f} s ({tune_s / exhaustive_s:.0%})")
    print("env:", format_fingerprint(mg.fingerprint(None, world_size=a.n, backend="gloo")))


def _script_verdict(a, full: dict, tuned: dict, best: dict, truth: dict, exhaustive_s: float, tune_s: float) -> None:
    print(f"\n{len(truth)} layouts measured ({a.repeats} rounds of {a.steps} steps) on {a.n} CPU ranks, {a.script}, "
          f"global batch {a.global_batch}; left out: " + "; ".join(f"{o['layout']}: {o['reason']}" for o in full["left_out"]))
    print(f"true fastest: {best['candidate']}: {truth[best['candidate']] * 1e3:.1f} ms/step")
    chosen = tuned["winner"]
    gap = f"{truth[chosen] * 1e3:.1f} ms/step in the exhaustive run, {truth[chosen] / truth[best['candidate']] - 1:+.1%} " \
          "from the fastest (goal: within 5 %)" if chosen in truth else "not measured in the exhaustive run"
    print(f"tune --top {a.top} chose: {chosen}: {gap}")
    order = sorted(truth, key=truth.get)
    print("measured order:", ", ".join(f"{c} {truth[c] * 1e3:.1f}" for c in order))
    print(f"wall: exhaustive {exhaustive_s:.0f} s, tune --top {a.top} {tune_s:.0f} s ({tune_s / exhaustive_s:.0%})")
    print("env:", format_fingerprint(mg.fingerprint(None, world_size=a.n, backend="gloo")))


if __name__ == "__main__":
    main()
