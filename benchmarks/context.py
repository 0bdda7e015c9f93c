"""Context parallelism on CPU ranks: step time and activation memory per rank against sequence length, cp 1/2/4.

    PYTHONPATH=src python benchmarks/context.py                     # 4 gloo ranks, 1k/2k/4k tokens
    PYTHONPATH=src python benchmarks/context.py --seqs 2048,8192 --json out.json

The same transformers Llama (``--layers`` x ``--width``, 4 heads, 2 KV heads, SDPA, float32; built from a
config, no download) and the same global batch of ``--ranks`` sequences a step, one sequence a micro-batch,
spread over the same ranks with cp 1 (FSDP: each rank whole sequences), cp 2 and cp 4 (each rank a head-tail
share of a sequence, attention between two all-to-alls over heads). So every layout computes the same tokens
a step; what changes is how much of one sequence a rank holds at once. Each (length, cp) is built once,
warmed up, then timed in interleaved rounds (``--steps`` steps each, round-robin), the slowest rank's median
with the interquartile range; tokens/s is the step's tokens over that median. Activations are the peak
bytes autograd saves for the backward in one micro-batch (``mg.meter.LiveActivations``), the largest rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.meter import LiveActivations
from multigpu.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import environment, finish, slowest_rank, time_interleaved, timing_arguments  # noqa: E402 - beside this file


def _build(dist, args, seq: int, cp: int):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=seq, tie_word_embeddings=False,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    layout = mg.parallel.Layout(cp=cp, micro_batch=1)
    model = mg.parallelize(transformers.LlamaForCausalLM(cfg), layout, verbose=False)
    plan = layout.plan(dist.world_size, dist)
    g = torch.Generator().manual_seed(layout.resolve(dist.world_size).dp_rank(dist.rank))
    tokens = torch.randint(0, 256, (plan.accum_steps, seq + 1), generator=g)  # this data-parallel rank's sequences
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, [(t[None, :-1], t[None, 1:]) for t in tokens]


def _step(run) -> None:
    model, opt, micro_batches = run
    for x, y in mg.accumulate(model, micro_batches):
        logits = model(input_ids=x, use_cache=False).logits
        (F.cross_entropy(logits.flatten(0, 1), mg.context_share(model, y).flatten()) / len(micro_batches)).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _bench(dist, args):
    runs = {(seq, cp): _build(dist, args, seq, cp) for seq in args.seqs for cp in args.cps}
    out = time_interleaved({f"{seq} {cp}": run for (seq, cp), run in runs.items()}, _step, warmup=args.warmup,
                           rounds=args.rounds, steps=args.steps)
    for (seq, cp), (model, opt, micro_batches) in runs.items():
        acts = LiveActivations(model.parameters())
        x, y = micro_batches[0]
        with acts.hooks():
            logits = model(input_ids=x, use_cache=False).logits
            F.cross_entropy(logits.flatten(0, 1), mg.context_share(model, y).flatten()).backward()
        opt.zero_grad(set_to_none=False)
        out[f"{seq} {cp}"]["activations"] = acts.peak
        out[f"{seq} {cp}"]["bytes"] = {"total": 0}  # slowest_rank reads it; the state is not this benchmark's
    return out


def table(results: list[dict], args) -> list[str]:
    lines = ["| tokens per sequence | cp | step ms (median) | IQR ms | tokens/s | time / cp 1 | activations MB per rank "
             "| / cp 1 |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seq in args.seqs:
        base = slowest_rank(results, f"{seq} 1")["median"] if 1 in args.cps else None
        base_acts = max(r[f"{seq} 1"]["activations"] for r in results) if 1 in args.cps else None
        for cp in args.cps:
            s = slowest_rank(results, f"{seq} {cp}")
            acts = max(r[f"{seq} {cp}"]["activations"] for r in results)
            lines.append(f"| {seq:,} | {cp} | {s['median'] * 1e3:.0f} | {s['iqr'] * 1e3:.0f} | "
                         f"{args.ranks * seq / s['median']:,.0f} | {s['median'] / base:.2f} | {acts / 2**20:.1f} | "
                         f"{acts / base_acts:.2f} |" if base else "")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seqs", default="1024,2048,4096", help="tokens per sequence, comma-separated")
    p.add_argument("--cps", default="1,2,4", help="cp degrees (each divides --ranks), comma-separated")
    timing_arguments(p, warmup=1, steps=2, rounds=3)
    args = p.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.cps = [int(c) for c in args.cps.split(",")]
    env = environment(args.ranks)
    results = spawn(_bench, args.ranks, args, timeout=3600)
    return finish(env, f"model: Llama {args.layers} layers x {args.width}, 4 heads (2 KV), SDPA, float32, AdamW; "
                       f"{args.ranks} sequences a step, one a micro-batch; n = {args.rounds * args.steps} timed steps "
                       f"per row ({args.rounds} interleaved rounds), slowest rank's median; {args.ranks} gloo ranks",
                  table(results, args), results, args)


if __name__ == "__main__":
    sys.exit(main())
