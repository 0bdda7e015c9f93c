"""A training loop in which one rank hangs inside a step (for tests/test_watchdog.py).

Started as ``multigpu run -n 3 --cpu _hang_worker.py HANG_RANK HANG_STEP``: the launcher passes the run
directory (and ``--profile``) to the workers' StepMeter.
"""

import sys
import time

import torch
import torch.distributed as tdist

import multigpu as mg
from multigpu.meter import StepMeter


def slow_step():
    time.sleep(600)  # the hang: this rank never reaches the all_reduce below


def main(hang_rank: int, hang_step: int) -> None:
    with mg.init(seed=0) as dist:
        model = torch.nn.Linear(8, 1)
        with StepMeter(dist, samples_per_step=4 * dist.world_size, watchdog=2.0, progress=False,
                       log_every=1000, flops_per_sample=None) as meter:
            for step, x in meter.steps(torch.randn(4, 8) for _ in range(100)):
                if dist.rank == hang_rank and step == hang_step:
                    slow_step()
                loss = model(x).pow(2).mean()
                loss.backward()
                for p in model.parameters():
                    tdist.all_reduce(p.grad)
                meter.step_end(loss=loss)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
