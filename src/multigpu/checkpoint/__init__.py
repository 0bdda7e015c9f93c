"""Checkpoints that never lose work: exact resume, any world size, atomic writes.

``Checkpointer`` (checkpointer.py, loading.py) saves through
``torch.distributed.checkpoint``; ``storage`` owns the directory layout,
manifest and checks; ``rng`` the per-rank random states; ``tools`` the
``multigpu ckpt`` verbs.
"""

from .checkpointer import Checkpointer
from .tools import export, table

__all__ = ["Checkpointer", "export", "table"]
