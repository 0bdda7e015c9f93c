"""Forecast vs measured on this machine's CPU ranks: every GPT-recipe layout `multigpu tune` measured, predicted by
`multigpu forecast`'s model (src/multigpu/forecast/cost.py) for this machine described as a GPU would be (a
peak, a bus bandwidth, a memory bandwidth), beside tune's prediction of the same runs (the same model, with the
probe's rates per micro-batch, its measured links and overheads: tune/machine.py).

    PYTHONPATH=src python benchmarks/forecast_cpu.py --tune-json studies/tune-.../tune.json

The tune run it reads (its candidates' measured step times and memory, and its probe):

    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 2,4 gpt --size small --global-batch 16

This machine, as forecast's table would describe a GPU, from that run's own probe (nothing measured again):
- the peak: the training FLOPs of one micro-batch (forecast's count of the model) over the probe's time of
  its forward and backward in one process, per micro-batch size tune weighed, / the busy ranks' slowdown;
  efficiency 1 (the peak is the achieved rate); the micro-batch's own rate serves its layouts, with and
  without recompute (the model counts the recomputed forward);
- the links: the probe's all-reduce of 16 MiB on all the ranks, as bus bandwidth (a bandwidth, no latency);
- the memory bandwidth: the probe's clipping and AdamW over the model (forecast charges 36 bytes per parameter);
- no overlap of collectives and compute (on CPU they share the cores), no allocator overhead or runtime.
A second prediction adds the machine's measured overheads (forecast's ``Overheads``, as tune charges them).
Memory is one column: it does not depend on how the machine is described.
"""

from __future__ import annotations

import argparse
import json
import statistics

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-json", required=True, help="a `multigpu tune ... gpt` run's tune.json")
    args = parser.parse_args()
    report = json.loads(open(args.tune_json).read())

    import dataclasses

    from multigpu import layout_from_args
    from multigpu.forecast.cost import Assumptions, Run, predict
    from multigpu.forecast.hardware import Cluster, Gpu
    from multigpu.recipes.gpt.model import config
    from multigpu.tune import machine

    size = report["workload"].split()[-1]
    cfg = config(size)
    ranks, threads = report["world_size"], report["threads_per_worker"] or 1
    rows = [r for r in report["candidates"] if r.get("result")]
    layouts = {r["candidate"]: layout_from_args(r["args"])[0].resolve(ranks) for r in rows}
    counts = machine.count_recipe(cfg)
    parts = machine.parts_of(report)
    slowdown = parts["slowdown"]
    here = machine.measured_cluster(counts, parts, ranks, None)  # tune's description: its rates and bandwidth
    rates = {m: rate for (m, recompute), rate in here.rates.items() if recompute == "none"}
    n, size16 = ranks, 16 * 2**20
    busbw = 2 * (n - 1) / n * size16 / parts["links"].time("all_reduce", n, size16)
    bandwidth = here.gpu.hbm_bandwidth
    a = Assumptions(efficiency=1.0, dp_overlap=0.0, runtime_gib=0.0, allocator_overhead=0.0,
                    calibration="this machine's probe as a spec sheet (benchmarks/forecast_cpu.py)")
    print(f"gpt {size}: {counts.params:,} parameters, {counts.flops_per_token / 1e6:.1f} MFLOP per token; {ranks} "
          f"ranks x {threads} thread(s), slowdown {slowdown:.2f}; per rank: "
          + ", ".join(f"micro-batch {m} {r / 1e9:.2f} GFLOP/s" for m, r in sorted(rates.items()))
          + f"; all-reduce busbw {busbw / 1e9:.2f} GB/s; AdamW {bandwidth / 1e9:.2f} GB/s\n")
    print("| layout | measured ms/step | forecast ms | error | + overheads ms | error | tune's prediction ms | error | "
          "measured MiB | forecast MiB | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errs: dict[str, list[float]] = {"forecast time": [], "forecast + overheads time": [], "tune time": [],
                                    "memory": []}
    for r in sorted(rows, key=lambda r: r["result"]["step_time_s"]):
        lay = layouts[r["candidate"]]
        gpu = Gpu("cpu", "this CPU (measured)", 64 * GiB, bandwidth, rates[lay.micro_batch], None, busbw, busbw)
        run = Run(report["global_batch"], cfg.block_size, "full" if lay.activation_checkpointing else "none")
        got = predict(counts, Cluster(gpu, ranks, ranks), lay, run, a)
        full = predict(counts, Cluster(gpu, ranks, ranks), lay, run, a, machine.overheads(lay, parts))
        measured, mem = r["result"]["step_time_s"], r["result"]["memory_bytes"]
        tune_t = r["predicted"]["step_time_s"]
        e = {"forecast time": got["step_s"] / measured - 1, "forecast + overheads time": full["step_s"] / measured - 1,
             "tune time": tune_t / measured - 1, "memory": got["memory_bytes"] / mem - 1}
        for k, v in e.items():
            errs[k].append(abs(v))
        print(f"| {r['candidate']} | {measured * 1e3:,.0f} | {got['step_s'] * 1e3:,.0f} | {e['forecast time']:+.0%} | "
              f"{full['step_s'] * 1e3:,.0f} | {e['forecast + overheads time']:+.0%} | {tune_t * 1e3:,.0f} | {e['tune time']:+.0%} | {mem / 2**20:,.1f} | {got['memory_bytes'] / 2**20:,.1f} | "
              f"{e['memory']:+.0%} |")
    print()
    for k, v in errs.items():
        print(f"{k} error over {len(v)} layouts: median {statistics.median(v):.0%}, worst {max(v):.0%}, "
              f"within 15 %: {sum(x <= 0.15 for x in v)}, within 30 %: {sum(x <= 0.30 for x in v)}")
    print(f"\nassumptions: {dataclasses.asdict(a)}")


if __name__ == "__main__":
    main()
