"""The achieved fraction of peak of one transformer block, by shape: what `multigpu forecast` takes as one number
per GPU kind (the calibration's efficiency) measured block by block, for the per-shape efficiency issue 55 asks for.

For each model (a `multigpu forecast` preset), tensor-parallel cut and micro-batch: the model's first decoder block
as one TP rank holds it (heads, key/value heads and the MLP's width divided by tp; the hidden size whole; the
collectives left out), its forward and backward on a micro-batch of `--seq-len` tokens, in bf16 on CUDA (fp32 on
CPU). FLOPs are the forecast's own counter's (`meter.flops.flop_counter`, attention counted whole as PyTorch's formula
counts it); the rate is total FLOPs / total time over the measured rounds, the variants interleaved (A B C A B C)
after a warm-up; the spread is the rounds' range. The fraction is of the device's dense bf16 peak (`--peak-tflops`,
else the forecast's table for the CUDA device's name; none on CPU: FLOP/s only).

    python benchmarks/block_efficiency.py                         # on the GPU: the presets below, tp 1 and 8
    python benchmarks/block_efficiency.py --device cpu --models llama3-8b --tp 32 --seq-len 256 --rounds 2

Prints a table and, with --json PATH, writes every figure with the environment.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from multigpu.forecast.models import presets  # noqa: E402
from multigpu.meter.flops import flop_counter  # noqa: E402

CUT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")  # what one tp rank holds 1/tp of


def block(name: str, tp: int, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, object, dict]:
    """The preset's first decoder block as one of ``tp`` tensor-parallel ranks holds it, and the rotary embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(presets()[name])
    kind = fields.pop("model_type")
    if tp > 1:
        if any(k not in fields or fields[k] % tp for k in CUT):
            raise SystemExit(f"{name}: tp {tp} does not divide its heads, key/value heads and MLP width")
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        fields.update({k: fields[k] // tp for k in CUT})
    fields["num_hidden_layers"] = 1
    cfg = AutoConfig.for_model(kind, **fields)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    inner = model.model
    return inner.layers[0], inner.rotary_emb, {"hidden": cfg.hidden_size, **{k: getattr(cfg, k) for k in CUT}}


def step(layer, rotary, x: torch.Tensor) -> None:
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    out = layer(x, position_embeddings=rotary(x, positions), position_ids=positions)
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()


def measure(args) -> list[dict]:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    variants = []
    for name in args.models.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            for mb in (int(b) for b in args.micro_batches.split(",")):
                layer, rotary, shape = block(name, tp, dtype, device)
                x = torch.randn(mb, args.seq_len, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
                with flop_counter() as counter:
                    step(layer, rotary, x)
                variants.append({"model": name, "tp": tp, "micro_batch": mb, "tokens": mb * args.seq_len, **shape,
                                 "flops": counter.get_total_flops(), "_run": (layer, rotary, x), "times": []})
    for v in variants:  # warm-up: kernels chosen, caches filled
        for _ in range(args.warmup):
            step(*v["_run"])
    sync()
    for _ in range(args.rounds):  # interleaved: A B C A B C
        for v in variants:
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                step(*v["_run"])
            sync()
            v["times"].append((time.perf_counter() - start) / args.iters)
    for v in variants:
        del v["_run"]
        rates = [v["flops"] / t for t in v["times"]]
        v["flop_s"] = v["flops"] * len(v["times"]) / sum(v["times"])  # total work / total time
        v["flop_s_range"] = [min(rates), max(rates)]
    return variants


def peak_of(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    from multigpu.forecast.hardware import table

    name = torch.cuda.get_device_name().lower()
    found = [row for kind, row in table().items() if kind.split("-")[0] in name]
    return found[0]["tflops"]["bf16"] * 1e12 if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b,llama2-13b")
    p.add_argument("--tp", default="1,8", help="tensor-parallel cuts (comma-separated)")
    p.add_argument("--micro-batches", default="1,2")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: the forecast's table)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows = measure(args)
    peak = peak_of(args)
    print(f"{'model':<14} {'tp':>3} {'mb':>3} {'hidden':>7} {'heads':>6} {'mlp':>6}  {'TFLOP/s':>8}  range"
          + ("        of peak" if peak else ""))
    for r in rows:
        lo, hi = (x / 1e12 for x in r["flop_s_range"])
        print(f"{r['model']:<14} {r['tp']:>3} {r['micro_batch']:>3} {r['hidden']:>7} {r['num_attention_heads']:>6} "
              f"{r['intermediate_size']:>6}  {r['flop_s'] / 1e12:8.2f}  {lo:.2f}-{hi:.2f}"
              + (f"  {r['flop_s'] / peak:6.1%}" if peak else ""))
    if args.json:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else
               platform.processor() or platform.machine(), "python": platform.python_version(), "peak_flop_s": peak,
               "seq_len": args.seq_len, "rounds": args.rounds, "iters": args.iters,
               "median_spread": statistics.median((r["flop_s_range"][1] - r["flop_s_range"][0]) / r["flop_s"]
                                                  for r in rows)}
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
