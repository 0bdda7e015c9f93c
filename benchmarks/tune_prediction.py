"""How good tune's prediction (forecast's model on this machine's measured parts) was, from a tune run's tune.json:
step time and memory error per measured candidate, and, for every memory budget between the smallest and the
largest measured peak, whether a layout that would run out of it (its measured peak above) was predicted not
to fit.

    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 2,4 gpt --size small --global-batch 16
    python benchmarks/tune_prediction.py --tune-json studies/tune-.../tune.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def waits(measured) -> str:
    """A collective's measured waits in a busy step: one figure (a tune.json from before), or one per stretch of
    work before it."""
    if isinstance(measured, (int, float)):
        return f"{measured * 1e3:.2f} ms"
    return " / ".join(f"{w * 1e3:.2f} ms after {g * 1e3:.1f}" for g, w in measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-json", required=True)
    args = parser.parse_args()
    report = json.loads(Path(args.tune_json).read_text())
    rows = [r for r in report["candidates"] if r.get("result")]
    probe = report.get("probe") or report["prediction"]  # the recipe's tune.json, a script's
    print(f"{report['workload']} on {report['world_size']} ranks, global batch "
          f"{report.get('global_batch') or probe['global_batch']}; probe: slowdown {probe['busy']['slowdown']:.2f}, waits "
          + ", ".join(f"{n} ranks {waits(w)}" for n, w in probe["busy"]["wait_s"].items()) + "\n")
    print("| layout | measured ms/step | predicted | error | measured MiB | predicted | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["result"]["step_time_s"]):
        m, p = r["result"], r["predicted"]
        print(f"| {r['candidate']} | {m['step_time_s'] * 1e3:,.0f} | {p['step_time_s'] * 1e3:,.0f} | "
              f"{r['error']['step_time']:+.0%} | {m['memory_bytes'] / 2**20:,.1f} | {p['memory_bytes'] / 2**20:,.1f} | "
              f"{r['error']['memory']:+.0%} |")
    for key, label in (("step_time", "step time"), ("memory", "memory")):
        errs = [abs(r["error"][key]) for r in rows]
        print(f"\n{label} error over {len(errs)} layouts: median {statistics.median(errs):.1%}, worst {max(errs):.1%}, "
              f"within 15 %: {sum(e <= 0.15 for e in errs)}")
    # Every budget between two measured peaks: the layouts over it would run out; were they predicted over it?
    peaks = sorted(r["result"]["memory_bytes"] for r in rows)
    budgets = [(a + b) / 2 for a, b in zip(peaks, peaks[1:]) if b > a]
    missed, cautious = 0, 0
    for budget in budgets:
        for r in rows:
            over, predicted_over = r["result"]["memory_bytes"] > budget, r["predicted"]["memory_bytes"] > budget
            missed += over and not predicted_over
            cautious += predicted_over and not over
    cases = len(budgets) * len(rows)
    print(f"\n{len(budgets)} budgets between the measured peaks x {len(rows)} layouts = {cases} cases: a layout over the "
          f"budget predicted to fit {missed} times; one under it predicted not to fit {cautious} times")
    worst = max(r["result"]["memory_bytes"] / r["predicted"]["memory_bytes"] - 1 for r in rows)
    print(f"the worst underestimate of a peak: {worst:+.1%}: a prediction kept {max(worst, 0):.1%} under the budget "
          "(tune's default budget on a GPU: 90 % of its memory) is never over it here")


if __name__ == "__main__":
    main()
