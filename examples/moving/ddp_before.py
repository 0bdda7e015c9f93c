"""Before: a hand-written DDP script for torchrun (init, sampler, per-rank batch, rank-0 printing)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 20, generator=g, dtype=torch.float64)
y = (X[:, :4].sum(1) > 0).long()
model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).double().to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = DistributedSampler(TensorDataset(X, y), shuffle=True, seed=0)
loader = DataLoader(TensorDataset(X, y), batch_size=64, sampler=sampler)  # 64 per rank: the batch grows with world
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, t in loader:
        loss = F.cross_entropy(model(x.to(device)), t.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
if rank == 0:
    print(f"final loss {loss.item():.12f}")
    print(f"checksum {sum(p.double().sum().item() for p in model.parameters()):.15f}")
dist.destroy_process_group()
