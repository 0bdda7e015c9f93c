"""The DDP-shaped test: all-reduce a real model's gradient buckets, as DDP would, and time one step.

Buckets come from PyTorch's own assignment (``torch.distributed._compute_bucket_assignment_by_size``,
what DDP's Reducer uses) over the parameters in reverse order (the order
gradients become ready), with DDP's limits: 1 MiB for the first bucket,
``bucket_cap_mb`` (25) for the rest. The model is built on the meta device,
so only the buckets take memory.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn

from ..runtime import compat
from ..errors import UsageError
from .spec import BenchCommand, algbw, bus_factor


class _GPT(nn.Module):
    """GPT-2's parameter shapes (token + position embeddings, pre-LN blocks, tied head)."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, activation="gelu", batch_first=True, norm_first=True) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.ln_f(h) @ self.wte.weight.T  # tied output head


MODELS = {
    "gpt2-small": lambda: _GPT(50257, 1024, 768, 12, 12),  # 124 M parameters
    "gpt2-medium": lambda: _GPT(50257, 1024, 1024, 24, 16),  # 355 M
    "gpt2-tiny": lambda: _GPT(1000, 128, 128, 2, 4),  # 0.5 M, for quick checks
}


def build_meta_model(spec: str) -> nn.Module:
    """A built-in model name (gpt2-small, gpt2-medium, gpt2-tiny) or ``package.module:factory``."""
    if spec in MODELS:
        factory = MODELS[spec]
    elif ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as err:
            raise UsageError(f"--ddp {spec}: cannot import {attr!r} from {mod_name!r} ({err}); give package.module:factory") from None
    else:
        raise UsageError(f"--ddp {spec!r}: expected one of {', '.join(MODELS)} or package.module:factory")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--ddp {spec}: the factory returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def bucket_sizes(model: nn.Module, bucket_cap_mb: float = 25.0) -> list[int]:
    """Bytes per gradient bucket, in all-reduce order, as DDP's Reducer forms them after its first step."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError("the model has no trainable parameters, so DDP has nothing to all-reduce")
    rev = list(reversed(params))
    cap = int(bucket_cap_mb * 2**20)
    first = compat.ddp_first_bucket_bytes()
    limits = [first, cap] if first < cap else [cap]  # DDP's rule: a small first bucket only below the cap
    buckets = compat.ddp_bucket_assignment(rev, limits)
    return [sum(rev[i].numel() * rev[i].element_size() for i in b) for b in buckets]


@dataclass(frozen=True)
class DdpConfig:
    model: str = "gpt2-small"
    bucket_cap_mb: float = BenchCommand.bucket_cap_mb  # DDP's own 25 MiB, written once as --bucket-cap-mb's default
    warmup: int = 2
    iters: int = 10


def measure_ddp(cfg: DdpConfig, device, rank: int, n: int) -> dict:
    """Communication time of one DDP step (every bucket all-reduced, issued asynchronously as DDP does)."""
    from .measure import max_over_ranks, time_calls

    model = build_meta_model(cfg.model)
    sizes = bucket_sizes(model, cfg.bucket_cap_mb)
    dtype = next(model.parameters()).dtype
    elt = torch.empty(0, dtype=dtype).element_size()
    bufs = [torch.ones(max(1, s // elt), dtype=dtype, device=device) for s in sizes]

    def step():
        works = [tdist.all_reduce(b, async_op=True) for b in bufs]
        for w in works:
            w.wait()

    for _ in range(cfg.warmup):
        step()
    t = max_over_ranks(time_calls(step, cfg.iters, device), device)
    total = sum(sizes)
    alg = algbw(total, t)
    return {"model": cfg.model, "parameters": sum(p.numel() for p in model.parameters()), "gradient_bytes": total,
            "bucket_cap_mb": cfg.bucket_cap_mb, "buckets": sizes, "comm_ms_per_step": t * 1e3,
            "algbw": alg, "busbw": alg * bus_factor("all_reduce", n)}
