"""An ordinary script for `multigpu run --find-batch` (tests/test_launch.py).

``search``: runs the search when the launcher asks, each trial touching 2 MiB per sample;
``ignore``: never calls mg.find_micro_batch. Either way it prints the plan it trains with.
``sequence``: runs mg.find_sequence_length, each trial touching 16 KiB per token, and prints what fits.
``short``: mg.find_sequence_length over a step that slices 2,048 tokens: more is asked than the data holds.
"""

import sys

import torch

import multigpu as mg

MIB = 1 << 20


def step(m: int) -> None:
    t = torch.empty(m, 2 * MIB // 4)
    t.fill_(1.0)  # touch every page: resident, not just reserved


if __name__ == "__main__":
    with mg.init(seed=0) as dist:
        plan = mg.BatchPlan(global_batch=128, world_size=dist.world_size)
        if sys.argv[1] == "sequence" and mg.find_batch_requested():
            found = mg.find_sequence_length(lambda n: step(n // 128), dist, multiple=128, start=128)
            mg.print0(f"longest: {found.length}")
        if sys.argv[1] == "short" and mg.find_batch_requested():
            embed, tokens = torch.nn.Embedding(64, 8), torch.randint(0, 64, (1, 2048))
            mg.find_sequence_length(lambda n: embed(tokens[:, :n]).sum().backward(), dist, multiple=128, start=1024,
                                    max_length=65536)
        if sys.argv[1] == "search" and mg.find_batch_requested():
            plan = mg.find_micro_batch(step, dist, plan=plan).plan
        mg.print0(f"plan: {plan.world_size} ranks x {plan.micro_batch} x {plan.accum_steps} accumulation")
