"""A micro-batch's training FLOPs of a counted model: its matmuls, its attention, and float8's share."""

from __future__ import annotations

from .counts import Counts

REDO = {"none": 0.0, "selective": 0.5, "full": 1.0}  # forwards of a recomputed block's matmuls run again


def micro_flops(counts: Counts, blocks, tokens: float, t: int, recompute: str,
                imbalance: float | None = None, recomputed=None, head: bool = True) -> tuple[float, float]:
    """(matmul, attention) training FLOPs of one micro-batch of ``tokens`` tokens through ``blocks`` and the head
    on one of ``t`` tensor-parallel ranks, the recomputed forwards included: of the blocks in ``recomputed`` (None:
    every one; the others run as without recompute); the head's only with ``head`` (a pipeline's last stage runs it).
    A mixture of experts' routed rows: under ep (``imbalance``
    given) each tp rank routes its share, the busiest rank ``imbalance`` x the mean; without, every tp rank runs
    them all (``mg.parallelize`` keeps the experts whole)."""
    again, kept = _split(blocks, recomputed)
    mm_again, at_again = _block_flops(counts, again, tokens, t, imbalance)
    mm_kept, at_kept = _block_flops(counts, kept, tokens, t, imbalance)
    # Kept blocks add 0.0 where every block is recomputed: the sums are those of one set, to the bit.
    matmul = (3 + REDO[recompute]) * mm_again + 3 * mm_kept + (3 * counts.other_flops * tokens / t if head else 0.0)
    redo_attention = 1.0 if recompute == "full" else 0.0  # selective keeps its output
    attention = (3 + redo_attention) * at_again * tokens / t + 3 * at_kept * tokens / t
    return matmul, attention


def float8_flops(counts: Counts, blocks, tokens: float, t: int, recompute: str, recomputed=None,
                 head: bool = True) -> float:
    """Of ``micro_flops``' matmuls, those of the Linear layers float8 converts (``counts`` counted with an fp8
    choice; experts stay 16-bit, ``parallel/float8.py``)."""
    if not counts.fp8:
        raise ValueError("float8_flops needs counts made with an fp8 choice (count(..., fp8=...))")
    again, kept = _split(blocks, recomputed)
    return ((3 + REDO[recompute]) * sum(counts.block_fp8[i] for i in again) * tokens / t
            + 3 * sum(counts.block_fp8[i] for i in kept) * tokens / t
            + (3 * counts.other_fp8 * tokens / t if head else 0.0))


def _split(blocks, recomputed) -> tuple[list, list]:
    """(the blocks recomputed, the blocks that keep their activations), each in ``blocks``' order."""
    if recomputed is None:
        return list(blocks), []
    chosen = set(recomputed)
    return [i for i in blocks if i in chosen], [i for i in blocks if i not in chosen]


def _block_flops(counts: Counts, blocks, tokens: float, t: int, imbalance: float | None) -> tuple[float, float]:
    """(a forward's matmul FLOPs of ``blocks`` on one tp rank, routed rows included; their attention's FLOPs per token)."""
    expert_flops = sum(counts.block_expert_flops[i] for i in blocks) if counts.block_expert_flops else 0.0
    flops_mm = sum(counts.block_flops[i] - counts.block_attention[i] for i in blocks) - expert_flops
    routed = expert_flops * tokens / t * imbalance if imbalance is not None else expert_flops * tokens
    return flops_mm * tokens / t + routed, sum(counts.block_attention[i] for i in blocks)
