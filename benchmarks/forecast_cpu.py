"""Forecast vs measured on this machine's CPU ranks: every GPT-recipe layout `multigpu tune` measured, predicted by
`multigpu forecast`'s model (src/multigpu/forecast/cost.py) for this machine described as a GPU would be (a
peak, a bus bandwidth, a memory bandwidth), beside tune's prediction of the same runs (the same model, with the
probe's rates per micro-batch, its measured links and overheads: tune/machine.py).

    PYTHONPATH=src python benchmarks/forecast_cpu.py --tune-json studies/tune-.../tune.json

The tune run it reads (its candidates' measured step times and memory, its global batch, ranks and threads):

    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 2,4 gpt --size small --global-batch 16

This machine, as forecast's table would describe a GPU, measured here with the threads a worker gets (run it
on a quiet machine):
- the peak: the training FLOPs of one micro-batch (forecast's count of the model) over the time of its
  forward and backward in one process, at each micro-batch size tune weighed (A B A B, median of 7), then
  x cores / (ranks x threads): the ranks share the cores (tune's own rule). Efficiency 1 (the peak is the
  achieved rate); the micro-batch's own rate is used for its layouts;
- the links: gloo's all-reduce of 16 MiB on all the ranks, as bus bandwidth (median of 5);
- the memory bandwidth: AdamW's step over the model (forecast charges 36 bytes per parameter);
- no overlap of collectives and compute (on CPU they share the cores), no allocator overhead or runtime.
A third prediction adds the machine's measured overheads (forecast's ``Overheads``), read from the tune
run's own probe: each wrapper's work per micro-batch and per step (x the probe's busy-step slowdown, as tune
charges them) and each collective's wait in a busy step among n ranks (less a 1 KiB all-reduce's transfer).
Memory compared: the recipe's count of its training state and peak saved activations (what tune measures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

GiB = 2**30


def compute_rate(cfg, counts, micro_batches: list[int], threads: int, rounds: int = 7) -> dict[int, float]:
    """FLOP/s of one micro-batch's forward and backward in this process, per micro-batch size."""
    import torch.nn.functional as F

    from multigpu.recipes.gpt.model import GPT

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (max(micro_batches), cfg.block_size + 1))
    times: dict[int, list[float]] = {m: [] for m in micro_batches}

    def step(m: int) -> None:
        loss = F.cross_entropy(model(x[:m, :-1]).flatten(0, 1), x[:m, 1:].flatten())
        loss.backward()

    for m in micro_batches:
        step(m)  # warm-up
    for _ in range(rounds):
        for m in micro_batches:
            t0 = time.perf_counter()
            step(m)
            times[m].append(time.perf_counter() - t0)
    return {m: counts.flops_per_token * m * cfg.block_size / statistics.median(times[m]) for m in micro_batches}


