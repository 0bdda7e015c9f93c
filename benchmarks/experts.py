"""Expert parallelism against FSDP alone on one mixture of experts: step time, the all-to-all's share, the
routing's imbalance and the state each rank holds.

    PYTHONPATH=src python benchmarks/experts.py                 # 2 gloo ranks on CPU
    PYTHONPATH=src python benchmarks/experts.py --ranks 4 --rounds 6 --json out.json

The same transformers Mixtral (``--layers`` x ``--width``, ``--experts`` experts, 2 per token; built from a
config, no download) and the same global batch of ``--batch`` sequences of ``--block`` tokens, spread three
ways over the same ranks: FSDP over every rank (every rank gathers every expert), EP (each rank holds
experts / ranks of them and the routed tokens travel by all-to-all; dropless), and EP with a capacity factor
of 1.0 (dropped pairs counted). Each is built once, warmed up, then timed in interleaved rounds (``--steps``
steps each, round-robin: A B C A B C) so a change of load hits them all alike. Step time is the slowest
rank's median over all timed steps (with the interquartile range); the all-to-all's share is its seconds
(forward and backward, host clocks: gloo's all-to-all is synchronous) over the timed steps' seconds, per
rank, the largest; the imbalance is the busiest expert's tokens over the mean (its worst layer), over the
timed steps; memory is the parameters, gradients and optimizer state each rank holds between steps
(measured from its tensors), of that the experts' weights, and the expert weights one MoE layer computes
with (from the shapes: FSDP gathers every expert of the layer, EP uses its experts / ep). Between steps
the two hold the same share of the experts; in the step FSDP gathers them all, EP moves tokens instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.meter.footprint import state_bytes
from multigpu.parallel.experts import figures, stats_of
from multigpu.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import environment, finish, slowest_rank, time_interleaved, timing_arguments  # noqa: E402 - beside this file

VARIANTS = {"fsdp": ({}, None), "ep": ({"ep": None}, None), "ep, capacity 1.0": ({"ep": None}, 1.0)}


def _build(dist, args, degrees: dict, capacity):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.block, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    layout = mg.parallel.Layout(**{k: (dist.world_size if v is None else v) for k, v in degrees.items()})
    model = mg.parallelize(model, layout, capacity_factor=capacity, verbose=False)
    g = torch.Generator().manual_seed(dist.rank)
    seq = torch.randint(0, 256, (args.batch // dist.world_size, args.block + 1), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, seq[:, :-1], seq[:, 1:]


def _expert_bytes(model) -> tuple[int, int]:
    """(expert weights this rank holds between steps, expert weights one layer computes with: all of them
    under FSDP, which gathers them, experts / ep under EP), from the parameters' shapes."""
    from torch.distributed.tensor import DTensor

    from multigpu.parallel.experts import expert_modules

    params = [p for n, p in model.named_parameters() if ".experts." in n]
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
    layer = expert_modules(model)[0][1]
    ep = torch.distributed.get_world_size() if stats_of([model]) else 1
    return held, sum(p.numel() * p.element_size() for p in layer.parameters()) // ep


def _bench(dist, args):
    runs = {name: _build(dist, args, degrees, capacity) for name, (degrees, capacity) in VARIANTS.items()}

    def step(run):
        model, opt, x, y = run
        F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated, as in a steady-state loop

    for run in runs.values():
        for _ in range(args.warmup):
            step(run)
        figures(stats_of([run[0]]))  # the warm-up's dispatch left out
    out = time_interleaved(runs, step, warmup=0, rounds=args.rounds, steps=args.steps)
    for name, (model, opt, _, _) in runs.items():
        out[name]["bytes"] = state_bytes(model, opt).as_dict()
        out[name]["expert_bytes"], out[name]["expert_layer_bytes"] = _expert_bytes(model)
        taken = figures(stats_of([model]))
        if taken is not None:
            out[name]["a2a_share"] = taken["a2a_s"] / sum(out[name]["times"])
            out[name]["imbalance"], out[name]["dropped"] = taken["imbalance"], taken["dropped"]
            out[name]["pairs"] = sum(taken["tokens"])
    return out


def table(results: list[dict]) -> list[str]:
    names = list(results[0])
    st = {n: slowest_rank(results, n) for n in names}
    ref = st["fsdp"]
    lines = ["| layout | step ms (median) | IQR ms | time / fsdp | all-to-all share | imbalance | pairs dropped | "
             "state MB per rank | experts held MB per rank | experts a layer computes with, MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        s, r0 = st[n], results[0][n]
        a2a = max(r.get("a2a_share", 0.0) for r in (res[n] for res in results))
        extra = (f"{100 * a2a:.1f} % | {r0['imbalance']:.2f} | {r0['dropped']:,.0f} of {r0['pairs']:,.0f}"
                 if "imbalance" in r0 else "- | - | -")
        lines.append(f"| {n} | {s['median'] * 1e3:.0f} | {s['iqr'] * 1e3:.0f} | {s['median'] / ref['median']:.2f} | "
                     f"{extra} | {s['bytes'] / 2**20:.2f} | {max(r[n]['expert_bytes'] for r in results) / 2**20:.2f} | "
                     f"{results[0][n]['expert_layer_bytes'] / 2**20:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--block", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (divisible by --ranks)")
    timing_arguments(p)
    args = p.parse_args(argv)
    env = environment(args.ranks)
    results = spawn(_bench, args.ranks, args, timeout=3600)
    return finish(env, f"model: Mixtral {args.layers} layers x {args.width}, {args.experts} experts (2 per token), "
                       f"{args.block} tokens per sequence, float32, AdamW; global batch {args.batch} sequences; n = "
                       f"{args.rounds * args.steps} timed steps per layout ({args.rounds} interleaved rounds), slowest "
                       f"rank's median; {args.ranks} gloo ranks", table(results), results, args)


if __name__ == "__main__":
    sys.exit(main())
