"""A user's own causal LM (RoPE and causal SDPA, no document mask of its own: tests/_hf_layouts.py's RopeLM) on
packed documents, 64-token rows of about 5 documents each (position_ids restart; a target across a boundary
ignored), for `multigpu verify --layouts "cp=2;..."` (its layout from mg.layout_from_args, mg.StepMeter, float64).

    --bug none   correct: the summed loss over mg.token_divisor of the shares
    --bug mean   each cp rank's loss its own share's mean: the shares count different targets
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import multigpu as mg

import _hf_layouts as hf

SEQ = 64


def main() -> None:
    with mg.init(seed=0) as dist:
        layout, rest = mg.layout_from_args()
        ap = argparse.ArgumentParser()
        ap.add_argument("--steps", type=int, default=5)
        ap.add_argument("--global-batch", type=int, default=8)
        ap.add_argument("--bug", default="none", choices=["none", "mean"])
        args = ap.parse_args(rest)
        tokens = torch.randint(0, hf.VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:].masked_fill(tokens[:, 1:] % 13 == 0, -100))
        model = mg.parallelize(hf.build("own_rope").to(dist.device), layout)
        plan = layout.plan(args.global_batch, dist)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        with mg.StepMeter(dist, plan, log_every=1, model=model, dtype="fp32") as meter:
            for step, micro_batches in meter.steps(mg.loader(data, plan, dist, seed=0)):
                divisor = mg.token_divisor([mg.context_share(model, y) for _, y in micro_batches])
                total = 0.0
                for x, y in mg.accumulate(model, micro_batches):
                    logits = model(x, position_ids=hf.documents(x))
                    y = mg.context_share(model, y)
                    if args.bug == "mean":
                        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / plan.accum_steps
                    else:
                        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / divisor
                    loss.backward()
                    total += float(loss.detach())
                mg.clip_grad_norm_(model, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                meter.step_end(loss=total)
                if step + 1 == args.steps:
                    break


if __name__ == "__main__":
    main()
