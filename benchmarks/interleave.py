"""Timing shared by the side-by-side benchmarks: variants built once, timed in interleaved rounds.

A change of load on the machine then hits every variant alike (A B C A B C
rather than A A A B B B). Per step: wall time and this process's CPU time
(gloo's threads included). Figures are the slowest rank's median, with the
interquartile range.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import torch


def time_interleaved(variants: dict[str, Any], step: Callable[[Any], None], *, warmup: int, rounds: int,
                     steps: int) -> dict[str, dict[str, list[float]]]:
    """``step(variant)`` ``warmup`` times each, then ``rounds`` x (each variant ``steps`` times): per variant, times."""
    out = {name: {"times": [], "cpu": []} for name in variants}
    for variant in variants.values():
        for _ in range(warmup):
            step(variant)
    for _ in range(rounds):
        for name, variant in variants.items():
            torch.distributed.barrier()
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step(variant)
                out[name]["times"].append(time.perf_counter() - t0)
                out[name]["cpu"].append(time.process_time() - c0)
    return out


def _quartile(values: list[float], which: int) -> float:
    return statistics.quantiles(values, n=4)[which] if len(values) > 1 else values[0]


def slowest_rank(results: list[dict], name: str) -> dict[str, float]:
    """Over the ranks' results: the largest median step time, IQR, median CPU time and state bytes."""
    rows = [r[name] for r in results]
    return {"median": max(statistics.median(r["times"]) for r in rows),
            "iqr": max(_quartile(r["times"], 2) - _quartile(r["times"], 0) for r in rows),
            "cpu": max(statistics.median(r["cpu"]) for r in rows),
            "bytes": max(r["bytes"]["total"] for r in rows)}


def timing_arguments(parser: Any, *, warmup: int = 2, steps: int = 3, rounds: int = 4) -> None:
    """The interleaved benchmarks' shared flags: warm-up steps, timed steps per round, rounds, --json."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", help="also write the raw results here")


def environment(world_size: int) -> dict:
    """The fingerprint a benchmark prints and saves: gloo ranks of one thread, and the machine's load."""
    import multigpu as mg

    return mg.fingerprint(None, world_size=world_size, backend="gloo", threads_per_rank=1,
                          load_average_1min=round(os.getloadavg()[0], 2))


def finish(env: dict, header: str, lines: list[str], results: list[dict], args: Any) -> int:
    """Print the environment, what was measured and the table; the raw results to ``--json`` if asked."""
    from multigpu.runtime.fingerprint import format_fingerprint

    print("environment:", format_fingerprint(env))
    print(header)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "results": results}, f)
    return 0
