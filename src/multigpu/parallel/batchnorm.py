"""BatchNorm under data parallelism: SyncBatchNorm conversion and the small-batch warning.

Plain BatchNorm normalises each rank's micro-batch with that rank's own
statistics, so N ranks x batch b optimise a different loss than one process
with batch N*b (and a noisier one when b is small). ``sync_batchnorm=True``
turns every BatchNorm layer into PyTorch's ``nn.SyncBatchNorm``, whose
statistics cover the whole global micro-batch.

PyTorch's SyncBatchNorm runs on GPUs only: its kernels
(``torch.batch_norm_stats`` and friends) have no CPU implementation and its
forward raises for CPU input. On CPU (gloo) the converted layers use
``GlooSyncBatchNorm`` below instead, which computes the same statistics with
two differentiable all-reduces, so CPU runs and tests train the same model
the GPUs would.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as tdist
from torch import nn

from ..runtime.compat import batchnorm_base

_BatchNorm = batchnorm_base()

# Below this many samples per rank, per-rank BatchNorm statistics are noisy
# enough to change training (Goyal et al. 2017, sec. 5.3 use 32 per worker;
# Wu & He 2018, Group Normalization, fig. 1: error rises sharply below 16).
SMALL_BN_BATCH = 16


class GlooSyncBatchNorm(_BatchNorm):
    """``nn.SyncBatchNorm`` for CPU tensors: global mean and variance by all-reduce.

    Not a subclass of ``nn.SyncBatchNorm``: DDP refuses those on CPU modules.

    The all-reduces come from ``torch.distributed.nn.functional``, whose
    backward all-reduces the gradients of the statistics, which is what
    SyncBatchNorm's CUDA backward does. Two passes (sum, then sum of squared
    deviations) avoid the cancellation of ``E[x^2] - E[x]^2`` in fp32.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: tdist.ProcessGroup | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Module's name
        self._check_input_dim(input)
        group = self.process_group or tdist.group.WORLD
        distributed = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size(group) > 1
        if not (self.training and distributed):
            return _BatchNorm.forward(self, input)  # plain BatchNorm: eval, or a single process
        import torch.distributed.nn.functional as dist_fn  # differentiable collectives; imported on first use

        # Statistics in fp32 for a bf16/fp16 input (autocast's), as nn.BatchNorm keeps them: a bf16 count or
        # sum rounds to 8 bits, and lerp_ into the fp32 running buffers refuses a bf16 mean.
        x = input.float() if input.dtype in (torch.bfloat16, torch.float16) else input
        dims = [0] + list(range(2, x.dim()))
        channels = x.shape[1]
        count = torch.tensor([x.numel() // channels], dtype=x.dtype, device=x.device)
        total = dist_fn.all_reduce(torch.cat([x.sum(dims), count]), group=group)
        n = total[-1]
        mean = total[:channels] / n
        shape = [1, channels] + [1] * (x.dim() - 2)
        centred = x - mean.view(shape)
        var = dist_fn.all_reduce((centred * centred).sum(dims), group=group) / n
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach(), factor)
                # Running variance is unbiased, as in nn.BatchNorm / nn.SyncBatchNorm.
                self.running_var.lerp_(var.detach() * n / (n - 1).clamp(min=1), factor)
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm*d in ``model`` becomes a SyncBatchNorm (GlooSyncBatchNorm on CPU)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if device.type == "cpu":
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                # Same attributes, parameters, buffers and state_dict keys
                # (PyTorch's conversion copied them); only forward differs.
                module.__class__ = GlooSyncBatchNorm
    return model


_SYNCED = (nn.SyncBatchNorm, GlooSyncBatchNorm)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers with per-rank statistics."""
    return any(isinstance(m, _BatchNorm) and not isinstance(m, _SYNCED) for m in model.modules())


def warn_small_batchnorm(model: nn.Module, strategy: str) -> None:
    """Warn once if a BatchNorm layer trains on fewer than SMALL_BN_BATCH samples per rank.

    Registered only when the job has several ranks and the layers were not
    converted: a hook sees the real micro-batch, which ``wrap`` cannot know.
    """
    handles = []
    warned = []

    def check(module: nn.Module, args: tuple) -> None:
        if warned or not module.training or not args or not isinstance(args[0], torch.Tensor):
            return
        batch = args[0].shape[0]
        if batch < SMALL_BN_BATCH:
            warned.append(True)
            for h in handles:
                h.remove()
            warnings.warn(
                f"{type(module).__name__} trains on a per-rank micro-batch of {batch} (< {SMALL_BN_BATCH}) with "
                "per-rank statistics, so the loss differs from one process on the global batch; use "
                f"mg.wrap(model, {strategy!r}, sync_batchnorm=True) or a per-rank micro-batch of at least {SMALL_BN_BATCH}",
                stacklevel=2,
            )

    for module in model.modules():
        if isinstance(module, _BatchNorm) and not isinstance(module, _SYNCED):
            handles.append(module.register_forward_pre_hook(check))


def prepare_batchnorm(model: nn.Module, strategy: str, sync: bool, device: torch.device) -> nn.Module:
    """Convert to SyncBatchNorm if asked; otherwise arm the small-batch warning on multi-rank jobs."""
    if sync:
        return convert_sync_batchnorm(model, device)
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1 and has_batchnorm(model):
        warn_small_batchnorm(model, strategy)
    return model
