"""Does the GPT recipe learn the same in float8 as in bf16? (docs/float8.md, issue "Float8 training that pays", item 3)

The recipe's tiny GPT (block 64, Python's own docs as tokens: no download) trained for --steps AdamW steps
on one process, global batch 16, in bf16 autocast and in torchao's emulated float8 (tensorwise; the blocks'
Linear layers named, as torchao's size rule leaves out layers this small; the head stays in float32), each
with two seeds (the initial weights and the data order differ), and once in float32. The figure of merit:
the mean training loss over the last 25 steps and the held-out loss at the end; float8's distance from bf16
at the same seed is set beside bf16's own run-to-run spread (seed 0 against seed 1). On CPU the float8
matmuls are emulated (float8 rounding, float32 arithmetic): the times printed mean nothing for a GPU.

    python benchmarks/fp8_learning.py [--steps 300]
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

BLOCK, BATCH = 64, 16


def run(precision: str, seed: int, steps: int, train, val) -> dict:
    import multigpu as mg
    from multigpu.recipes.gpt.model import GPT, config

    torch.manual_seed(seed)
    model = GPT(config("tiny", block_size=BLOCK))
    amp = mg.Precision(precision, "cpu")
    if precision == "fp8":
        model = amp.convert(model, include=["blocks"], verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        rows = torch.randint(0, len(train), (BATCH,), generator=g)
        x, y = (torch.stack(t) for t in zip(*(train[int(i)] for i in rows)))
        with amp.autocast():
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        amp.scale(loss).backward()
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad(), amp.autocast():
        x, y = (torch.stack(t) for t in zip(*(val[i] for i in range(min(64, len(val))))))
        held_out = float(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))
    return {"train": statistics.mean(losses[-25:]), "held_out": held_out, "step_s": seconds / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    from multigpu.recipes.gpt.data import TokenWindows, prepare_tokens
    from multigpu.recipes.gpt.model import config
    from multigpu.runtime.fingerprint import fingerprint

    torch.set_num_threads(1)
    data = prepare_tokens(str(Path("/tmp") / "multigpu-pydoc-tokens"))
    vocab = config("tiny").vocab_size
    train = TokenWindows(data / "train.bin", block_size=BLOCK, vocab_size=vocab)
    val = TokenWindows(data / "val.bin", block_size=BLOCK, vocab_size=vocab)
    runs = {}
    for seed in (0, 1):  # interleaved: a machine that slows down mid-way slows every precision alike
        for precision in ("bf16", "fp8"):
            runs[precision, seed] = run(precision, seed, args.steps, train, val)
    runs["fp32", 0] = run("fp32", 0, args.steps, train, val)
    print(f"tiny GPT, {args.steps} AdamW steps of {BATCH} x {BLOCK} tokens, one process, CPU "
          f"({fingerprint().get('torch', torch.__version__)})")
    for (precision, seed), r in runs.items():
        print(f"  {precision:5s} seed {seed}: train loss (last 25 steps) {r['train']:.4f}, held-out {r['held_out']:.4f}, "
              f"{1e3 * r['step_s']:.0f} ms/step")
    for what in ("train", "held_out"):
        spread = abs(runs["bf16", 0][what] - runs["bf16", 1][what])
        gaps = [abs(runs["fp8", s][what] - runs["bf16", s][what]) for s in (0, 1)]
        print(f"{what}: |fp8 - bf16| at the same seed {gaps[0]:.4f} and {gaps[1]:.4f}; bf16 seed 0 vs seed 1 "
              f"{spread:.4f}; fp32 vs bf16 (seed 0) {abs(runs['fp32', 0][what] - runs['bf16', 0][what]):.4f}")
    print("float8 is emulated on CPU: its ms/step says nothing of a GPU's float8 speed")


if __name__ == "__main__":
    main()
