"""An ordinary DDP script, as people write it, that ``multigpu verify`` checks: a conv net on generated
images, torch's own DistributedSampler and DDP, AdamW.

    multigpu verify --cpu --workers 1,2 examples/verify_convnet.py       # SAME (exit 0)
    multigpu verify --cpu examples/verify_convnet.py --sync-batchnorm    # SAME, BatchNorm synced
    multigpu verify --cpu --global-batch 64 examples/verify_convnet.py --batchnorm --optimizer sgd
                                        # DIFFERENT (exit 1): BatchNorm without sync, far above the floor
    python examples/verify_convnet.py --steps 20                         # one process

The study contract: ``--global-batch``, ``--steps`` and a ``mg.StepMeter`` (model= lets verify compare
the parameters).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import multigpu as mg

p = argparse.ArgumentParser()
p.add_argument("--global-batch", type=int, default=32)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
p.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer (unsynced unless --sync-batchnorm)")
p.add_argument("--sync-batchnorm", action="store_true")
p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
               help="autocast (mg.Precision); the meter's dtype tells verify which tolerance applies")
a = p.parse_args()


def images(n: int = 512) -> TensorDataset:
    """Noisy 16x16 images of one of 4 oriented gratings; the label is the orientation."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    i, j = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    angle = y[:, None, None] * torch.pi / 4
    x = torch.sin(0.8 * (i * torch.cos(angle) + j * torch.sin(angle))) + 0.5 * torch.randn(n, 16, 16, generator=g)
    return TensorDataset(x[:, None], y)


def net() -> nn.Module:
    norm = [nn.BatchNorm2d(16)] if a.batchnorm or a.sync_batchnorm else []
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), *norm, nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 4))


with mg.init(seed=a.seed, device="cpu") as dist:
    plan = mg.BatchPlan(a.global_batch, dist.world_size)
    model = net()
    if dist.world_size > 1:
        if a.sync_batchnorm:
            model = mg.wrap(model, "ddp", sync_batchnorm=True)   # GlooSyncBatchNorm on CPU
        else:
            model = DistributedDataParallel(model)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if a.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    data = images()
    sampler = DistributedSampler(data, num_replicas=dist.world_size, rank=dist.rank, shuffle=True, seed=a.seed) \
        if tdist.is_initialized() else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=a.seed)
    loader = DataLoader(data, batch_size=plan.global_batch // dist.world_size, sampler=sampler, drop_last=True)
    amp = mg.Precision(a.precision, dist.device)
    with mg.StepMeter(dist, plan, log_every=1, progress=False, model=model, watchdog=None, dtype=amp.name) as meter:
        for step, (x, y) in meter.steps(iter(loader)):
            with amp.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            amp.scale(loss).backward()
            amp.step(opt)
            opt.zero_grad(set_to_none=True)
            meter.step_end(loss=loss)
            if step + 1 == a.steps:
                break
