"""GPT layouts side by side: step time and per-rank state memory under DDP, FSDP, HSDP, TP and FSDP x TP.

    PYTHONPATH=src python benchmarks/model_parallel.py                 # 4 gloo ranks on CPU
    PYTHONPATH=src python benchmarks/model_parallel.py --rounds 8 --json out.json

Every layout trains the same GPT (``--layers`` x ``--width``, byte vocabulary,
``--block`` tokens) with AdamW on the same global batch of ``--batch``
sequences: the data-parallel ranks split it, tensor-parallel peers share
their rank's part. The layouts are built once, then timed in interleaved
rounds (``--steps`` steps each, round-robin), so a change of load on the
machine hits them all alike. Step time is the slowest rank's median over all
timed steps (with the interquartile range); memory is the per-rank bytes of
parameters, gradients and optimizer state, counted from the tensors each rank
holds (local shards).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.runtime.fingerprint import format_fingerprint
from multigpu.meter.footprint import state_bytes
from multigpu.recipes.gpt.model import GPT, config
from multigpu.recipes.gpt.parallelize import spread
from multigpu.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import environment, slowest_rank, time_interleaved, timing_arguments  # noqa: E402 - beside this file

# name -> mesh degrees (None: plain DDP through mg.wrap), for 4 ranks.
LAYOUTS = {
    "ddp": None,
    "fsdp 4": {},
    "hsdp 2x2": {"dp_replicate": 2},
    "tp 4": {"tp": 4},
    "fsdp 2 x tp 2": {"tp": 2},
    "fsdp 2 x tp 2 + sp": {"tp": 2, "sequence_parallel": True},
}


def _build(dist, args, layout):
    torch.manual_seed(0)
    cfg = config("small", n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.block)
    model = GPT(cfg)
    if layout is None:
        model, dp_size, dp_rank = mg.wrap(model, "ddp"), dist.world_size, dist.rank
    else:
        layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
        model, dp_size, dp_rank = spread(model, layout), layout.dp_size, layout.dp_rank(dist.rank)
    g = torch.Generator().manual_seed(dp_rank)  # tensor-parallel peers read the same sequences
    per_rank = args.batch // dp_size
    seq = torch.randint(0, cfg.vocab_size, (per_rank, cfg.block_size + 1), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, seq[:, :-1], seq[:, 1:]


def _bench(dist, args):
    runs = {name: _build(dist, args, layout) for name, layout in LAYOUTS.items()}

    def step(run):
        model, opt, x, y = run
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated, as in a steady-state loop

    out = time_interleaved(runs, step, warmup=args.warmup, rounds=args.rounds, steps=args.steps)
    for name, (model, opt, _, _) in runs.items():
        out[name]["bytes"] = state_bytes(model, opt).as_dict()
    return out


def table(results: list[dict]) -> list[str]:
    names = list(results[0])
    st = {n: slowest_rank(results, n) for n in names}
    ref = st["ddp"]
    lines = ["| layout | step ms (median) | IQR ms | time / ddp | CPU ms per step | state MB per rank | memory / ddp |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        s = st[n]
        lines.append(f"| {n} | {s['median'] * 1e3:.0f} | {s['iqr'] * 1e3:.0f} | {s['median'] / ref['median']:.2f} | "
                     f"{s['cpu'] * 1e3:.0f} | {s['bytes'] / 2**20:.2f} | {s['bytes'] / ref['bytes']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (divisible by 4)")
    timing_arguments(p)
    args = p.parse_args(argv)
    env = environment(4)
    cfg = config("small", n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.block)
    results = spawn(_bench, 4, args, timeout=3600)
    print("environment:", format_fingerprint(env))
    print(f"model: GPT {args.layers} layers x {args.width} ({cfg.parameters / 1e6:.2f} M parameters), {args.block} "
          f"tokens per sequence, AdamW; global batch {args.batch} sequences; n = {args.rounds * args.steps} timed "
          f"steps per layout ({args.rounds} interleaved rounds), slowest rank's median; 4 gloo ranks")
    print("\n".join(table(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
