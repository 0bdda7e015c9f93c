"""After: both scripts above moved to multigpu. One process (`python after.py`), torchrun or
`multigpu run -n N after.py`: the same global batch of 64 and the same samples in every step on any N."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

with mg.init(seed=0) as dist:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(1024, 20, generator=g, dtype=torch.float64)
    y = (X[:, :4].sum(1) > 0).long()
    plan = mg.BatchPlan(global_batch=64, world_size=dist.world_size)
    model = mg.wrap(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).double().to(dist.device), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = mg.loader(TensorDataset(X, y), plan, dist, seed=0)   # this rank's share of each global batch
    for epoch in range(3):                                         # reshuffled every epoch, as the sampler did
        for micro_batches in train:
            total = 0.0
            for x, t in mg.accumulate(model, micro_batches):
                loss = F.cross_entropy(model(x), t) / plan.accum_steps
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
    mg.print0(f"final loss {mg.all_reduce_sum(total) / plan.world_size:.12f}")
    mg.print0(f"checksum {sum(p.double().sum().item() for p in mg.unwrap(model).parameters()):.15f}")
