"""Training that outlives a hang or a lost node (for tests/test_elastic.py).

DDP with a Checkpointer (model, optimizer, loader, NoiseScale), a StepMeter
(its watchdog is what ``--hang-timeout`` listens to), and a record of every
step: the world size, the accumulation and the sorted sample indices of the
global batch, appended by rank 0 to ``--record``::

    multigpu run -n 3 --cpu --hang-timeout 4 --max-restarts 1 _elastic_train.py --dir D --out P --record R --hang 1:5
    multigpu run --nnodes 1:2 --master 127.0.0.1:PORT --node-rank 0 ... _elastic_train.py --dir D --out P --record R

``--hang RANK:STEP``: that rank sleeps in that step, on the first attempt only.
``--hold STEP``: on the first attempt, wait in that step until the launcher
stops the worker (a node joining restarts it), so the join happens mid-run.
``--float64 --micro 2``: the same training in float64 (equal to one process within 1e-9), on up to 4 ranks.
``ELASTIC_DIE_IN_SAVE=K`` (set for one node's launcher): its workers SIGKILL
their launcher and themselves inside their K-th save at world size 2 or more,
after the model files are written and before the manifest: a node lost
while a checkpoint is being written. ``train`` is also the in-process
reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import Dataset

import multigpu as mg
from multigpu.checkpoint import storage

N, GLOBAL_BATCH, MICRO, STEPS = 192, 24, 4, 20  # accumulation 6, 3, 2 on 1, 2, 3 ranks


class Indexed(Dataset):
    def __init__(self, dtype=torch.float32):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, 10, generator=g).to(dtype)
        self.y = (self.x[:, :3].sum(1) > 0).long()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def _die_in_save(k: int) -> None:
    """Lose this node inside the k-th multi-rank save: the launcher (our parent) and this worker."""
    real, seen = storage.hash_files, []

    def hash_then_die(root, names):
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            seen.append(root)
            if len(seen) == k:
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
        return real(root, names)

    storage.hash_files = hash_then_die


def train(dist, directory, steps=STEPS, record=None, hang=None, step_time=0.0, log_dir=None, hold=None,
          dtype=torch.float32, micro=MICRO):
    """Train ``steps`` steps, resuming from ``directory``; returns the parameters (``dtype``: float64 for
    equality to rounding; ``micro``: 2 for a world of 4)."""
    torch.manual_seed(0)
    model = mg.wrap(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2)).to(dist.device, dtype), "ddp")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size, micro_batch=micro)
    loader = mg.loader(Indexed(dtype), plan, dist, seed=0)
    noise = mg.NoiseScale(plan, every=1, sync_every=1).attach(model)
    ckpt = mg.Checkpointer(directory, every=2, model=model, optimizer=opt, loader=loader, noise=noise)
    start = ckpt.resume()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    with mg.StepMeter(dist, plan, log_every=1000, progress=False, flops_per_sample=None, log_dir=log_dir) as meter:
        for step, micro_batches in meter.steps(_steps_of(loader, start, steps), start=start):
            if hang is not None and hang == (dist.rank, step) and first_attempt:
                time.sleep(600)  # the hang: the others wait in the gradient all-reduce
            if step == hold and os.environ.get("MULTIGPU_ATTEMPT") == "0":
                time.sleep(120)  # until the agent restarts this worker for the node that joins
            seen = []
            for x, y, idx in mg.accumulate(model, micro_batches):
                loss = nn.functional.cross_entropy(model(x), y) / plan.accum_steps
                loss.backward()
                seen += idx.tolist()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if record is not None:
                _record(record, dist, step, plan, seen, noise)
            ckpt.save(step)
            meter.step_end(loss=loss * plan.accum_steps)
            time.sleep(step_time)
    ckpt.finish()
    return [p.detach().clone() for p in mg.unwrap(model).parameters()]


def _steps_of(loader, start, total):
    step = start
    while step < total:
        for micro_batches in loader:
            yield micro_batches
            step += 1
            if step >= total:
                return


def _record(path, dist, step, plan, seen, noise):
    noise.flush()  # collective: the count below includes this step on every world size
    everyone = [seen] * dist.world_size
    if dist.world_size > 1:
        tdist.all_gather_object(everyone, seen)
    if dist.is_main:
        rec = {"step": step, "time": time.time(), "world_size": dist.world_size, "accum_steps": plan.accum_steps,
               "samples": sorted(i for part in everyone for i in part),
               "noise_measured": noise.measured}
        with open(path, "a") as fp:
            fp.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record", default=None)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--hang", default=None, metavar="RANK:STEP")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--hold", type=int, default=None, metavar="STEP")
    ap.add_argument("--float64", action="store_true")
    ap.add_argument("--micro", type=int, default=MICRO)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("ELASTIC_DIE_IN_SAVE"):
        _die_in_save(int(os.environ["ELASTIC_DIE_IN_SAVE"]))
    hang = tuple(int(v) for v in args.hang.split(":")) if args.hang else None
    with mg.init(seed=0, device="cpu") as dist:
        params = train(dist, args.dir, args.steps, args.record, hang, args.step_time, hold=args.hold,
                       dtype=torch.float64 if args.float64 else torch.float32, micro=args.micro)
        if dist.is_main:
            torch.save(params, args.out)


if __name__ == "__main__":
    main()
