"""Forecast vs measured on this machine's CPU ranks, for a model the cost model was not written around: every layout
`multigpu tune` measured of the transformers Llama in examples/hf_model.py, predicted as tune predicts the GPT
recipe's (forecast's model, this machine described by measurement: tune/machine.py).

    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 1,2,4 examples/hf_model.py --global-batch 16
    multigpu tune -n 4 --cpu --top all --repeats 1 --steps 8 --micro-batches 2,4 gpt --size small --global-batch 16
    PYTHONPATH=src python benchmarks/forecast_hf_cpu.py --tune-json <the first's tune.json> --probe-json <the second's>

What the prediction reads, and from where:
- the model: forecast's count of the script's own config (``model_config``), on fake tensors, float32;
- the rate: that count's FLOPs of one micro-batch over its forward and backward timed here, in one process with
  the threads a worker gets, per micro-batch size (A B A B, median of 7), / the busy ranks' slowdown;
- the optimizer: clipping and AdamW's step over the model, timed here;
- the machine: the GPT tune's probe (run on this machine): its links (the cached measurements), its busy-step
  slowdown and collective waits, and the wrappers' fixed costs it measured on the GPT (DDP, FSDP2, DTensor's
  TP: taken as this machine's, though they grow with a model's modules; the Llama's own are not probed). Not
  the GPT recipe's loop (its loader and loss per micro-batch): that is the recipe's, not the script's.
Memory is not compared: a script's tune measures step time only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("hf_model", ROOT / "examples" / "hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(config, micro_batches: list[int], threads: int, seq: int) -> tuple[dict[int, float], float]:
    """(seconds of one micro-batch's forward and backward per size, seconds of clipping and AdamW's step), timed
    as tune's probe times the GPT's (``probe.timed``: A B A B, median of 7)."""
    import torch.nn.functional as F
    import transformers

    from multigpu.tune.probe import timed as interleaved

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    x = torch.randint(0, config.vocab_size, (max(micro_batches), seq + 1))

    def step(m: int) -> None:
        logits = model(input_ids=x[:m, :-1], use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), x[:m, 1:].flatten()).backward()

    return interleaved(model, step, micro_batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-json", required=True, help="`multigpu tune ... examples/hf_model.py`'s tune.json")
    parser.add_argument("--probe-json", required=True, help="`multigpu tune ... gpt`'s tune.json on this machine")
    parser.add_argument("--global-batch", type=int, default=16, help="the script tune's --global-batch")
    args = parser.parse_args()
    report = json.loads(Path(args.tune_json).read_text())
    probe = json.loads(Path(args.probe_json).read_text())

    import transformers

    from multigpu import layout_from_args
    from multigpu.forecast.counts import count
    from multigpu.tune import machine

    ranks, threads = report["world_size"], report.get("threads_per_worker") or 1
    if probe["world_size"] != ranks:
        sys.exit(f"the probe ran on {probe['world_size']} ranks, the script's tune on {ranks}: run both on the same")
    rows = [r for r in report["candidates"] if r.get("result")]
    layouts = {r["candidate"]: layout_from_args(r["args"])[0].resolve(ranks) for r in rows}
    config = _example().model_config()
    seq = 64  # the script's windows
    counts = count(lambda: transformers.AutoModelForCausalLM.from_config(config), seq, name="hf_model Llama",
                   dtype=torch.float32)
    micro = sorted({lay.micro_batch for lay in layouts.values()})
    seconds, optimizer_s = timed(config, micro, threads, seq)
    # The GPT tune's machine (its links, slowdown, waits), this model's compute, the wrappers' costs without the
    # GPT recipe's loop (that is the recipe's, not the script's).
    parts = machine.parts_of(probe) | {
        "compute": {(m, False): {"time_s": t, "optimizer_s": optimizer_s} for m, t in seconds.items()}}
    parts["fixed"] = parts["wrappers"]
    here = machine.measured_cluster(counts, parts, ranks, None)
    print(f"{counts.name}: {counts.params:,} parameters, {counts.flops_per_token / 1e6:.2f} MFLOP per token; {ranks} ranks "
          f"x {threads} thread(s); one process: " + ", ".join(f"micro-batch {m} {s * 1e3:.1f} ms" for m, s in seconds.items())
          + f", optimizer {optimizer_s * 1e3:.1f} ms; the probe's slowdown {parts['slowdown']:.2f}\n")
    print("| layout | measured ms/step | predicted ms | error | compute + comm + fixed ms |")
    print("|---|---:|---:|---:|---|")
    predicted = {r["candidate"]: machine.predict(layouts[r["candidate"]], counts, here, parts, args.global_batch)
                 for r in rows}
    errors = []
    for r in sorted(rows, key=lambda r: r["result"]["step_time_s"]):
        got, step = predicted[r["candidate"]], r["result"]["step_time_s"]
        errors.append(got["step_time_s"] / step - 1)
        print(f"| {r['candidate']} | {step * 1e3:,.1f} | {got['step_time_s'] * 1e3:,.1f} | {errors[-1]:+.0%} | "
              f"{got['compute_s'] * 1e3:,.1f} + {got['comm_s'] * 1e3:,.1f} + {got['overhead_s'] * 1e3:,.1f} |")
    size = [abs(e) for e in errors]
    print(f"\nstep time error over {len(size)} layouts: median {statistics.median(size):.0%}, worst {max(size):.0%}, "
          f"within 15 %: {sum(e <= 0.15 for e in size)}, within 30 %: {sum(e <= 0.30 for e in size)}")
    fast = min(rows, key=lambda r: r["result"]["step_time_s"])["candidate"]
    print(f"fastest measured: {fast}; fastest predicted: {min(predicted, key=lambda c: predicted[c]['step_time_s'])}")

if __name__ == "__main__":
    main()
