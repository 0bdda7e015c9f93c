"""The few collectives a checkpoint save or resume needs (all ranks agree on files, hashes, errors)."""

from __future__ import annotations

from typing import Any

import torch.distributed as tdist


class Group:
    """Collectives when a process group exists, their one-process meaning otherwise."""

    def __init__(self) -> None:
        self.on = tdist.is_available() and tdist.is_initialized()
        self.rank = tdist.get_rank() if self.on else 0
        self.world = tdist.get_world_size() if self.on else 1

    def gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        if self.world == 1:
            return value
        box = [value]
        tdist.broadcast_object_list(box, src=0)
        return box[0]
