"""A token loss that does not depend on how the step's batch is split: the global token count.

The mean of per-micro-batch means (each divided by the accumulation steps) is
one process's loss only when every micro-batch on every rank counts the same
number of targets. With padded or masked targets it weights a token by
``1 / (tokens in its micro-batch)``, so 1 and N ranks, or 2 and 8
micro-batches, train differently. Summing the loss and dividing by the
step's count of targets on every data-parallel rank is exact for any split
(torchtitan's scheme).

torchtitan divides by the global count and turns FSDP's averaging off
(``set_gradient_divide_factor(1.0)``). Here the gradient reduction keeps
averaging over the data-parallel ranks and the divisor folds that in
(``count / dp``): DDP, FSDP, HSDP and ZeRO reduce as they always do, fp16 and
bf16 reductions keep FSDP's pre-division (a plain sum can overflow), and
``NoiseScale``'s rank gradients stay per-rank means.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as tdist

from .errors import UsageError


def token_divisor(targets: Iterable[torch.Tensor], *, ignore_index: int = -100, group=None) -> torch.Tensor:
    """Divide each micro-batch's summed token loss by this (collective: every rank calls it, once per step).

    ``targets``: this rank's targets for every micro-batch of the step. The
    result is the step's count of targets other than ``ignore_index`` over
    all ranks (at least 1), divided by the world size: tensor-parallel and
    pipeline peers count the same targets, so this is the data-parallel
    ranks' mean count, and the averaged gradient is that of the summed loss
    of every counted token over their number. A float32 scalar on the
    targets' device: no host synchronisation.

    >>> tokens = mg.token_divisor([y for _, y in micro_batches])
    >>> for x, y in mg.accumulate(model, micro_batches):
    ...     (F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / tokens).backward()
    """
    targets = list(targets)
    if not targets or not all(isinstance(t, torch.Tensor) for t in targets):
        kinds = sorted({type(t).__name__ for t in targets}) or ["nothing"]
        raise UsageError(f"token_divisor needs the step's target tensors, one per micro-batch, got {', '.join(kinds)}; "
                         "pass [y for _, y in micro_batches]")
    count = sum((t != ignore_index).sum() for t in targets)
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size(group) > 1:
        device = count.device
        if tdist.get_backend(group) == "gloo":
            count = count.cpu()  # gloo reduces host tensors
        tdist.all_reduce(count, group=group)
        return count.clamp_(min=1).to(device, torch.float32) / tdist.get_world_size(group)
    return count.clamp_(min=1).to(torch.float32)
