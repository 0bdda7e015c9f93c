"""Mixed precision as a small, visible policy object.

The loop stays the user's: ``with amp.autocast(): loss = ...``,
``amp.scale(loss).backward()``, ``amp.step(optimizer)``. Nothing divides or
scales the loss behind the user's back; fp16 adds PyTorch's ``GradScaler`` and
counts the steps it skipped for inf/nan gradients. fp8 converts the model's
large Linear layers to torchao's float8 training once (``amp.convert(model)``,
before ``mg.parallelize``) and, under FSDP, refreshes the float8 weights'
scales after each step in ``amp.step`` (``parallel/float8.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from torch import nn

from .errors import UsageError
from .runtime.values import DTYPES, TRAINING_DTYPES

PRECISIONS = (*TRAINING_DTYPES, "fp8")


class Precision:
    """``"fp32"``, ``"bf16"`` (autocast), ``"fp16"`` (autocast + GradScaler) or ``"fp8"`` (torchao's float8
    training of the large Linear layers, ``recipe`` "tensorwise" or "rowwise"; emulated on CPU).

    >>> amp = mg.Precision("bf16", dist.device)
    >>> with amp.autocast():
    ...     loss = loss_fn(model(x), y)
    >>> amp.scale(loss).backward()
    >>> amp.step(opt)          # unscale, skip on inf/nan, update the scale

    >>> amp = mg.Precision("fp8", dist.device)
    >>> model = mg.parallelize(amp.convert(model), layout)   # convert first, then spread
    """

    def __init__(self, name: str = "fp32", device: torch.device | str = "cpu", recipe: str | None = None) -> None:
        if name not in PRECISIONS:
            raise UsageError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
        self.name = name
        self.device = torch.device(device)
        self.dtype = DTYPES.get(name, torch.float8_e4m3fn)
        if name == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError("this GPU has no bf16 support; use precision 'fp16' (with loss scaling) or 'fp32'")
        if recipe is not None and name != "fp8":
            raise UsageError(f"recipe={recipe!r} is a float8 scaling recipe, but the precision is {name!r}; "
                             "use mg.Precision('fp8', device, recipe=...) or leave recipe out")
        self.recipe = recipe
        self.emulate = False
        self._float8_models: list[nn.Module] = []  # the models amp.convert made float8, for FSDP's scales
        self.converted = ""  # what the last amp.convert did, in the one line it prints
        self._stepped = False  # FSDP's float8 scales are amp.step's from the second step on
        if name == "fp8":
            from .parallel import float8

            self.recipe = recipe or "tensorwise"
            if self.recipe not in float8.RECIPES:
                raise UsageError(f"unknown float8 recipe {self.recipe!r}; expected one of {', '.join(float8.RECIPES)}")
            self.emulate = float8.check_device(self.device)
            float8.torchao_float8()  # torchao missing is said here, before the model is built
        self.scaler = torch.amp.GradScaler(self.device.type) if name == "fp16" else None
        self.skipped_steps = 0
        self._unscaled = False

    def __repr__(self) -> str:
        recipe = f", recipe={self.recipe!r}" if self.recipe else ""
        return f"Precision({self.name!r}, {str(self.device)!r}{recipe})"

    def convert(self, model: nn.Module, include: list[str] | tuple[str, ...] = (),
                exclude: list[str] | tuple[str, ...] = (), verbose: bool = True) -> nn.Module:
        """Under fp8: ``model``'s Linear layers large enough to gain become torchao's ``Float8Linear`` (torchao's
        rule per recipe, ``parallel/float8.py``'s ``RULE``); ``include`` / ``exclude`` name modules to convert
        anyway (dims multiples of 16) or to leave out. Call it on the full model before ``mg.parallelize``;
        master weights stay in the model's dtype (float32 or bfloat16). Says what it did in one line on rank 0.

        >>> amp = mg.Precision("fp8", dist.device)
        >>> model = amp.convert(model, exclude=["head"])
        """
        if self.name != "fp8":
            fix = ("float8 training has no loss scaling: its scales are per tensor; use mg.Precision('fp8') with a "
                   "float32 or bf16 model" if self.name == "fp16" else "use mg.Precision('fp8', device)")
            raise UsageError(f"amp.convert(model) makes float8 layers, but this precision is {self.name!r}; {fix}")
        from .dist import print0
        from .parallel import float8

        model, self.converted = float8.convert(model, self.recipe, self.emulate, include, exclude)
        self._float8_models.append(model)
        if verbose:
            print0(self.converted)
        return model

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward pass (and loss) in the policy's dtype where safe. Under fp8 no dtype changes (the
        float8 layers cast their own matmul inputs, the rest runs in the model's dtype); until the first
        ``amp.step`` it computes FSDP's float8 weight scales from the whole weights, as ``amp.step`` does after
        each step: without them torchao's first all-gather under FSDP x TP scales each TP shard by its own amax
        (its FSDP mesh is the only one it reduces over; measured 3.6e-3 off one process after one step)."""
        if self.name == "fp8" and self._float8_models and not self._stepped:
            from .parallel import float8

            float8.refresh_scales(self._float8_models)
        if self.name in ("fp32", "fp8"):
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
        self._stepped = True
        if self.scaler is None:
            optimizer.step()
            if self._float8_models:  # FSDP's float8 all-gather casts by these scales until the next step
                from .parallel import float8

                float8.refresh_scales(self._float8_models)
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before
        self.skipped_steps += int(skipped)
        return not skipped

    def state_dict(self) -> dict:
        state = {"name": self.name, "skipped_steps": self.skipped_steps}
        if self.recipe:
            state["recipe"] = self.recipe
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise UsageError(f"saved precision is {state.get('name')!r} but this run uses {self.name!r}; resume with the same precision")
        if state.get("recipe") != self.recipe:
            raise UsageError(f"saved float8 recipe is {state.get('recipe')!r} but this run uses {self.recipe!r}; "
                             "resume with the same recipe")
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
