"""What measuring the gradient noise scale every step costs, and what it measures, on digits.

Part 1 (overhead): the digits recipe's model and data (sklearn's 8x8 digits,
MLP 64-256-256-10, SGD momentum, global batch 64: the recipe's defaults)
over gloo ranks. DDP models in one process group: plain DDP, DDP with
``mg.NoiseScale`` measuring one step in each ``--every`` (1 and 4 by
default), and one whose NoiseScale callbacks run under a CPU stopwatch (its
direct cost); trained in turn in blocks of ``--steps`` optimizer steps
(order flipped each block) so machine noise hits all alike. Printed: median
wall time (slowest rank) and CPU time (all threads of all ranks) per step,
ratios of totals and per-block medians with IQR, the direct cost, and an
environment fingerprint.

Part 2 (measurement): a full digits training run (the recipe's defaults) with
NoiseScale every step: B_simple as training goes, and the end-of-run summary.

    python benchmarks/noise_overhead.py                     # 2 gloo ranks
    python benchmarks/noise_overhead.py --every 1,2,10 --world-size 4 --epochs 0
    python benchmarks/noise_overhead.py --workload gpt --epochs 0 --blocks 10 --steps 5   # a compute-bound step

``--workload gpt``: the GPT recipe's ``small`` model (6 blocks x 384, 10.8M
parameters, 128 tokens) on Python's docs as bytes, AdamW; part 1 only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import os
import tempfile

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import multigpu as mg
from multigpu.runtime.fingerprint import format_fingerprint
from multigpu.recipes.digits import digits_datasets, evaluate, make_model
from multigpu.testing import spawn

GLOBAL_BATCH, LR, WARMUP_STEPS = 64, 0.1, 5  # the digits recipe's defaults


def _batches(train):
    while True:  # one pass of the loader is one epoch
        yield from train


class _TimedNoiseScale(mg.NoiseScale):
    """NoiseScale with a CPU stopwatch (this thread's CPU time) around each of its callbacks: its direct
    cost, which preemption by other processes does not inflate."""

    seconds = 0.0

    def _timed(name):  # noqa: N805 - a decorator factory used in the class body
        def wrapper(self, *args):
            start = time.thread_time()
            try:
                return getattr(mg.NoiseScale, name)(self, *args)
            finally:
                self.seconds += time.thread_time() - start
        return wrapper

    _on_grad = _timed("_on_grad")
    _on_micro_grad = _timed("_on_micro_grad")
    _before_reduction = _timed("_before_reduction")
    _after_reduction = _timed("_after_reduction")


def _workload(name: str):
    """(training set, model factory, loss function, optimizer factory) of ``digits`` or ``gpt``."""
    if name == "digits":
        train_set, _ = digits_datasets(seed=0)
        return (train_set, make_model, nn.CrossEntropyLoss(),
                lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9))
    from multigpu.recipes.gpt.data import TokenWindows, prepare_tokens
    from multigpu.recipes.gpt.model import GPT, config

    cfg = config("small", block_size=128)
    directory = prepare_tokens(os.path.join(tempfile.gettempdir(), "multigpu-pydoc-tokens"))
    train_set = TokenWindows(directory / "train.bin", cfg.block_size, cfg.vocab_size)
    return (train_set, lambda: GPT(cfg), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
            lambda params: torch.optim.AdamW(params, lr=3e-4))


class _Run:
    """One model training (DDP; one process: 4 micro-batches); ``block(n)`` times n optimizer steps."""

    def __init__(self, dist, workload, every: int | None, batch: int, timed: bool = False):  # every None: plain
        train_set, make, loss_fn, make_opt = workload
        one = dist.world_size == 1  # NoiseScale measures with accumulation micro-batches there
        self.plan = mg.BatchPlan(batch, dist.world_size, micro_batch=batch // 4 if one else None)
        self.device = dist.device
        torch.manual_seed(0)
        self.model = mg.wrap(make().to(dist.device), "none" if one else "ddp")
        cls = _TimedNoiseScale if timed else mg.NoiseScale
        self.noise = cls(self.plan, every=every).attach(self.model) if every else None
        self.opt = make_opt(self.model.parameters())
        self.loss_fn = loss_fn
        self.batches = _batches(mg.loader(train_set, self.plan, dist, seed=0))

    def block(self, steps: int) -> tuple[float, float, float]:
        """(wall seconds per step, slowest rank; CPU seconds per step, all threads of all ranks;
        NoiseScale's callbacks' CPU time / the process's CPU time, mean of the ranks)."""
        world = tdist.get_world_size()
        if world > 1:
            tdist.barrier()
        _sync(self.device)
        if isinstance(self.noise, _TimedNoiseScale):
            self.noise.seconds = 0.0
        start, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for x, y in mg.accumulate(self.model, next(self.batches)):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                (self.loss_fn(self.model(x), y) / self.plan.accum_steps).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        elapsed, own_cpu = time.perf_counter() - start, time.process_time() - cpu0
        direct = self.noise.seconds / own_cpu if isinstance(self.noise, _TimedNoiseScale) else 0.0
        vals = torch.tensor([elapsed, own_cpu, direct], dtype=torch.float64)
        wall = vals[:1].clone()
        if world > 1:
            tdist.all_reduce(wall, op=tdist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            # CPU time is what the work costs, whatever else the (shared) machine runs meanwhile.
            tdist.all_reduce(vals)
        return float(wall) / steps, float(vals[1]) / steps, float(vals[2]) / world


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _overhead(dist, blocks: int, steps: int, everies: list[int], batch: int, workload: str = "digits") -> dict:
    """Blocks of ``steps`` steps of each variant in turn (order flipped every block)."""
    work = _workload(workload)
    runs = {"plain": _Run(dist, work, None, batch)}
    runs |= {f"every {e}": _Run(dist, work, e, batch) for e in everies}
    # With stopwatches: their direct cost; their own step times are not compared.
    runs |= {f"timed {e}": _Run(dist, work, e, batch, timed=True) for e in everies}
    for run in runs.values():
        run.block(WARMUP_STEPS)
    out = {name: [] for name in runs}
    for i in range(blocks):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            out[name].append(runs[name].block(steps))
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
    noise.flush()  # the steps still waiting for their batch's all-reduce
    return {"history": history, "summary": noise.summary(), "steps_per_epoch": len(train)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="gloo ranks (1: one process, 4 micro-batches)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: one process on one GPU (NoiseScale from micro-batches); part 1 only")
    ap.add_argument("--blocks", type=int, default=40, help="timed blocks per variant")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per block")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="global batch of part 1 (recipe default 64)")
    ap.add_argument("--every", default="1,4", help="NoiseScale variants: one measured step in this many (comma-separated)")
    ap.add_argument("--epochs", type=int, default=20, help="epochs of the measurement run (0: skip it)")
    ap.add_argument("--workload", default="digits", choices=["digits", "gpt"],
                    help="digits (the recipe's MLP) or gpt (the GPT recipe's small model, compute-bound)")
    args = ap.parse_args()
    w = 1 if args.device == "cuda" else args.world_size
    print("fingerprint:", format_fingerprint(mg.fingerprint(None, world_size=w)), flush=True)

    everies = [int(e) for e in args.every.split(",")]
    if args.device == "cuda":
        with mg.init(backend="nccl", seed=0) as dist:
            r = _overhead(dist, args.blocks, args.steps, everies, args.global_batch, args.workload)
        where = f"1 process on {torch.cuda.get_device_name(0)}, 4 micro-batches"
    else:
        r = spawn(_overhead, w, args.blocks, args.steps, everies, args.global_batch, args.workload, timeout=3600)[0]
        where = f"DDP over {w} gloo ranks" if w > 1 else "1 process on CPU, 4 micro-batches"
    what_model = "digits MLP" if args.workload == "digits" else "GPT small (10.8M parameters, 128 tokens)"
    print(f"{what_model}, {where}, global batch {args.global_batch}; {args.blocks} blocks of {args.steps} "
          f"steps per variant, variants in turn (order flipped every block):")
    for i, what in ((0, "wall time per step (slowest rank)"), (1, "CPU time per step (all ranks, all threads)")):
        plain = [b[i] for b in r["plain"]]
        print(f"  {what}: plain median {statistics.median(plain) * 1e3:.3f} ms")
        for e in everies:
            noise = [b[i] for b in r[f"every {e}"]]
            ratios = sorted(b / a for a, b in zip(plain, noise))
            q = statistics.quantiles(ratios, n=4)
            print(f"    NoiseScale every {e} / plain: totals {sum(noise) / sum(plain):.3f}; per block median "
                  f"{statistics.median(ratios):.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)})")
    print("  direct cost: CPU time inside NoiseScale's callbacks / the rank's CPU time (mean of ranks):")
    for e in everies:
        direct = sorted(b[2] for b in r[f"timed {e}"])
        q = statistics.quantiles(direct, n=4)
        print(f"    every {e}: median {100 * statistics.median(direct):.2f}% (IQR {100 * q[0]:.2f}-{100 * q[2]:.2f}%, "
              f"n={len(direct)})")
    print("  target: < 3% of the step when measured every step")

    if args.epochs and args.device == "cpu" and w > 1 and args.workload == "digits":
        t = spawn(_train, w, args.epochs, timeout=3600)[0]
        print(f"\nnoise scale during a digits run ({args.epochs} epochs x {t['steps_per_epoch']} steps, {w} ranks, "
              f"global batch {GLOBAL_BATCH}):")
        for epoch, m, acc in t["history"]:
            b = (f"{m['noise/b_simple']:8.1f}" if "noise/b_simple" in m else
                 "   (noise-dominated)" if m else "  (no step averaged yet)")
            print(f"  epoch {epoch:3d}: B_simple {b} | |G|^2 {m.get('noise/grad_sq', float('nan')):.4g} | "
                  f"tr(Sigma) {m.get('noise/trace_cov', float('nan')):.4g} | test accuracy {100 * acc:.2f}%")
        print(t["summary"])


if __name__ == "__main__":
    main()
