"""The DCP part of a checkpoint, built from the training objects: one builder for save and load.

Model and optimizer go through ``get_state_dict`` (keys are parameter names
without wrapper prefixes); scheduler, loss scaler and stateful extras give
their own ``state_dict()``. A ZeroRedundancyOptimizer's state is gathered on
rank 0 (collective) for a save and left out of the template for a load (see
zero_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ..parallel.zero import is_zero_optimizer
from .zero_state import gather_state


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class TrainingObjects:
    """What a ``Checkpointer`` was given; all but the loader (its position is in the manifest) go through DCP.

    ``extra`` is the Checkpointer's own dict: a resume writes plain extras back into it.
    """

    model: nn.Module | None
    optimizer: Any
    scheduler: Any
    scaler: Any
    loader: Any
    extra: dict[str, Any]

    def module(self) -> nn.Module:
        """The model without DDP/DP wrappers."""
        from ..parallel import unwrap

        return unwrap(self.model)

    def keys(self) -> list[str]:
        """The top-level DCP entries these objects save: model, optim, scheduler, scaler, extra."""
        keys = [k for k, v in (("model", self.model), ("optim", self.optimizer), ("scheduler", self.scheduler),
                               ("scaler", self.scaler)) if v is not None]
        if any(is_stateful(v) for v in self.extra.values()):
            keys.append("extra")
        return keys

    def state_dict(self, rank: int = 0, for_load: bool = False) -> dict[str, Any]:
        """The DCP state dict (collective under ZeRO-1 for a save); ``for_load``: the template DCP loads into."""
        state: dict[str, Any] = {}
        if self.model is not None:
            zero = is_zero_optimizer(self.optimizer)
            opts = [self.optimizer] if self.optimizer is not None and not zero else []
            msd, osd = get_state_dict(self.module(), opts, options=StateDictOptions(strict=True))
            state["model"] = msd
            if zero and not for_load:
                full = gather_state(self.module(), self.optimizer, rank)
                if full is not None:
                    state["optim"] = full
            elif opts:
                state["optim"] = osd
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        for name, obj in self.extra.items():
            if is_stateful(obj):
                state.setdefault("extra", {})[name] = obj.state_dict()
        return state
