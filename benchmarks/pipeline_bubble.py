"""The pipeline bubble, measured per stage, against (p-1)/(m+p-1) for GPipe and 1F1B.

    PYTHONPATH=src python benchmarks/pipeline_bubble.py                 # 2 stages on 2 gloo ranks
    PYTHONPATH=src python benchmarks/pipeline_bubble.py --micro 4,8,16 --rounds 4

A GPT (``--layers`` x ``--width``, untied embeddings) split into 2 stages
runs one optimizer step of m micro-batches per ``pipe.step``. Busy time is the
time a stage spends computing, its ``forward_one_chunk`` and
``backward_one_chunk`` calls, as ``pipe.stage_times()`` reports it (the
numbers the step meter gets); everything else in the step (waiting for the
neighbour's activations or gradients, the transfers themselves) is idle.
Activation memory is the peak of the bytes autograd holds for the backward
during the step (saved tensors other than the weights, counted live: GPipe
holds all m micro-batches' activations, 1F1B at most p). The idle share of the step is compared with
GPipe's bubble (p-1)/(m+p-1) (Huang et al. 2018), which 1F1B shares
(Narayanan et al. 2021; it saves activation memory, not time). Variants are
timed in interleaved rounds; figures are medians over the timed steps, and
memory is each stage's parameters, gradients and AdamW state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.runtime.fingerprint import format_fingerprint
from multigpu.meter.footprint import LiveActivations, state_bytes
from multigpu.recipes.gpt.model import GPT, config
from multigpu.testing import spawn


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _bench(dist, args):
    cfg = config("small", n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.block,
                 tie_embeddings=False)
    variants = {}
    for schedule in args.schedules:
        for m in args.micro:
            torch.manual_seed(0)
            layout = mg.parallel.Layout(pp=dist.world_size, micro_batch=args.micro_batch, schedule=schedule)
            plan = layout.plan(m * args.micro_batch, dist)  # m micro-batches per step
            pipe = mg.parallel.pipeline(GPT(cfg), layout, _loss, plan, verbose=False)
            acts = LiveActivations(pipe.parameters())
            g = torch.Generator().manual_seed(0)
            seq = torch.randint(0, cfg.vocab_size, (m * args.micro_batch, cfg.block_size + 1), generator=g)
            micro_batches = [(x, y) for x, y in zip(seq[:, :-1].chunk(m), seq[:, 1:].chunk(m))]
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
            variants[(schedule, m)] = (pipe, opt, micro_batches, acts, [], [])
    for pipe, opt, micro_batches, acts, _, _ in variants.values():
        for _ in range(args.warmup):
            pipe.step(micro_batches)
            opt.zero_grad(set_to_none=False)
    for _ in range(args.rounds):
        for pipe, opt, micro_batches, acts, walls, idle in variants.values():
            for _ in range(args.steps):
                torch.distributed.barrier()
                pipe.stage_times()  # start the count here
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(acts.pack, acts.unpack):
                    pipe.step(micro_batches)
                wall = time.perf_counter() - t0
                times = pipe.stage_times()
                walls.append(wall)
                idle.append(times["stage/p2p"] / (times["stage/compute"] + times["stage/p2p"]))
                opt.step()
                opt.zero_grad(set_to_none=False)
    return {f"{s} m={m}": {"wall": walls, "idle": idle, "bytes": state_bytes(pipe.modules[0], opt).as_dict()["total"],
                           "activations": acts.peak}
            for (s, m), (pipe, opt, _, acts, walls, idle) in variants.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--micro", default="4,8,16", help="micro-batches per step, comma-separated")
    p.add_argument("--stages", type=int, default=2, help="pipeline ranks (interleaved_1f1b: 2 stages each)")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b, interleaved_1f1b")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    args.micro = [int(v) for v in args.micro.split(",")]
    args.schedules = args.schedules.split(",")
    env = mg.fingerprint(None, world_size=args.stages, backend="gloo", threads_per_rank=1,
                         load_average_1min=round(os.getloadavg()[0], 2))
    results = spawn(_bench, args.stages, args, timeout=3600)
    n = args.rounds * args.steps
    print("environment:", format_fingerprint(env))
    print(f"model: GPT {args.layers} layers x {args.width}, {args.block} tokens, micro-batch {args.micro_batch} sequences; "
          f"{args.stages} stages on {args.stages} gloo ranks; n = {n} timed steps per variant ({args.rounds} interleaved rounds)")
    head = " | ".join(f"stage {s} idle" for s in range(args.stages))
    print(f"| schedule, micro-batches | predicted bubble (p-1)/(m+p-1) | {head} | step ms | stage state MB "
          "| peak activations MB per stage |")
    print("|---|---:|" + "---:|" * args.stages + "---:|---:|---:|")
    p_ = args.stages
    for name in results[0]:
        m = int(name.split("m=")[1])
        idle = " | ".join(f"{statistics.median(r[name]['idle']):.3f}" for r in results)
        wall = max(statistics.median(r[name]["wall"]) for r in results)
        mem = " / ".join(f"{r[name]['bytes'] / 2**20:.1f}" for r in results)
        acts = " / ".join(f"{r[name]['activations'] / 2**20:.1f}" for r in results)
        print(f"| {name} | {(p_ - 1) / (m + p_ - 1):.3f} | {idle} | {wall * 1e3:.0f} | {mem} | {acts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
