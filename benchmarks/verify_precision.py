"""How far apart correct runs end on 1, 2 and 4 processes, per precision: the measurement behind
`multigpu verify`'s tolerances (docs/study.md, "Precision").

Each target is a correct script (the same training on any world size, up to rounding): the MLP of
tests/_verify_script.py (Adam), the conv net of examples/verify_convnet.py (torch's DistributedSampler and
DDP, AdamW) and the GPT recipe's tiny model (DDP, AdamW; this file with --train). Each runs through
`multigpu verify` on 1, 2 and 4 CPU processes for --steps steps, once per precision (autocast, reported
to the meter as its dtype) and seed; the table gives, per target and precision, the largest over seeds
of the final parameters' distance as a share of the update (|theta_N - theta_1| / |theta_1 - theta_0|)
and of the largest relative loss difference, each against one process.

    python benchmarks/verify_precision.py [--steps 30] [--seeds 0,1,2] [--precisions fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # name -> (script, its arguments, global batch: 30 steps in one pass of its data, split by 1, 2, 4)
    "mlp": (ROOT / "tests" / "_verify_script.py", [], 8),
    "convnet": (ROOT / "examples" / "verify_convnet.py", [], 16),
    "gpt": (Path(__file__).resolve(), ["--train"], 8),
}


def train(args: argparse.Namespace) -> None:
    """The GPT target: the recipe's tiny model on its byte tokens, DDP, AdamW, autocast in --precision."""
    import torch
    import torch.nn.functional as F

    import multigpu as mg
    from multigpu.recipes.gpt.data import TokenWindows, prepare_tokens
    from multigpu.recipes.gpt.model import GPT, config

    with mg.init(seed=0, device="cpu") as dist:
        tokens = prepare_tokens(os.path.join(tempfile.gettempdir(), "multigpu-pydoc-tokens")) / "train.bin"
        data = TokenWindows(tokens, block_size=64, vocab_size=256)
        plan = mg.BatchPlan(args.global_batch, dist.world_size)
        torch.manual_seed(args.seed)
        model = mg.wrap(GPT(config("tiny")), "ddp" if dist.world_size > 1 else "none")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        amp = mg.Precision(args.precision, dist.device)
        with mg.StepMeter(dist, plan, log_every=1, progress=False, model=model, watchdog=None, dtype=amp.name) as meter:
            for step, micro_batches in meter.steps(mg.loader(data, plan, dist, shuffle=True, seed=args.seed)):
                loss = 0.0
                for x, y in mg.accumulate(model, micro_batches):
                    with amp.autocast():
                        part = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / plan.accum_steps
                    amp.scale(part).backward()
                    loss += float(part.detach())
                amp.step(opt)
                opt.zero_grad(set_to_none=True)
                meter.step_end(loss=loss)
                if step + 1 == args.steps:
                    break


def sweep(args: argparse.Namespace) -> None:
    from multigpu.verify import verify

    out = Path(args.out)
    rows = []
    for name in args.targets.split(","):
        script, extra, batch = TARGETS[name]
        for precision in args.precisions.split(","):
            for seed in args.seeds.split(","):
                where = out / f"{name}-{precision}-s{seed}"
                report = verify(str(script), [*extra, "--precision", precision, "--seed", seed], workers=(1, 2, 4),
                                steps=args.steps, global_batch=batch, cpu=True, out=str(where), say=lambda s: None)
                for w, c in report["comparisons"].items():
                    rows.append({"target": name, "precision": precision, "seed": int(seed), "workers": int(w),
                                 "final_rel": c["final_rel"], "loss_rel": c["largest_loss_rel"],
                                 "step0_loss_rel": abs(c["losses"][0][0] - c["losses"][0][1]) / abs(c["losses"][0][0]),
                                 "later_loss_rel": max(abs(a - b) / abs(a) for a, b in c["losses"][1:]),
                                 "steps": c["steps"]})
                    print(json.dumps(rows[-1]), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n| target | precision | final parameters, share of the update (2 / 4 processes vs 1) | largest loss "
          "difference (relative) |\n| --- | --- | --- | --- |")
    for name in args.targets.split(","):
        for precision in args.precisions.split(","):
            mine = [r for r in rows if r["target"] == name and r["precision"] == precision]
            final = "-".join(f"{v:.1e}" for v in (min(r["final_rel"] for r in mine), max(r["final_rel"] for r in mine)))
            loss = "-".join(f"{v:.1e}" for v in (min(r["loss_rel"] for r in mine), max(r["loss_rel"] for r in mine)))
            print(f"| {name} | {precision} | {final} | {loss} |")


def bugs(args: argparse.Namespace) -> None:
    """The planted bugs of tests/_verify_script.py (--bug all: every kind in one launch per world size), per
    precision: how far each moves the final parameters and step 0's loss, and whether verify names it."""
    import subprocess

    from multigpu.verify import _read_run, compare

    out, rows = Path(args.out) / "bugs", []
    script = TARGETS["mlp"][0]
    kinds = ("none", "seed", "sampler", "bn", "loss", "handavg")
    for precision in args.precisions.split(","):
        runs = {}
        for w in (1, 2, 4):
            where = out / f"{precision}-w{w}"
            subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", str(w), "--cpu", "--log-dir", str(where),
                            str(script), "--bug", "all", "--precision", precision, "--steps", str(args.steps),
                            "--global-batch", "8"], env=dict(os.environ, MULTIGPU_VERIFY="1"), check=True,
                           stdout=subprocess.DEVNULL)
            run_dir = next(p for p in where.iterdir() if p.is_dir())
            runs[w] = {kind: _read_run(run_dir / kind, args.steps) for kind in kinds}
        for w in (2, 4):
            for kind in kinds:
                c = compare(runs[1][kind], runs[w][kind], None)
                rows.append({"precision": precision, "bug": kind, "workers": w, "final_rel": c["final_rel"],
                             "step0_loss_rel": abs(c["losses"][0][0] - c["losses"][0][1]) / abs(c["losses"][0][0]),
                             "later_loss_rel": max(abs(a - b) / abs(a) for a, b in c["losses"][1:]),
                             "same": c["same"], "first": c["first_diverging_step"], "causes": c["causes"]})
                print(json.dumps(rows[-1]), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="run the GPT target (what verify launches)")
    p.add_argument("--bugs", action="store_true", help="the planted bugs instead of the correct targets")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "verify-precision"))
    args = p.parse_args()
    if args.train:
        train(args)
    elif args.bugs:
        bugs(args)
    else:
        sweep(args)


if __name__ == "__main__":
    sys.exit(main())
