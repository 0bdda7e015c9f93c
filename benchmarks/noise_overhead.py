"""What measuring the gradient noise scale every step costs, and what it measures, on digits.

Part 1 (overhead): the digits recipe's model and data (sklearn's 8x8 digits,
MLP 64-256-256-10, SGD momentum, global batch 64) over gloo ranks; DDP
models in one process group, three of them: plain DDP, DDP with PyTorch's own
Python ``allreduce_hook`` (the floor of any comm-hook measurement) and DDP
with ``mg.NoiseScale``, trained in alternating blocks of ``--steps``
optimizer steps (order flipped each block) so machine noise hits all alike.
Printed: median wall time (slowest rank) and CPU time (all threads of all
ranks) per step, ratios of totals and per-block medians with IQR, and an
environment fingerprint.

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


class _Run:
    """One DDP model training on digits; ``block(n)`` times n optimizer steps (slowest rank)."""

    def __init__(self, dist, train_set, every: int | None):  # None: plain DDP; 0: allreduce_hook only
        self.plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
        torch.manual_seed(0)
        self.model = mg.wrap(make_model(), "ddp")
        self.noise = mg.NoiseScale(self.plan, every=every).attach(self.model) if every else None
        if every == 0:
            # The floor of any Python DDP comm hook: PyTorch's own all-reduce hook, nothing measured.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.batches = _batches(mg.loader(train_set, self.plan, dist, seed=0))

    def block(self, steps: int) -> tuple[float, float]:
        """(wall seconds per step, slowest rank; CPU seconds per step, all threads of all ranks)."""
        tdist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for x, y in mg.accumulate(self.model, next(self.batches)):
                (self.loss_fn(self.model(x), y) / self.plan.accum_steps).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        tdist.all_reduce(wall, op=tdist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        # CPU time is what the work costs, whatever else the (shared) machine runs meanwhile.
        tdist.all_reduce(cpu)
        return float(wall) / steps, float(cpu) / steps


def _overhead(dist, blocks: int, steps: int, every: int) -> dict:
    """Blocks of ``steps`` steps, alternating plain / with NoiseScale (order flipped every block)."""
    train_set, _ = digits_datasets(seed=0)
    runs = {"plain": _Run(dist, train_set, None), "pyhook": _Run(dist, train_set, 0), "noise": _Run(dist, train_set, every)}
    for run in runs.values():
        run.block(WARMUP_STEPS)
    out = {name: [] for name in runs}
    for i in range(blocks):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            out[name].append(runs[name].block(steps))
    out["b_simple"] = runs["noise"].noise.metrics().get("noise/b_simple")
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
    ap.add_argument("--blocks", type=int, default=60, help="timed blocks per variant, alternating plain / NoiseScale")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per block")
    ap.add_argument("--every", type=int, default=1, help="NoiseScale measures one step in this many")
    ap.add_argument("--epochs", type=int, default=20, help="epochs of the measurement run (0: skip it)")
    args = ap.parse_args()
    w = args.world_size
    print("fingerprint:", ", ".join(f"{k}={v}" for k, v in _fingerprint(w).items()), flush=True)

    r = spawn(_overhead, w, args.blocks, args.steps, args.every, timeout=3600)[0]
    print(f"digits MLP, DDP over {w} gloo ranks, global batch {GLOBAL_BATCH}, NoiseScale every {args.every} step(s); "
          f"{args.blocks} alternating blocks of {args.steps} steps per variant:")
    for i, what in ((0, "wall time per step (slowest rank)"), (1, "CPU time per step (all ranks, all threads)")):
        plain, hook, noise = ([b[i] for b in r[k]] for k in ("plain", "pyhook", "noise"))
        print(f"  {what}, medians: plain DDP {statistics.median(plain) * 1e3:.3f} ms | with PyTorch's allreduce_hook "
              f"{statistics.median(hook) * 1e3:.3f} ms | with NoiseScale {statistics.median(noise) * 1e3:.3f} ms")
        for label, base in (("NoiseScale / plain DDP", plain), ("NoiseScale / allreduce_hook", hook),
                            ("allreduce_hook / plain DDP", None)):
            num, den = (hook, plain) if base is None else (noise, base)
            ratios = sorted(b / a for a, b in zip(den, num))
            q = statistics.quantiles(ratios, n=4)
            print(f"    {label}: totals {sum(num) / sum(den):.3f}; per block median {statistics.median(ratios):.3f} "
                  f"(IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)})")
    print("  target: NoiseScale / plain DDP < 1.03")

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
