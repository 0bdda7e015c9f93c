"""Forecast vs measured on this machine's CPU ranks, for a model the cost model was not written around: every layout
`multigpu tune` measured of the transformers Llama in examples/hf_model.py, predicted as tune predicts the GPT
recipe's (forecast's model, this machine described by measurement: tune/machine.py).

    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 1,2,4 examples/hf_model.py --global-batch 16
    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 2,4 gpt --size small --global-batch 16
    PYTHONPATH=src python benchmarks/forecast_hf_cpu.py --tune-json <the first's tune.json> --probe-json <the second's>

What the prediction reads, and from where:
- the model: forecast's count of the script's own config (``model_config``), on fake tensors, float32;
- measured here on the script's own model, as tune's probe measures the GPT's (``tune/probe.py``,
  ``tune/wrappers.py``): one micro-batch's forward and backward per size and the optimizer's step (one
  process, the threads a worker gets, A B A B, median of 7), the fixed costs of each wrapper (DDP, FSDP2,
  TP's DTensors with the plan mg.parallelize takes, FSDP x TP; over a group of one rank), and the script's
  own loop (the script run on one rank with 1 and 3 micro-batches a step);
- the machine: the GPT tune's probe (run on this machine): its links (the cached measurements), its busy-step
  slowdown and collective waits.
``--gpt-fixed`` predicts with the wrappers' costs the GPT tune measured instead (and no loop), as this benchmark did
before the probe could take another model. Memory: the forecast's against each run's real peak, where tune recorded
one (the script's StepMeter takes a warm-up step's when tune asks: ``MULTIGPU_MEMORY_STEP``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("hf_model", ROOT / "examples" / "hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-json", required=True, help="`multigpu tune ... examples/hf_model.py`'s tune.json")
    parser.add_argument("--probe-json", required=True, help="`multigpu tune ... gpt`'s tune.json on this machine")
    parser.add_argument("--global-batch", type=int, default=16, help="the script tune's --global-batch")
    parser.add_argument("--gpt-fixed", action="store_true", help="the wrappers' costs measured on the GPT, no loop")
    args = parser.parse_args()
    report = json.loads(Path(args.tune_json).read_text())
    probe_report = json.loads(Path(args.probe_json).read_text())

    import transformers

    from multigpu import layout_from_args
    from multigpu.forecast.counts import count
    from multigpu.tune import machine, probe, wrappers

    ranks, threads = report["world_size"], report.get("threads_per_worker") or 1
    if probe_report["world_size"] != ranks:
        sys.exit(f"the probe ran on {probe_report['world_size']} ranks, the script's tune on {ranks}: run both on the same")
    rows = [r for r in report["candidates"] if r.get("result")]
    layouts = {r["candidate"]: layout_from_args(r["args"])[0].resolve(ranks) for r in rows}
    config = _example().model_config()
    seq = 64  # the script's windows
    counts = count(lambda: transformers.AutoModelForCausalLM.from_config(config), seq, name="hf_model Llama",
                   dtype=torch.float32)
    micro = sorted({lay.micro_batch for lay in layouts.values()})
    acs = sorted({lay.activation_checkpointing for lay in layouts.values()})
    subject = wrappers.causal_lm(config, seq)
    compute = probe.compute(subject, [(m, ac) for m in micro for ac in acs], threads)
    parts = machine.parts_of(probe_report) | {"compute": compute}
    if args.gpt_fixed:
        parts["fixed"] = parts["wrappers"]
    else:
        with tempfile.TemporaryDirectory() as root:
            loop = probe.loop(str(ROOT / "examples" / "hf_model.py"), [], compute, micro[0], True, threads, root,
                              module=False)
        costs = wrappers.overheads(subject, micro[0], threads, acs=tuple(acs))
        parts["fixed"] = wrappers.plus_loop(costs, loop)
        print("fixed costs measured on this model (ms per micro-batch / per step): loop "
              f"{loop['micro_s'] * 1e3:.1f} / {loop['step_s'] * 1e3:.1f}; "
              + ", ".join(f"{k} {v['micro_s'] * 1e3:.1f} / {v['step_s'] * 1e3:.1f}" for k, v in costs.items()))
    here = machine.measured_cluster(counts, parts, ranks, None)
    print(f"{counts.name}: {counts.params:,} parameters, {counts.flops_per_token / 1e6:.2f} MFLOP per token; {ranks} ranks "
          f"x {threads} thread(s); one process: " + ", ".join(f"micro-batch {m}{' AC' if ac else ''} {v['time_s'] * 1e3:.1f} ms"
                                                            for (m, ac), v in compute.items())
          + f", optimizer {next(iter(compute.values()))['optimizer_s'] * 1e3:.1f} ms; the probe's slowdown {parts['slowdown']:.2f}\n")
    print("| layout | measured ms/step | predicted ms | error | compute + comm + fixed ms | measured MiB | predicted MiB "
          "| error |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    predicted = {r["candidate"]: machine.predict(layouts[r["candidate"]], counts, here, parts, args.global_batch)
                 for r in rows}
    errors, memory_errors = [], []
    for r in sorted(rows, key=lambda r: r["result"]["step_time_s"]):
        got, step = predicted[r["candidate"]], r["result"]["step_time_s"]
        errors.append(got["step_time_s"] / step - 1)
        peak = r["result"].get("memory_bytes")  # the script's StepMeter's warm-up step (MULTIGPU_MEMORY_STEP)
        if peak:
            memory_errors.append(got["memory_bytes"] / peak - 1)
        memory = f"{peak / 2**20:,.2f} | {got['memory_bytes'] / 2**20:,.2f} | {memory_errors[-1]:+.0%}" if peak \
            else "- | - | -"
        print(f"| {r['candidate']} | {step * 1e3:,.1f} | {got['step_time_s'] * 1e3:,.1f} | {errors[-1]:+.0%} | "
              f"{got['compute_s'] * 1e3:,.1f} + {got['comm_s'] * 1e3:,.1f} + {got['overhead_s'] * 1e3:,.1f} | {memory} |")
    for what, errs in (("step time", errors), ("memory", memory_errors)):
        size = [abs(e) for e in errs]
        if size:
            print(f"\n{what} error over {len(size)} layouts: median {statistics.median(size):.0%}, worst {max(size):.0%}, "
                  f"within 15 %: {sum(e <= 0.15 for e in size)}, within 30 %: {sum(e <= 0.30 for e in size)}")
    fast = min(rows, key=lambda r: r["result"]["step_time_s"])["candidate"]
    print(f"fastest measured: {fast}; fastest predicted: {min(predicted, key=lambda c: predicted[c]['step_time_s'])}")

if __name__ == "__main__":
    main()
