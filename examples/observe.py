"""The instruments on an ordinary DDP loop: step meter, stragglers, hang report, profiler.

    multigpu run -n 2 examples/observe.py --log-dir runs/observe          # or torchrun --nproc-per-node 2
    ... --slow-data 1        # rank 1's loader sleeps 30 ms per batch: a data-wait straggler
    ... --slow-compute 1     # rank 1's forward sleeps 30 ms: a compute straggler
    ... --hang 1:40          # rank 1 stops in step 40: the watchdog's hang report
    ... --profile 10:15      # torch.profiler over steps 10..14 and its summary table
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import multigpu as mg


class Synthetic(Dataset):
    """Random features, a learnable label; ``delay`` seconds per sample on a chosen rank."""

    def __init__(self, n: int, delay: float = 0.0):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 128, generator=g)
        self.y = (self.x[:, :4].sum(1) > 0).long()
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))
        self.delay = delay

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return self.body(x)


def stuck_in_step():
    time.sleep(3600)  # stands for a deadlock, a stuck file system, a dead NIC...


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--slow-data", type=int, default=None, metavar="RANK")
    ap.add_argument("--slow-compute", type=int, default=None, metavar="RANK")
    ap.add_argument("--hang", default=None, metavar="RANK:STEP")
    ap.add_argument("--watchdog", type=float, default=300.0, help="seconds without a completed step before a report")
    ap.add_argument("--profile", default=None, metavar="START:STOP")
    a = ap.parse_args()
    hang_rank, hang_step = (int(v) for v in a.hang.split(":")) if a.hang else (None, None)

    with mg.init(seed=0) as dist:
        plan = mg.BatchPlan(global_batch=a.global_batch, world_size=dist.world_size)
        per_sample = 0.03 / plan.rank_batch if a.slow_data == dist.rank else 0.0
        data = Synthetic(a.steps * plan.global_batch, delay=per_sample)
        model = mg.wrap(Net(delay=0.03 if a.slow_compute == dist.rank else 0.0).to(dist.device), "ddp")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        train = mg.loader(data, plan, dist, shuffle=True)
        with mg.StepMeter(dist, plan, log_every=a.log_every, log_dir=a.log_dir, model=model, total_steps=a.steps,
                          sinks=("jsonl", "tensorboard", "csv"), watchdog=a.watchdog, profile=a.profile,
                          fingerprint_extra={"strategy": "ddp"}) as meter:
            for step, micro_batches in meter.steps(train):
                if step == hang_step and dist.rank == hang_rank:
                    stuck_in_step()
                for x, y in mg.accumulate(model, micro_batches):
                    loss = nn.functional.cross_entropy(model(x), y) / plan.accum_steps
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                meter.step_end(loss=loss * plan.accum_steps, lr=opt)


if __name__ == "__main__":
    main()
