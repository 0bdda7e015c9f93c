"""Strategy comparison: step time and per-rank state memory, side by side in one run.

    PYTHONPATH=src python benchmarks/strategies.py            # 2 gloo ranks on CPU
    PYTHONPATH=src python benchmarks/strategies.py --world-size 4 --width 1024

Every strategy trains the same MLP (``--depth`` residual blocks of
``--width``) with AdamW on the same per-rank batch. The strategies are built
once and then timed in interleaved rounds (a few steps each, round-robin), so
a load change on the machine hits them all alike. Step time is the slowest
rank's median over all timed steps (with the interquartile range); CPU time
per step (the rank process's, gloo's threads included) is the work a step
costs, and stays meaningful when the machine is shared; memory is
the per-rank bytes of parameters, gradients and optimizer state
(multigpu.meter.footprint.state_bytes, local shards for FSDP). "none" trains the
replicas without any gradient exchange: the compute-only floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

import multigpu as mg
from multigpu.parallel.comm_hooks import compression
from multigpu.meter.footprint import state_bytes
from multigpu.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import environment, slowest_rank, time_interleaved, timing_arguments  # noqa: E402 - beside this file

STRATEGIES = [
    ("none", "none", {}),
    ("ddp", "ddp", {}),
    ("fsdp", "fsdp", {}),  # block_classes=[Block] is filled in below
    ("zero1", "zero1", {}),
    ("ddp+fp16", "ddp", {"comm_hook": "fp16"}),
    ("ddp+bf16", "ddp", {"comm_hook": "bf16"}),
    ("ddp+powersgd", "ddp", {"comm_hook": "powersgd", "powersgd_rank": 4, "powersgd_start_iter": 2}),
]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 10))


def _bench(dist, args):
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(dist.rank))
    y = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(dist.rank))
    runs = {}
    for name, strategy, options in STRATEGIES:
        if strategy == "fsdp":
            options = {"block_classes": [Block]}
        model = mg.wrap(make_model(args.width, args.depth).to(dist.device), strategy, **options)
        runs[name] = (model, mg.optimizer(model, torch.optim.AdamW, lr=1e-4))

    def step(run):
        model, opt = run
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated, as in a steady-state loop

    out = time_interleaved(runs, step, warmup=args.warmup, rounds=args.rounds, steps=args.steps)
    for name, (model, opt) in runs.items():
        c = compression(model)
        out[name] |= {"bytes": state_bytes(model, opt).as_dict(), "compression": None if c is None else round(c.ratio, 2)}
    return out


def table(results: list[dict], params: int) -> list[str]:
    names = list(results[0])
    st = {n: slowest_rank(results, n) for n in names}
    ref = st["ddp"]
    lines = [
        "| strategy | step ms (median) | IQR ms | time / ddp | CPU ms per step | CPU / ddp "
        "| state MB per rank | memory / ddp | grad compression |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        s, comp = st[n], results[0][n]["compression"]
        lines.append(
            f"| {n} | {s['median'] * 1e3:.1f} | {s['iqr'] * 1e3:.1f} | {s['median'] / ref['median']:.2f} | "
            f"{s['cpu'] * 1e3:.1f} | {s['cpu'] / ref['cpu']:.2f} | "
            f"{s['bytes'] / 2**20:.2f} | {s['bytes'] / ref['bytes']:.2f} | {'-' if comp is None else f'{comp}x'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    timing_arguments(p, warmup=5, steps=5, rounds=6)
    args = p.parse_args(argv)
    env = environment(args.world_size)
    params = sum(q.numel() for q in make_model(args.width, args.depth).parameters())
    results = spawn(_bench, args.world_size, args, timeout=1800)
    print("environment:", json.dumps(env))
    print(f"model: {args.depth} blocks x width {args.width} = {params / 1e6:.2f} M params, AdamW; "
          f"per-rank batch {args.batch}; n = {args.rounds * args.steps} timed steps per strategy "
          f"({args.rounds} interleaved rounds), slowest rank's median")
    print("\n".join(table(results, params)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
