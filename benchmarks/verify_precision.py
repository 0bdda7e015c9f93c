"""How far apart correct runs end on 1, 2 and 4 processes, per precision, and how far above their own
floor: the measurement behind `multigpu verify`'s floor factor and its precision tolerances (docs/study.md,
"The floor" and "Precision").

Each target is a correct script (the same training on any world size, up to rounding): the MLP of
tests/_verify_script.py (Adam), the conv net of examples/verify_convnet.py (torch's DistributedSampler and
DDP; AdamW, SGD, and SGD with SyncBatchNorm) and the GPT recipe's tiny model (DDP, AdamW; this file with
--train); or a bug (conv-bn: the conv net with a BatchNorm DDP does not sync, SGD and AdamW). Each runs
through `multigpu verify` on 1, 2 and 4 CPU processes for --steps steps, once per precision (autocast,
reported to the meter as its dtype) and seed. Per run the rows give the final parameters' distance as a
share of the update (|theta_N - theta_1| / |theta_1 - theta_0|), the relative loss differences (step 0's,
the largest after), the floor (verify's floor run: one process again, each step's samples in another order
and each gradient rounded once more) and how many times the floor each stands; the table gives, per target
and precision, the range over seeds and world sizes.

    python benchmarks/verify_precision.py [--steps 30] [--seeds 0,1,2] [--precisions fp32,bf16]
    python benchmarks/verify_precision.py --bugs      # the planted bugs of tests/_verify_script.py, likewise
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVNET = ROOT / "examples" / "verify_convnet.py"
TARGETS = {  # name -> (script, its arguments, global batch: 30 steps in one pass of its data, split by 1, 2, 4)
    "mlp": (ROOT / "tests" / "_verify_script.py", [], 8),
    "convnet": (CONVNET, [], 16),
    "convnet-sgd": (CONVNET, ["--optimizer", "sgd"], 16),
    "convnet-syncbn": (CONVNET, ["--optimizer", "sgd", "--sync-batchnorm"], 16),
    "gpt": (Path(__file__).resolve(), ["--train"], 8),
    # bugs: BatchNorm without sync (the filed case: SGD, 5 steps, global batch 64, fp32 read SAME)
    "conv-bn": (CONVNET, ["--optimizer", "sgd", "--batchnorm"], 16),
    "conv-bn-adamw": (CONVNET, ["--batchnorm"], 16),
    "conv-bn-64": (CONVNET, ["--optimizer", "sgd", "--batchnorm"], 64),
}
BUGS = ("conv-bn", "conv-bn-adamw", "conv-bn-64")


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
        amp = mg.Precision(args.precision, dist.device)
        model = GPT(config("tiny"))
        if args.precision == "fp8":  # the tiny blocks' layers are below torchao's size rule: named, as a user would
            model = amp.convert(model, include=["blocks"], verbose=False)
        model = mg.wrap(model, "ddp" if dist.world_size > 1 else "none")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
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
    from multigpu.errors import UsageError
    from multigpu.verify import verify

    out = Path(args.out)
    rows = []
    for name in args.targets.split(","):
        script, extra, batch = TARGETS[name]
        for precision in args.precisions.split(","):
            for seed in args.seeds.split(","):
                where = out / f"{name}-{precision}-s{seed}"
                try:
                    report = verify(str(script), [*extra, "--precision", precision, "--seed", seed], workers=(1, 2, 4),
                                    steps=args.steps, global_batch=batch, cpu=True, out=str(where), say=lambda s: None)
                except UsageError as err:  # conv-bn-64 has 8 steps of data: not a 30-step target
                    print(f"{name} {precision} seed {seed}: skipped: {err}", flush=True)
                    continue
                for w, c in report["comparisons"].items():
                    rows.append({"target": name, "bug": name in BUGS, "precision": precision, "seed": int(seed),
                                 "workers": int(w), **_row(c, report["floor"])})
                    print(json.dumps(rows[-1]), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    _table(rows, "target")


def _row(c: dict, floor: dict) -> dict:
    """One comparison: its distances, the floor's, how many times the floor each stands, the verdict."""
    from multigpu.verify_floor import loss_gaps

    rel = loss_gaps(c["losses"])
    return {"steps": c["steps"], "final_rel": c["final_rel"], "step0_loss_rel": rel[0],
            "later_loss_rel": max(rel[1:], default=0.0), "floor_step0": floor["step0"], "floor_later": floor["later"],
            "floor_update": floor["update"], "floor_why_not": floor["why_not"],
            "step0_x": rel[0] / max(floor["step0"], floor["min_loss"]),
            "later_x": max(rel[1:], default=0.0) / max(floor["step0"], floor["later"], floor["min_loss"]),
            "final_x": c["final_x_floor"], "same": c["same"], "causes": c["causes"]}


