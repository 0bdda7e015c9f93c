"""Fault-tolerant training on replica groups (for tests/test_fault_tolerant.py and benchmarks/fault_tolerance.py).

A float64 regression trained with SGD and momentum (optimizer state a healed group must fetch), DDP inside
each group, ``mg.fault_tolerant`` across them::

    multigpu run --cpu -n 2 --fault-tolerant 3 tests/_ft_train.py --out DIR [--steps 40] [--sleep 0.05]

Each worker writes its pid to ``DIR/pids/group<g>.rank<r>`` (a test SIGKILLs them), and each group's rank 0
its final parameters to ``DIR/group<g>.pt``. ``replay`` is the one-process reference: the committed
steps of a record, each on exactly the samples of the groups that took part.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.data.loader import global_order

N, GLOBAL_BATCH, LR, MOMENTUM = 960, 24, 0.05, 0.9


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    y = x @ torch.randn(8, 2, generator=g, dtype=torch.float64) + 0.1 * torch.randn(N, 2, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2)).double()


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)


def replay(steps: list[dict], groups: int) -> dict[str, torch.Tensor]:
    """One process trained on the samples the committed ``steps`` used: group g's share of global batch s."""
    ds, m = data(), model()
    opt, share = optimizer(m), GLOBAL_BATCH // groups
    per_epoch = N // GLOBAL_BATCH
    for rec in sorted(steps, key=lambda r: r["step"]):
        epoch, b = divmod(rec["step"], per_epoch)
        order = global_order(N, 0, epoch)[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]
        idx = torch.cat([order[g * share:(g + 1) * share] for g in rec["groups"]])
        x, y = ds[idx]
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (time for a test to act mid-run)")
    p.add_argument("--sleep-without", type=float, default=None,
                   help="seconds per step while a group is missing (so that a loaded machine restarts it before the end)")
    p.add_argument("--rejoin-delay", type=float, default=0.0,
                   help="seconds a restarted group waits before it rejoins (a replacement takes time; a restart quicker "
                        "than the lighthouse's heartbeat timeout rejoins before the others ever commit without it)")
    p.add_argument("--inner", default="ddp", help="inside each group: mg.wrap's strategy, or tp (mg.parallelize)")
    p.add_argument("--timeout", type=float, default=10.0, help="mg.fault_tolerant's collective timeout")
    p.add_argument("--wider-group", type=int, default=-1, help="this replica group's model is wider (a bad setup)")
    args = p.parse_args()
    with mg.init(seed=0, device="cpu") as dist:
        from multigpu.runtime.contract import replica_group

        wider = (replica_group() or (0,))[0] == args.wider_group
        layout = mg.parallel.Layout(tp=dist.world_size).resolve(dist.world_size) if args.inner == "tp" else None
        net = (mg.parallelize(model(24 if wider else 16), layout, tp_plan={"0": "colwise", "2": "rowwise"})
               if layout is not None else mg.wrap(model(24 if wider else 16), args.inner))
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # a restarted group: not back at once
            time.sleep(args.rejoin_delay)
        replicas = mg.fault_tolerant(net, optimizer(net), dist, timeout=args.timeout)
        os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
        with open(os.path.join(args.out, "pids", f"group{replicas.group}.rank{dist.rank}"), "w") as fp:
            fp.write(str(os.getpid()))
        train = mg.loader(data(), replicas.plan(GLOBAL_BATCH, layout=layout, micro_batch=2), dist, seed=0)
        meter = mg.StepMeter(dist, train.plan, log_every=5, replicas=replicas, watchdog=None,
                             log_dir=os.path.join(args.out, f"meter{replicas.group}"))
        with meter:
            for step, micro_batches in meter.steps(replicas.steps(train, args.steps)):
                for x, y in mg.accumulate(net, micro_batches):
                    loss = nn.functional.mse_loss(net(x), y).div(len(micro_batches))
                    loss.backward()
                missing = replicas.record and len(replicas.record[-1].groups) < replicas.groups
                time.sleep(args.sleep_without if missing and args.sleep_without is not None else args.sleep)
                replicas.optimizer.step()
                replicas.optimizer.zero_grad()
                meter.step_end(loss=loss)
        state = mg.full_state_dict(net)  # collective under FSDP
        if dist.rank == 0:
            torch.save(state, os.path.join(args.out, f"group{replicas.group}.pt"))
        mg.print0(f"group {replicas.group}: {len(replicas.record)} steps committed here, last {replicas.record[-1].step}")


if __name__ == "__main__":
    main()
