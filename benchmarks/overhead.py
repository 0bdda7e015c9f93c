"""multigpu's per-step overhead against a hand-written torch.distributed DDP loop.

Both loops train the same model on the same data with 2 gloo ranks on CPU:
(a) DataLoader + DistributedSampler + DistributedDataParallel, written by hand;
(b) mg.loader + mg.wrap("ddp") + mg.accumulate.
Trials alternate a, b, a, b... inside one process group so that machine noise
hits both alike; the ratio b/a of median step times is printed with its
spread over trials, and an environment fingerprint.

    python benchmarks/overhead.py [--trials 6] [--steps 30] [--world-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import multigpu as mg
from multigpu.testing import spawn

GLOBAL_BATCH = 256


def _data(n=8192):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 256, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _hand_written(dist, ds, steps):
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(0)
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH // dist.world_size, sampler=sampler, drop_last=True)
    times, t0 = [], time.perf_counter()
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def _multigpu(dist, ds, steps):
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    model = mg.wrap(_model(), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times, t0 = [], time.perf_counter()
    for step, micro_batches in enumerate(mg.loader(ds, plan, dist, seed=0)):
        if step == steps:
            break
        for x, y in mg.accumulate(model, micro_batches):
            (nn.functional.cross_entropy(model(x), y) / plan.accum_steps).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def _bench(dist, trials, steps):
    ds = _data()
    out = {"hand": [], "multigpu": []}
    for _ in range(trials):
        for name, fn in (("hand", _hand_written), ("multigpu", _multigpu)):
            torch.distributed.barrier()
            times = fn(dist, ds, steps)[3:]  # drop warm-up steps
            out[name].append(statistics.median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    results = spawn(_bench, args.world_size, args.trials, args.steps, timeout=1800)
    r0 = results[0]
    ratios = [b / a for a, b in zip(r0["hand"], r0["multigpu"])]
    print(f"fingerprint: {mg_fingerprint(args.world_size)}")
    print(f"step time, median over {args.steps - 3} steps, per trial (rank 0):")
    for i, (a, b) in enumerate(zip(r0["hand"], r0["multigpu"])):
        print(f"  trial {i}: hand-written {a * 1e3:7.2f} ms | multigpu {b * 1e3:7.2f} ms | ratio {b / a:.3f}")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"ratio multigpu/hand-written: median {statistics.median(ratios):.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)} trials; target <= 1.02)")


def mg_fingerprint(world_size: int) -> str:
    from multigpu.fingerprint import fingerprint

    fp = fingerprint(world_size=world_size)
    return ", ".join(f"{k}={v}" for k, v in fp.items())


if __name__ == "__main__":
    main()
