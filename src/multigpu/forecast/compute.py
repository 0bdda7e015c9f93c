"""A micro-batch's training FLOPs of a counted model: its matmuls, its attention, and float8's share."""

from __future__ import annotations

from .counts import Counts


def micro_flops(counts: Counts, blocks, tokens: float, t: int, recompute: str,
                imbalance: float | None = None) -> tuple[float, float]:
    """(matmul, attention) training FLOPs of one micro-batch of ``tokens`` tokens through ``blocks`` and the head
    on one of ``t`` tensor-parallel ranks, the recomputed forwards included. A mixture of experts' routed rows:
    under ep (``imbalance`` given) each tp rank routes its share, the busiest rank ``imbalance`` x the mean;
    without, every tp rank runs them all (``mg.parallelize`` keeps the experts whole)."""
    expert_flops = sum(counts.block_expert_flops[i] for i in blocks) if counts.block_expert_flops else 0.0
    flops_mm = sum(counts.block_flops[i] - counts.block_attention[i] for i in blocks) - expert_flops
    flops_at = sum(counts.block_attention[i] for i in blocks)
    redo = {"none": 0.0, "selective": 0.5, "full": 1.0}[recompute]  # forwards of the blocks run again
    routed = expert_flops * tokens / t * imbalance if imbalance is not None else expert_flops * tokens
    matmul = (3 + redo) * (flops_mm * tokens / t + routed) + 3 * counts.other_flops * tokens / t
    attention = (3 + (1.0 if recompute == "full" else 0.0)) * flops_at * tokens / t  # selective keeps its output
    return matmul, attention


def float8_flops(counts: Counts, blocks, tokens: float, t: int, recompute: str) -> float:
    """Of ``micro_flops``' matmuls, those of the Linear layers float8 converts (``counts`` counted with an fp8
    choice; experts stay 16-bit, ``parallel/float8.py``)."""
    if not counts.fp8:
        raise ValueError("float8_flops needs counts made with an fp8 choice (count(..., fp8=...))")
    redo = {"none": 0.0, "selective": 0.5, "full": 1.0}[recompute]
    return (3 + redo) * sum(counts.block_fp8[i] for i in blocks) * tokens / t + 3 * counts.other_fp8 * tokens / t


