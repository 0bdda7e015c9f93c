"""A training script for `multigpu verify`, correct or with one planted bug (--bug).

    none     correct: mg.loader, the same seed everywhere, a per-sample mean loss
    seed     seeds with the rank before building the model (FSDP keeps each rank's own shard)
    sampler  each rank draws global_batch / world samples from the whole set (not its share)
    bn       BatchNorm without sync under DDP
    loss     weighted loss normalized by each rank's own weight total instead of the global one
    handavg  seeds with the rank, no wrapper: gradients averaged by hand, so nothing broadcasts rank 0's start
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import multigpu as mg
from multigpu.runtime.contract import run_dir

p = argparse.ArgumentParser()
p.add_argument("--global-batch", type=int, default=16)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--samples", type=int, default=256, help="the data set's size: one pass of it, then the loader ends")
p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"],
               help="autocast (mg.Precision), reported to the meter as its dtype; fp8: every Linear in float8 "
                    "(16 features in, 16 logits out: float8 matmuls need multiples of 16; the label still reads two)")
p.add_argument("--seed", type=int, default=1, help="the data's seed")
p.add_argument("--bug", default="none", choices=["none", "seed", "sampler", "bn", "loss", "handavg", "all"],
               help="all: every kind in one process, each meter logging into <run dir>/<kind>")
a = p.parse_args()


def train(dist, bug, log_dir=None):
    g = torch.Generator().manual_seed(a.seed)
    width = 16 if a.precision == "fp8" else 8
    x = torch.randn(a.samples, width, generator=g)
    data = TensorDataset(x, (x[:, :2].sum(1) > 0).long(), torch.rand(a.samples, generator=g) + 0.5)
    plan = mg.BatchPlan(a.global_batch, dist.world_size)
    torch.manual_seed(dist.rank if bug in ("seed", "handavg") else 0)
    layers = [nn.Linear(width, 32)] + ([nn.BatchNorm1d(32)] if bug == "bn" else []) + [nn.Tanh(), nn.Linear(32, 16 if a.precision == "fp8" else 2)]
    strategy = "fsdp" if bug == "seed" else "ddp"
    amp = mg.Precision(a.precision, dist.device)
    model = amp.convert(nn.Sequential(*layers), include=[""], verbose=False) if a.precision == "fp8" else nn.Sequential(*layers)
    model = mg.wrap(model, strategy if dist.world_size > 1 and bug != "handavg" else "none")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if bug == "sampler":
        share = DataLoader(data, batch_size=plan.global_batch // dist.world_size,
                           sampler=RandomSampler(data, generator=torch.Generator().manual_seed(0)))
        train_data = ([mb] for mb in share)
    else:
        train_data = mg.loader(data, plan, dist, shuffle=True, seed=0)
    with mg.StepMeter(dist, plan, log_every=2, progress=False, model=model, watchdog=None, log_dir=log_dir,
                      dtype=amp.name) as meter:
        for step, micro_batches in meter.steps(train_data):
            for xb, yb, wb in mg.accumulate(model, micro_batches):
                with amp.autocast():
                    per = nn.functional.cross_entropy(model(xb), yb, reduction="none") * wb
                if bug == "loss":
                    loss = per.sum() / wb.sum()  # this rank's weights only
                else:
                    loss = per.mean()  # equal shares: the mean over ranks is the per-sample mean
                amp.scale(loss / plan.accum_steps).backward()
            if bug == "handavg" and dist.world_size > 1:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= dist.world_size
            amp.step(opt)
            opt.zero_grad()
            meter.step_end(loss=loss)
            if step + 1 == a.steps:
                break


with mg.init(seed=0, device="cpu") as dist:
    if a.bug == "all":
        for kind in ("none", "seed", "sampler", "bn", "loss", "handavg"):
            train(dist, kind, os.path.join(run_dir(), kind))
    else:
        train(dist, a.bug)
