"""`multigpu run`: start N worker processes of a script through torchrun's own launcher.

We add what torchrun leaves to the user: sensible defaults (one worker per GPU,
2 on CPU), argument checks that fail in one line, per-rank log files named by
global rank, rank 0 on the console, SLURM, and one summary line when a worker
fails. The launcher -> worker contract (MULTIGPU_* variables, find_batch.json) is
``multigpu.runtime.contract``, below the workers' code. The modules, from the bottom up:

    config.py    RunConfig, its checks and the layout (resolve), the command line (add_arguments)
    network.py   several nodes: the address the others reach this node at, and gloo's interface for it
    slurm.py     inside srun: the first node's address from SLURM (scontrol's NodeAddr), or one line
    start.py     torchrun's elastic_launch in this process: worker variables, supervision, closing lines
    logs.py      per-rank log files, the console view, the failure summary (imports torch; loaded late)
    replicas.py  --fault-tolerant G: the torchft lighthouse and G replica groups (group.py: one group's run)

Rendezvous is always torchrun's c10d: one node uses ``--standalone`` (the
store on a free port of localhost, so two runs never collide); several nodes
meet at ``--master HOST:PORT``, where node 0 hosts the store. torchrun's
``--node-rank`` only means something to its static rendezvous, whose store is
shared by every restart attempt; so here ``--node-rank 0`` marks the node that
hosts the store (c10d's ``is_host``), and the rendezvous numbers the nodes
(sorted by host name). c10d restarts all nodes together when one fails, which
is what ``--max-restarts`` needs.
"""

from .config import DEFAULT_LOG_DIR, Placement, RunConfig, add_arguments, from_args, resolve
from .start import SHUTDOWN_GRACE_S, find_batch_line, launch, main, run

__all__ = ["DEFAULT_LOG_DIR", "SHUTDOWN_GRACE_S", "Placement", "RunConfig", "add_arguments", "find_batch_line",
           "from_args", "launch", "main", "resolve", "run"]