def optimizer_bandwidth(cfg, threads: int, rounds: int = 7) -> float:
    from multigpu.recipes.gpt.model import GPT

    torch.set_num_threads(threads)
    model = GPT(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 36.0 * sum(p.numel() for p in model.parameters()) / statistics.median(times)


def _busbw(dist, size: int) -> float:
    x = torch.ones(size // 4)
    torch.distributed.all_reduce(x)  # warm-up
    times = []
    for _ in range(5):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        torch.distributed.all_reduce(x)
        times.append(time.perf_counter() - t0)
    n = dist.world_size
    return 2 * (n - 1) / n * size / statistics.median(times)


def overheads_of(report: dict, layout) -> "Overheads":
    """The measured overheads tune's probe recorded, for ``layout`` (its wrapper family, with or without AC)."""
    from multigpu.forecast.cost import Overheads
    from multigpu.tune.machine import family
    from multigpu.tune.probe import links

    probe = report["probe"]
    busy = probe["busy"]
    sizes = {int(n) for n in busy["wait_s"]}
    measured, _ = links(sizes, "cpu", report["threads_per_worker"] or 1, say=lambda _: None)  # the cached points
    fixed = probe["fixed"][family(layout) + ("+ac" if layout.activation_checkpointing else "")]
    waits = {int(n): max(0.0, w - measured.time("all_reduce", int(n), 1024)) for n, w in busy["wait_s"].items()}
    return Overheads(fixed["micro_s"] * busy["slowdown"], fixed["step_s"] * busy["slowdown"], waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-json", required=True, help="a `multigpu tune ... gpt` run's tune.json")
    args = parser.parse_args()
    report = json.loads(open(args.tune_json).read())

    import dataclasses

    from multigpu import layout_from_args
    from multigpu.forecast.cost import Assumptions, Run, predict
    from multigpu.forecast.counts import count
    from multigpu.forecast.hardware import Cluster, Gpu
    from multigpu.recipes.gpt.model import GPT, config
    from multigpu.recipes.gpt.train import parse_args
    from multigpu.testing import spawn

    size = report["workload"].split()[-1]
    recipe = parse_args(["--size", size, "--global-batch", str(report["global_batch"])])
    cfg = config(recipe.size)
    ranks, threads, cores = report["world_size"], report["threads_per_worker"] or 1, os.cpu_count() or 1
    rows = [r for r in report["candidates"] if r.get("result")]
    layouts = {r["candidate"]: layout_from_args(r["args"])[0].resolve(ranks) for r in rows}
    micro = sorted({lay.micro_batch for lay in layouts.values()})
    share = cores / max(cores, ranks * threads)
    counts = count(lambda: GPT(cfg), cfg.block_size, dtype=torch.float32)
    rates = {m: r * share for m, r in compute_rate(cfg, counts, micro, threads).items()}
    busbw = statistics.median(spawn(_busbw, ranks, 16 * 2**20))
    bandwidth = optimizer_bandwidth(cfg, threads) * share
    a = Assumptions(efficiency=1.0, dp_overlap=0.0, runtime_gib=0.0, allocator_overhead=0.0,
                    calibration="measured on this machine (benchmarks/forecast_cpu.py)")
    print(f"gpt {size}: {counts.params:,} parameters, {counts.flops_per_token / 1e6:.1f} MFLOP per token; {ranks} "
          f"ranks x {threads} thread(s) on {cores} cores; per rank: "
          + ", ".join(f"micro-batch {m} {r / 1e9:.2f} GFLOP/s" for m, r in rates.items())
          + f"; all-reduce busbw {busbw / 1e9:.2f} GB/s; AdamW {bandwidth / 1e9:.2f} GB/s\n")
    print("| layout | measured ms/step | forecast ms | error | + overheads ms | error | tune's prediction ms | error | "
          "measured MiB | forecast MiB | error | tune's MiB | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errs: dict[str, list[float]] = {"forecast time": [], "forecast + overheads time": [], "tune time": [],
                                    "forecast memory": [], "tune memory": []}
    for r in sorted(rows, key=lambda r: r["result"]["step_time_s"]):
        lay = layouts[r["candidate"]]
        gpu = Gpu("cpu", "this CPU (measured)", 64 * GiB, bandwidth, rates[lay.micro_batch], None, busbw, busbw)
        run = Run(report["global_batch"], cfg.block_size, "full" if lay.activation_checkpointing else "none")
        got = predict(counts, Cluster(gpu, ranks, ranks), lay, run, a)
        full = predict(counts, Cluster(gpu, ranks, ranks), lay, run, a, overheads_of(report, lay))
        measured, mem = r["result"]["step_time_s"], r["result"]["memory_bytes"]
        tune_t, tune_m = r["predicted"]["step_time_s"], r["predicted"]["memory_bytes"]
        e = {"forecast time": got["step_s"] / measured - 1, "forecast + overheads time": full["step_s"] / measured - 1,
             "tune time": tune_t / measured - 1,
             "forecast memory": got["memory_bytes"] / mem - 1, "tune memory": tune_m / mem - 1}
        for k, v in e.items():
            errs[k].append(abs(v))
        print(f"| {r['candidate']} | {measured * 1e3:,.0f} | {got['step_s'] * 1e3:,.0f} | {e['forecast time']:+.0%} | "
              f"{full['step_s'] * 1e3:,.0f} | {e['forecast + overheads time']:+.0%} | {tune_t * 1e3:,.0f} | {e['tune time']:+.0%} | {mem / 2**20:,.1f} | {got['memory_bytes'] / 2**20:,.1f} | "
              f"{e['forecast memory']:+.0%} | {tune_m / 2**20:,.1f} | {e['tune memory']:+.0%} |")
    print()
    for k, v in errs.items():
        print(f"{k} error over {len(v)} layouts: median {statistics.median(v):.0%}, worst {max(v):.0%}, "
              f"within 15 %: {sum(x <= 0.15 for x in v)}, within 30 %: {sum(x <= 0.30 for x in v)}")
    print(f"\nassumptions: {dataclasses.asdict(a)}")


if __name__ == "__main__":
    main()
