"""A small training run over several sources at once, checkpointed every step; each rank logs the ids it trained on.

    python -m multigpu run -n 2 --cpu tests/_stream_train.py ROOT OUT --steps 20 --kill-at 4

ROOT holds ``_data_sources.write_sources``'s files. ``--kill-at K``: rank 0
SIGKILLs itself right after the checkpoint of step K, mid-epoch, as a lost
node would (the launcher then stops the others). The test resumes the run on
another world size from that checkpoint and compares the logged global
batches with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

import multigpu as mg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _data_sources as src  # noqa: E402

GLOBAL_BATCH = 12
KINDS = ["tars", "tokens"] + (["hf"] if src.datasets is not None else [])


class Loaders:
    """Several loaders as one position (a Checkpointer keeps one ``loader=``)."""

    def __init__(self, loaders: dict) -> None:
        self.loaders = loaders

    def state_dict(self) -> dict:
        return {k: ld.state_dict() for k, ld in self.loaders.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, ld in self.loaders.items():
            ld.load_state_dict(state[k])


def forever(loader):
    while True:
        yield from loader


def loaders(root, dist) -> dict:
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    return {k: src.make_loader(k, root, plan, dist, workers=2 if k == "tars" else 0, seed=5) for k in KINDS}


def step_ids(batch: dict) -> dict:
    return {k: [x for mb in mbs for x in src.ids(k, mb)] for k, mbs in batch.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=None)
    args = p.parse_args(argv)
    out = Path(args.out)
    with mg.init(seed=0) as dist:
        data = loaders(args.root, dist)
        torch.manual_seed(0)
        model = mg.wrap(torch.nn.Linear(3, 1), "ddp" if dist.world_size > 1 else "none")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ckpt = mg.Checkpointer(out / "ckpt", every=1, keep=2, model=model, optimizer=opt, loader=Loaders(data))
        start = ckpt.resume()
        streams = {k: forever(ld) for k, ld in data.items()}
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"log-{dist.world_size}-{dist.rank}.jsonl", "a") as log:
            for step in range(start, args.steps):
                batch = {k: next(it) for k, it in streams.items()}
                for x in mg.accumulate(model, [mb["x"] for mb in batch["tars"]]):
                    model(x).sum().backward()  # a real step on the decoded tar samples
                opt.step()
                opt.zero_grad(set_to_none=True)
                log.write(json.dumps({"step": step, "ids": step_ids(batch)}) + "\n")
                log.flush()
                ckpt.save(step)
                if step == args.kill_at and dist.rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
        ckpt.finish()


if __name__ == "__main__":
    main()
