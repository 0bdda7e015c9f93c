"""The real race of a failure: rank 1 raises while every other rank waits in an all-reduce.

``python _race_worker.py mg|plain``: ``mg`` runs inside ``mg.init`` (which stamps the
exception's time before tearing down); ``plain`` is a torchrun-style script that calls
``init_process_group`` itself, so only the launcher's worker.py records the failure.
The other ranks then fail with gloo's "Connection reset/closed by peer", often in the
same second: the failure summary must still name rank 1.
"""

import sys
import time

import torch
import torch.distributed as dist


def body(rank: int) -> None:
    x = torch.ones(1 << 16)
    dist.all_reduce(x)  # everybody connected
    if rank == 1:
        time.sleep(0.2)  # the others are inside the next all-reduce by now
        raise ValueError("boom from rank 1")
    dist.all_reduce(x)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "mg":
        import multigpu as mg

        with mg.init(device="cpu") as d:
            body(d.rank)
    else:
        dist.init_process_group("gloo")
        body(dist.get_rank())
