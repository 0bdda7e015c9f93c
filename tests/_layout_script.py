"""A small script that follows the layout contract (docs/your-model.md): its Layout from mg.layout_from_args,
--steps and --global-batch, its steps measured by mg.StepMeter. In float64, so a layout equals one process
to rounding.

    --bug rank-seed   the model is built from a seed that depends on the rank (not the same training)
"""

import argparse

import torch
from torch import nn

import multigpu as mg


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


with mg.init(seed=0, device="cpu") as dist:
    layout, rest = mg.layout_from_args(default=mg.parallel.Layout(micro_batch=4))
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--bug", default="none", choices=["none", "rank-seed"])
    args = ap.parse_args(rest)
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(8, 8, generator=g)))
    torch.manual_seed(dist.rank if args.bug == "rank-seed" else 0)
    model = nn.Sequential(*(Block(8) for _ in range(4)))
    plan = layout.plan(args.global_batch, dist)

    def loss_fn(out, y):
        return nn.functional.mse_loss(out, y)

    if layout.pp > 1:
        model = mg.parallel.pipeline(model, layout, loss_fn, plan)
    else:  # the blocks' names are not a transformer's: the plan is given
        model = mg.parallelize(model, layout, tp_plan={"*.up": "colwise", "*.down": "rowwise"}, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with mg.StepMeter(dist, plan, log_every=2, model=model, progress=False, watchdog=None) as meter:
        for step, micro_batches in meter.steps(mg.loader(data, plan, dist, seed=0)):
            if layout.pp > 1:
                loss = model.step(micro_batches)
            else:
                loss = 0.0
                for xb, yb in mg.accumulate(model, micro_batches):
                    part = loss_fn(model(xb), yb) / plan.accum_steps
                    part.backward()
                    loss += float(part.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            meter.step_end(loss=loss)
            if step + 1 == args.steps:
                break
