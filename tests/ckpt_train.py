"""A small training script with a Checkpointer, for the checkpoint tests.

Run by tests/test_checkpoint.py in-process (reference) and under torchrun
with elastic restarts; ``--kill-rank R --kill-step K`` SIGKILLs rank R at
step K on the first attempt only, as a crashing node would.
"""

from __future__ import annotations

import argparse
import os
import random
import signal

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

N, GLOBAL_BATCH, MICRO = 96, 16, 4


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 10, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def net(dropout: float = 0.0, hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 2))


def steps_of(train, start: int, total: int):
    """(step, micro_batches) from ``start`` to ``total`` across epochs."""
    step = start
    while step < total:
        for micro_batches in train:
            yield step, micro_batches
            step += 1
            if step >= total:
                return


def train(dist, directory=None, steps=10, every=2, keep=None, dropout=0.0, stop=None, noise=True,
          kill_rank=None, kill_step=None, hidden=32, strategy="ddp", zero=False, async_save=False):
    """Train; returns (params, ckpt or None). ``stop`` ends the run after that step, as a crash would."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = mg.wrap(net(dropout, hidden).to(dist.device), strategy)
    if zero:  # ZeRO-1: DDP plus a sharded optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size, micro_batch=MICRO)
    loader = mg.loader(data(), plan, dist, seed=0)
    ckpt = None
    start = 0
    if directory is not None:
        ckpt = mg.Checkpointer(directory, every=every, keep=keep, model=model, optimizer=opt, scheduler=sched,
                               scaler=mg.Precision("fp32"), loader=loader, last_loss=None, async_save=async_save)
        start = ckpt.resume()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step, micro_batches in steps_of(loader, start, steps):
        for x, y in mg.accumulate(model, micro_batches):
            if noise:  # python and numpy RNG draws, so their states matter for an exact resume
                x = x + 0.01 * random.random() + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype("float32"))
            loss = nn.functional.cross_entropy(model(x), y) / plan.accum_steps
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ckpt is not None:
            ckpt.extra["last_loss"] = loss.item()
            ckpt.save(step)
        if kill_step == step and dist.rank == kill_rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop == step:
            break
    return [p.detach().clone() for p in mg.unwrap(model).parameters()], ckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--kill-rank", type=int)
    ap.add_argument("--kill-step", type=int)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    with mg.init(seed=0, device="cpu") as dist:
        params, _ = train(dist, args.dir, steps=args.steps, every=args.every, dropout=args.dropout,
                          kill_rank=args.kill_rank, kill_step=args.kill_step)
        if dist.is_main:
            torch.save(params, args.out)


if __name__ == "__main__":
    main()
