"""What two CPU workers can gain on this machine, with no framework in the way: the ceiling for the demo's GPT step.

`make demo`'s compute-bound study (gpt-ddp) asks whether 2 one-thread workers
train the tiny GPT twice as fast as one. This benchmark separates what the
hardware allows from what data parallelism costs, with the same step (GPT
tiny, micro-batches of 64 sequences, AdamW, one thread per process):

- ``alone``: one process, ``2 * accum`` micro-batches per step (the study's 1 worker);
- ``pair``: two independent processes at once, ``accum`` micro-batches each, no
  communication at all: the ceiling of any data-parallel scheme on these cores.
  From their per-step times: what lockstep alone would cost them (each step
  as long as the slower process's, sum of maxima over sum of means);
- ``sync``: two gloo ranks, ``accum`` micro-batches each, then a timed barrier
  (the wait for the slower rank), a timed all-reduce of the flat gradient and
  the step: data parallelism's costs, each measured.

The variants run in interleaved rounds (alone, pair, sync, then rotated).
Every child builds and warms up, then all start on one signal; a variant's
rate is all its samples over the wall time from that signal to the last
child's end (CLOCK_MONOTONIC is one clock for every process). Ratios are per
round against that round's ``alone``; the interval is Student's t on the log
ratios, as the study computes its speedup.

    python benchmarks/scaling_ceiling.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from multigpu.recipes.gpt.model import GPT, config

    torch.set_num_threads(1)
    if args.rank is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    torch.manual_seed(0)
    cfg = config("tiny")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size))
    timed = {"wait": 0.0, "allreduce": 0.0, "steps": []}

    def step(record: bool) -> None:
        for _ in range(args.accum):
            logits = model(x)
            F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        if args.rank is not None:
            t0 = time.perf_counter()
            dist.barrier()
            t1 = time.perf_counter()
            flat = torch.cat([p.grad.view(-1) for p in model.parameters()])
            dist.all_reduce(flat)
            for p, g in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
                p.grad.copy_(g.view_as(p) / 2)
            if record:
                timed["wait"] += t1 - t0
                timed["allreduce"] += time.perf_counter() - t1
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(2):
        step(False)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's go
    start = time.monotonic()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(True)
        timed["steps"].append(time.perf_counter() - t0)
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "samples": args.steps * args.accum * args.micro_batch, **timed}),
          flush=True)
    if args.rank is not None:
        dist.destroy_process_group()


def launch(variant: str, args: argparse.Namespace) -> dict:
    from multigpu.testing import free_port

    base = [sys.executable, __file__, "--child", "--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]
    if variant == "alone":
        cmds = [base + ["--accum", str(2 * args.accum)]]
    else:
        port = free_port()
        cmds = [base + ["--accum", str(args.accum)] + (["--rank", str(r), "--port", str(port)] if variant == "sync" else [])
                for r in range(2)]
    procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for c in cmds]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"scaling_ceiling: a {variant} child did not start (exit {p.wait()})")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    got = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait(timeout=60)
    wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    out = {"rate": sum(g["samples"] for g in got) / wall, "wall_s": wall,
           "per_process": [g["samples"] / (g["end"] - g["start"]) for g in got]}
    if variant == "pair":  # had the two stepped in lockstep, each step would last as long as the slower one's
        pairs = list(zip(got[0]["steps"], got[1]["steps"]))
        out["lockstep_cost"] = sum(max(p) for p in pairs) / sum(statistics.fmean(p) for p in pairs) - 1
    if variant == "sync":
        out["wait_frac"] = statistics.fmean(g["wait"] for g in got) / wall
        out["allreduce_frac"] = statistics.fmean(g["allreduce"] for g in got) / wall
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="measured steps per child (after 2 warm-up steps)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step per process of a pair (alone: twice)")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if min(args.rounds, args.steps, args.accum, args.micro_batch) < 1:
        p.error("--rounds, --steps, --accum and --micro-batch must be >= 1")
    from multigpu.runtime.fingerprint import fingerprint

    print(json.dumps(fingerprint(benchmark="scaling_ceiling", threads_per_process=1)))
    variants = ["alone", "pair", "sync"]
    rows = []
    for k in range(args.rounds):
        order = variants[k % 3:] + variants[:k % 3]
        row = {v: launch(v, args) for v in order}
        rows.append(row)
        print(f"round {k}: " + ", ".join(
            f"{v} {row[v]['rate']:.0f} samples/s" + (f" (x{row[v]['rate'] / row['alone']['rate']:.2f})" if v != "alone" else "")
            for v in variants) + f"; lockstep would cost the pair {100 * row['pair']['lockstep_cost']:.1f} %; sync waits {100 * row['sync']['wait_frac']:.1f} % for the slower rank, "
            f"all-reduce {100 * row['sync']['allreduce_frac']:.1f} %", flush=True)
    from multigpu.study.measure import ratio_interval

    for v in ("pair", "sync"):
        mean, low, high = ratio_interval([r[v]["rate"] / r["alone"]["rate"] for r in rows])
        spread = f"95 % interval {low:.2f}-{high:.2f}x, " if low is not None else ""
        print(f"{v} / alone: {mean:.2f}x ({spread}{len(rows)} round{'s' if len(rows) > 1 else ''})")
    alone = [r["alone"]["rate"] for r in rows]
    each = [x for r in rows for x in r["pair"]["per_process"]]
    print(f"one process alone: {min(alone):.0f}-{max(alone):.0f} samples/s; each process of a pair: "
          f"{min(each):.0f}-{max(each):.0f}")
    costs = [100 * r["pair"]["lockstep_cost"] for r in rows]
    print(f"pair: each step's time varies independently per core; stepping in lockstep (each step as long as the "
          f"slower process's) would cost {min(costs):.1f}-{max(costs):.1f} %")
    waits = [100 * r["sync"]["wait_frac"] for r in rows]
    print(f"sync: waiting for the slower rank {min(waits):.1f}-{max(waits):.1f} % of the time; all-reduce "
          f"{statistics.fmean(100 * r['sync']['allreduce_frac'] for r in rows):.1f} %")


if __name__ == "__main__":
    main()
