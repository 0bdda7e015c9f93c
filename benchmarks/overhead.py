"""multigpu's per-step overhead against a hand-written torch.distributed DDP loop.

Both loops train the same model on the same data:
(a) DataLoader + DistributedSampler + DistributedDataParallel, written by hand;
(b) mg.loader + mg.wrap("ddp") + mg.accumulate.
Trials alternate a, b, a, b... inside one process group so that machine noise
hits both alike. Each trial times ``--steps`` steps after a warm-up, with the
device synchronised at both ends; the ratio b/a of mean step times is printed
per trial, with its median and spread, and an environment fingerprint.

    python benchmarks/overhead.py                      # 2 gloo ranks on CPU
    python benchmarks/overhead.py --device cuda        # 1 process, nccl, bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import multigpu as mg
from multigpu.testing import spawn

GLOBAL_BATCH, WARMUP = 256, 3


def _data(n=16384):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 256, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10)).to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hand_written(dist, ds, steps, bf16):
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    model = DistributedDataParallel(_model(dist.device), device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(0)
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH // dist.world_size, sampler=sampler, drop_last=True,
                        pin_memory=dist.device.type == "cuda")
    autocast = torch.autocast(dist.device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    start = None
    for step, (x, y) in enumerate(loader):
        if step == WARMUP:
            _sync(dist.device)
            start = time.perf_counter()
        if step == WARMUP + steps:
            break
        x, y = x.to(dist.device, non_blocking=True), y.to(dist.device, non_blocking=True)
        with autocast:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(dist.device)
    return (time.perf_counter() - start) / steps


def _multigpu(dist, ds, steps, bf16):
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    model = mg.wrap(_model(dist.device), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp = mg.Precision("bf16" if bf16 else "fp32", dist.device)
    start = None
    for step, micro_batches in enumerate(mg.loader(ds, plan, dist, seed=0)):
        if step == WARMUP:
            _sync(dist.device)
            start = time.perf_counter()
        if step == WARMUP + steps:
            break
        for x, y in mg.accumulate(model, micro_batches):
            with amp.autocast():
                loss = nn.functional.cross_entropy(model(x), y) / plan.accum_steps
            amp.scale(loss).backward()
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    _sync(dist.device)
    return (time.perf_counter() - start) / steps


def _bench(dist, trials, steps, bf16):
    ds = _data()
    out = {"hand": [], "multigpu": []}
    for _ in range(trials):
        for name, fn in (("hand", _hand_written), ("multigpu", _multigpu)):
            torch.distributed.barrier()
            out[name].append(fn(dist, ds, steps, bf16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--world-size", type=int, default=2, help="gloo ranks on CPU (ignored with --device cuda)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if args.device == "cuda":
        with mg.init(backend="nccl", seed=0) as dist:
            r0 = _bench(dist, args.trials, args.steps, bf16=True)
        world = 1
    else:
        r0 = spawn(_bench, args.world_size, args.trials, args.steps, False, timeout=3600)[0]
        world = args.world_size
    from multigpu.runtime.fingerprint import fingerprint

    print("fingerprint:", ", ".join(f"{k}={v}" for k, v in fingerprint(world_size=world).items()))
    print(f"mean step time over {args.steps} steps after {WARMUP} warm-up steps, rank 0, global batch {GLOBAL_BATCH}:")
    ratios = []
    for i, (a, b) in enumerate(zip(r0["hand"], r0["multigpu"])):
        ratios.append(b / a)
        print(f"  trial {i}: hand-written {a * 1e3:8.3f} ms | multigpu {b * 1e3:8.3f} ms | ratio {b / a:.3f}")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"ratio multigpu/hand-written: median {statistics.median(ratios):.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)} trials; target <= 1.02)")


if __name__ == "__main__":
    main()
