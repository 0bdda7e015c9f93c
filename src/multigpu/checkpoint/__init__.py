"""Checkpoints that never lose work: exact resume, any world size, atomic writes.

``Checkpointer`` (checkpointer.py saves, loading.py resumes) goes through
``torch.distributed.checkpoint``; ``state`` builds the DCP state dict from
the training objects for both, ``zero_state`` the ZeRO-1 optimizer's part,
``group`` the collectives they agree through; ``storage`` owns the directory
layout, manifest and checks; ``rng`` the per-rank random states; ``tools``
the ``multigpu ckpt`` verbs.
"""

from .checkpointer import Checkpointer
from .tools import export, table

__all__ = ["Checkpointer", "export", "table"]
