"""The real race of a failure: rank 1 raises while every other rank waits in an all-reduce.

``python _race_worker.py mg|plain``: ``mg`` runs inside ``mg.init`` (which stamps the
exception's time before tearing down); ``plain`` is a torchrun-style script that calls
``init_process_group`` itself, so only the launcher's worker.py records the failure.
The other ranks then fail with gloo's "Connection reset/closed by peer", often in the
same second: the failure summary must still name rank 1.

Rank 1 raises only once every other rank has its next all-reduce in flight (issued
async, then announced in torchrun's store), so the race is the same on a loaded machine.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def body(rank: int, world_size: int) -> None:
    x = torch.ones(1 << 16)
    dist.all_reduce(x)  # everybody connected
    # The launcher's store (torchrun's MASTER_ADDR:MASTER_PORT), as a client: the handshake
    # needs no collective, which would have to be matched by rank 1.
    store = dist.PrefixStore("race", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                   is_master=False, timeout=timedelta(seconds=120)))
    if rank == 1:
        store.wait([f"in_flight_{r}" for r in range(world_size) if r != 1])  # the others wait in the all-reduce now
        raise ValueError("boom from rank 1")
    work = dist.all_reduce(x, async_op=True)
    store.set(f"in_flight_{rank}", "1")
    work.wait()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "mg":
        import multigpu as mg

        with mg.init(device="cpu") as d:
            body(d.rank, d.world_size)
    else:
        dist.init_process_group("gloo")
        body(dist.get_rank(), dist.get_world_size())
