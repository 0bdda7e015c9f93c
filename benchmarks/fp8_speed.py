"""Is float8 faster here? bf16 and float8 training steps of the GPT recipe's model, interleaved (docs/float8.md).

One process, one device. The same model (the recipe's --size) is built twice with the same seed: one trained
in bf16 autocast, one with `mg.Precision("fp8")`'s layers (torchao's rule, or --include the blocks). After
--warmup steps each, rounds alternate A B A B (--rounds, --steps each), so a machine that speeds up or slows
down mid-way moves both alike. It prints each round's tokens/s (total tokens / total time of the round's
steps, the device synchronised), the speedup per round, their median and range, the layers converted and
the ones left out with why, and a verdict: faster, slower (with the likely reason: too few layers
converted, layers too small, or no torch.compile to fuse the casts), or not measurable (CPU: torchao emulates
float8 in float32 arithmetic, so the figure says nothing of a GPU).

    python benchmarks/fp8_speed.py --device cuda --size gpt2 --compile
    python benchmarks/fp8_speed.py --device cpu --size tiny --include blocks      # runs; the verdict says why it means nothing
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def build(args, precision: str):
    import multigpu as mg
    from multigpu.recipes.gpt.model import GPT, config

    torch.manual_seed(0)
    model = GPT(config(args.size, block_size=args.block)).to(args.device)
    amp = mg.Precision(precision, args.device)
    said = ""
    if precision == "fp8":
        include = [args.include] if args.include else ()
        model = amp.convert(model, include=include, verbose=False)
        from multigpu.parallel.float8 import is_float8_linear

        converted = [n for n, m in model.named_modules() if is_float8_linear(m)]
        left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in converted]
        said = f"{len(converted)} Linear layers in float8, {len(left)} left out" + (
            f" ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})" if left else "")
    if args.compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, amp, opt, said


def steps(model, amp, opt, args, n: int) -> float:
    """Seconds of ``n`` training steps, the device synchronised at both ends."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.cfg.vocab_size if hasattr(model, "cfg") else 256, (args.batch, args.block + 1),
                             generator=g).to(args.device) for _ in range(2)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(n):
        x = batches[i % 2]
        with amp.autocast():
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        amp.scale(loss).backward()
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--include", help="a module whose Linear layers to convert whatever torchao's rule says")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import torchao  # noqa: F401
    except ImportError:
        print("fp8 speed: torchao is not installed here (pip install 'multigpu[fp8]'); nothing measured")
        return 0
    import multigpu as mg

    runs = {}
    for precision in ("bf16", "fp8"):
        try:
            runs[precision] = build(args, precision)
        except mg.UsageError as err:
            print(f"fp8 speed: {precision} refused: {err}")
            return 0
    for precision, (model, amp, opt, _) in runs.items():
        steps(model, amp, opt, args, args.warmup)
    tokens = args.steps * args.batch * args.block
    rates: dict[str, list[float]] = {"bf16": [], "fp8": []}
    for _ in range(args.rounds):
        for precision, (model, amp, opt, _) in runs.items():  # A B A B
            rates[precision].append(tokens / steps(model, amp, opt, args, args.steps))
    speedups = [f / b for b, f in zip(rates["bf16"], rates["fp8"])]
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"fp8 speed: GPT {args.size}, {args.batch} x {args.block} tokens a step, {device}, torch {torch.__version__}"
          f"{', compiled per block' if args.compile else ''}; {runs['fp8'][3]}")
    for i, (b, f) in enumerate(zip(rates["bf16"], rates["fp8"]), 1):
        print(f"  round {i}: bf16 {b:,.0f} tokens/s, fp8 {f:,.0f} tokens/s: {f / b:.3f}x")
    median = statistics.median(speedups)
    print(f"  fp8 / bf16: median {median:.3f}x over {args.rounds} rounds (range {min(speedups):.3f}-{max(speedups):.3f}x)")
    emulated = not args.device.startswith("cuda")
    if emulated:
        verdict = "not measurable here: float8 is emulated on the CPU (float32 arithmetic), so this says nothing of a GPU"
    elif min(speedups) > 1:
        verdict = "faster in every round"
    elif max(speedups) < 1:
        why = "no torch.compile: the casts to float8 run as separate kernels" if not args.compile else \
            "the converted layers are too small or too few for float8 matmuls to outrun the casts"
        verdict = f"slower in every round: likely {why}"
    else:
        verdict = "no difference the rounds can tell apart"
    print(f"fp8 speed verdict: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
