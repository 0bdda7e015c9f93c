"""Mixed precision as a small, visible policy object.

The loop stays the user's: ``with amp.autocast(): loss = ...``,
``amp.scale(loss).backward()``, ``amp.step(optimizer)``. Nothing divides or
scales the loss behind the user's back; fp16 adds PyTorch's ``GradScaler`` and
counts the steps it skipped for inf/nan gradients.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .errors import UsageError
from .runtime.values import DTYPES, TRAINING_DTYPES


class Precision:
    """``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).

    >>> amp = mg.Precision("bf16", dist.device)
    >>> with amp.autocast():
    ...     loss = loss_fn(model(x), y)
    >>> amp.scale(loss).backward()
    >>> amp.step(opt)          # unscale, skip on inf/nan, update the scale
    """

    def __init__(self, name: str = "fp32", device: torch.device | str = "cpu") -> None:
        if name not in TRAINING_DTYPES:
            raise UsageError(f"unknown precision {name!r}; expected one of {', '.join(TRAINING_DTYPES)}")
        self.name = name
        self.device = torch.device(device)
        self.dtype = DTYPES[name]
        if name == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError("this GPU has no bf16 support; use precision 'fp16' (with loss scaling) or 'fp32'")
        self.scaler = torch.amp.GradScaler(self.device.type) if name == "fp16" else None
        self.skipped_steps = 0
        self._unscaled = False

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, {str(self.device)!r})"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward pass (and loss) in the policy's dtype where safe."""
        if self.name == "fp32":
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.dtype):
                yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on (multiplied by the loss scale under fp16)."""
        return self.scaler.scale(loss) if self.scaler else loss

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler else 1.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place, e.g. before clipping (no-op without fp16)."""
        if self.scaler and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()``, through the scaler under fp16. Returns False if the step was skipped."""
        self._unscaled = False
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before
        self.skipped_steps += int(skipped)
        return not skipped

    def state_dict(self) -> dict:
        state = {"name": self.name, "skipped_steps": self.skipped_steps}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise UsageError(f"saved precision is {state.get('name')!r} but this run uses {self.name!r}; resume with the same precision")
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
