"""What measuring the gradient noise scale every step costs, and what it measures, on digits.

Part 1 (overhead): the digits recipe's model and data (sklearn's 8x8 digits,
MLP 64-256-256-10, SGD momentum, global batch 64) over gloo ranks, DDP with
and without ``mg.NoiseScale`` attached. Trials alternate plain, noise, plain,
noise... in one process group so machine noise hits both alike; each trial
builds a fresh DDP model, warms up, then times ``--steps`` optimizer steps
(slowest rank). Printed: per-pair ratio noise/plain, median and spread, and
an environment fingerprint.

Part 2 (measurement): a full digits training run (the recipe's defaults) with
NoiseScale every step: B_simple as training goes, and the end-of-run summary.

    python benchmarks/noise_overhead.py                     # 2 gloo ranks
    python benchmarks/noise_overhead.py --every 10 --world-size 4
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch
import torch.distributed as tdist
from torch import nn

import multigpu as mg
from multigpu.recipes.digits import digits_datasets, evaluate, make_model
from multigpu.testing import spawn

GLOBAL_BATCH, LR, WARMUP_STEPS = 64, 0.1, 5


def _batches(train):
    while True:  # one pass of the loader is one epoch
        yield from train


def _trial(dist, train_set, steps: int, every: int | None) -> float:
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    torch.manual_seed(0)
    model = mg.wrap(make_model(), "ddp")
    if every is not None:
        mg.NoiseScale(plan, every=every).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batches(mg.loader(train_set, plan, dist, seed=0))
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            tdist.barrier()
            start = time.perf_counter()
        for x, y in mg.accumulate(model, next(batches)):
            (loss_fn(model(x), y) / plan.accum_steps).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(elapsed)


def _overhead(dist, trials: int, steps: int, every: int) -> dict:
    train_set, _ = digits_datasets(seed=0)
    out = {"plain": [], "noise": []}
    for _ in range(trials):
        out["plain"].append(_trial(dist, train_set, steps, None))
        out["noise"].append(_trial(dist, train_set, steps, every))
    return out


def _train(dist, epochs: int) -> dict:
    """The digits recipe's defaults (global batch 64, SGD 0.1 momentum 0.9, 20 warmup steps) with NoiseScale."""
    train_set, test_set = digits_datasets(seed=0)
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    torch.manual_seed(0)
    model = mg.wrap(make_model(), "ddp")
    noise = mg.NoiseScale(plan).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = mg.warmup(opt, steps=20, start_lr=LR)
    amp = mg.Precision("fp32", dist.device)
    loss_fn = nn.CrossEntropyLoss()
    train = mg.loader(train_set, plan, dist, shuffle=True, seed=0)
    history = []
    for epoch in range(epochs):
        for micro_batches in train:
            for x, y in mg.accumulate(model, micro_batches):
                (loss_fn(model(x), y) / plan.accum_steps).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        if epoch in (0, 1, 4) or epoch % 5 == 4:
            history.append((epoch + 1, noise.metrics(), evaluate(model, test_set, dist, amp)["accuracy"]))
    return {"history": history, "summary": noise.summary(), "steps_per_epoch": len(train)}


def _fingerprint(world: int) -> dict:
    try:
        from multigpu.fingerprint import fingerprint  # the meter branch's, once merged

        return fingerprint(world_size=world)
    except ImportError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return {"torch": torch.__version__, "python": platform.python_version(), "device": "cpu/gloo",
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "world_size": world, "git": rev or "?"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--trials", type=int, default=6, help="pairs of alternating (plain, noise) trials")
    ap.add_argument("--steps", type=int, default=150, help="timed optimizer steps per trial")
    ap.add_argument("--every", type=int, default=1, help="NoiseScale measures one step in this many")
    ap.add_argument("--epochs", type=int, default=20, help="epochs of the measurement run (0: skip it)")
    args = ap.parse_args()
    w = args.world_size
    print("fingerprint:", ", ".join(f"{k}={v}" for k, v in _fingerprint(w).items()), flush=True)

    r = spawn(_overhead, w, args.trials, args.steps, args.every, timeout=3600)[0]
    print(f"digits MLP, DDP over {w} gloo ranks, global batch {GLOBAL_BATCH}, NoiseScale every {args.every} step(s); "
          f"mean step time over {args.steps} steps (slowest rank):")
    ratios = []
    for i, (a, b) in enumerate(zip(r["plain"], r["noise"])):
        ratios.append(b / a)
        print(f"  pair {i}: plain {a * 1e3:7.3f} ms | with NoiseScale {b * 1e3:7.3f} ms | ratio {b / a:.3f}")
    print(f"ratio with/without: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
          f"n={len(ratios)} pairs; target < 1.03)")

    if args.epochs:
        t = spawn(_train, w, args.epochs, timeout=3600)[0]
        print(f"\nnoise scale during a digits run ({args.epochs} epochs x {t['steps_per_epoch']} steps, {w} ranks, "
              f"global batch {GLOBAL_BATCH}):")
        for epoch, m, acc in t["history"]:
            b = f"{m['noise/b_simple']:8.1f}" if "noise/b_simple" in m else "   (noise-dominated)"
            print(f"  epoch {epoch:3d}: B_simple {b} | |G|^2 {m.get('noise/grad_sq', float('nan')):.4g} | "
                  f"tr(Sigma) {m.get('noise/trace_cov', float('nan')):.4g} | test accuracy {100 * acc:.2f}%")
        print(t["summary"])


if __name__ == "__main__":
    main()