def _table(rows: list[dict], key: str) -> None:
    """Per (key, precision): the ranges over seeds and world sizes of each distance and of its times the floor."""
    def span(mine: list[dict], field: str) -> str:
        vals = [r[field] for r in mine if r[field] is not None]
        return "-".join(f"{v:.1e}" for v in (min(vals), max(vals))) if vals else "-"

    print(f"\n| {key} | precision | step 0 loss (x floor) | later losses (x floor) | final parameters, share of "
          f"the update (x floor) | floor: step 0 / later / update | verdicts |\n| --- | --- | --- | --- | --- | --- | --- |")
    for name in dict.fromkeys(r[key] for r in rows):
        for precision in dict.fromkeys(r["precision"] for r in rows):
            mine = [r for r in rows if r[key] == name and r["precision"] == precision]
            if mine:
                same = sum(r["same"] for r in mine)
                print(f"| {name} | {precision} | {span(mine, 'step0_loss_rel')} ({span(mine, 'step0_x')}) | "
                      f"{span(mine, 'later_loss_rel')} ({span(mine, 'later_x')}) | {span(mine, 'final_rel')} "
                      f"({span(mine, 'final_x')}) | {span(mine, 'floor_step0')} / {span(mine, 'floor_later')} / "
                      f"{span(mine, 'floor_update')} | {same} SAME, {len(mine) - same} DIFFERENT |")


def bugs(args: argparse.Namespace) -> None:
    """The planted bugs of tests/_verify_script.py (--bug all: every kind in one launch per world size), per
    precision: how far each moves the final parameters and step 0's loss, and whether verify names it."""
    import subprocess

    from multigpu.verify import STEP0, _read_run, compare, floor_of

    out, rows = Path(args.out) / "bugs", []
    script = TARGETS["mlp"][0]
    kinds = ("none", "seed", "sampler", "bn", "loss", "handavg")
    for precision in args.precisions.split(","):
        for seed in args.seeds.split(","):
            runs = {}
            for w, env in ((1, {}), ("floor", {"MULTIGPU_VERIFY_FLOOR": "1"}), (2, {}), (4, {})):
                where = out / f"{precision}-s{seed}-w{w}"
                subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", str(1 if w == "floor" else w), "--cpu",
                                "--log-dir", str(where), str(script), "--bug", "all", "--precision", precision,
                                "--steps", str(args.steps), "--global-batch", "8", "--seed", seed],
                               env=dict(os.environ, MULTIGPU_VERIFY="1", **env), check=True, stdout=subprocess.DEVNULL)
                run_dir = next(p for p in where.iterdir() if p.is_dir())
                runs[w] = {kind: _read_run(run_dir / kind, args.steps) for kind in kinds}
            for kind in kinds:
                floor = floor_of(runs[1][kind], runs["floor"][kind], STEP0.tolerance)
                for w in (2, 4):
                    c = compare(runs[1][kind], runs[w][kind], None, floor)
                    rows.append({"bug": kind, "precision": precision, "seed": int(seed), "workers": w,
                                 **_row(c, floor.record())})
                    print(json.dumps(rows[-1]), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    _table(rows, "bug")


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
