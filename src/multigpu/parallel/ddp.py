"""Strategy ``"ddp"``: ``DistributedDataParallel``, with an unused-parameter error that names the parameters.

``build_ddp`` is the one DDP construction (device ids, only the options the
user set, BatchNorm preparation); ``"zero1"`` (zero.py) builds on it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from . import comm_hooks
from .batchnorm import prepare_batchnorm


def device_of(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


class DDP(DistributedDataParallel):
    """DDP whose unused-parameter error names the parameters and the fix."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            if "Expected to have finished reduction" not in str(err):
                raise
            raise UsageError(_unused_message(self.module, str(err))) from None


def _unused_message(module: nn.Module, text: str) -> str:
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    unused = [names[int(i)] for i in found.group(1).split()] if found else []
    which = ", ".join(unused) if unused else "some parameters"
    return (
        f"DDP expected a gradient for every parameter but {which} got none in the previous step; "
        "use mg.wrap(model, 'ddp', find_unused_parameters=True), or make every parameter take part in the loss"
    )


def build_ddp(model: nn.Module, strategy: str, cls: type[DDP] = DDP, sync_batchnorm: bool = False,
              **options: Any) -> DDP:
    """``cls(model, ...)`` on the model's device, with only the DDP options that are not None.

    Passing only what the user set keeps DDP's own defaults DDP's, and options
    that newer torch deprecates (broadcast_buffers) warn only when used.
    """
    device = device_of(model)
    model = prepare_batchnorm(model, strategy, sync_batchnorm, device)
    kwargs = {k: v for k, v in options.items() if v is not None}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    return cls(model, **kwargs)


def wrap_ddp(
    model: nn.Module,
    bucket_cap_mb: float | None = None,
    static_graph: bool | None = None,
    find_unused_parameters: bool | None = None,
    gradient_as_bucket_view: bool | None = None,
    broadcast_buffers: bool | None = None,
    sync_batchnorm: bool = False,
    comm_hook: str | None = None,
    powersgd_rank: int | None = None,
    powersgd_start_iter: int | None = None,
) -> nn.Module:
    comm_hooks.validate(comm_hook, powersgd_rank, powersgd_start_iter)
    ddp = build_ddp(model, "ddp", sync_batchnorm=sync_batchnorm, bucket_cap_mb=bucket_cap_mb,
                    static_graph=static_graph, find_unused_parameters=find_unused_parameters,
                    gradient_as_bucket_view=gradient_as_bucket_view, broadcast_buffers=broadcast_buffers)
    if comm_hook is not None:
        comm_hooks.register(ddp, comm_hook, powersgd_rank, powersgd_start_iter)
    return ddp
