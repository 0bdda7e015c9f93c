"""A step's collectives, dimension by dimension, and what of them the compute hides (``exposed``)."""

from __future__ import annotations

import math

from .compute import micro_flops
from .hardware import Cluster
from .inputs import Assumptions, Rank

DDP_BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb
MEGATRON_BUCKET = (40e6, 1e6)  # Megatron-Core's default bucket: max(40M, 1M x dp) parameters


def communication_parts(r: Rank, cluster: Cluster, a: Assumptions, time: dict[str, float],
                        phases: tuple[float, float], rate: float) -> dict[int, float]:
    """Adds each dimension's collectives a step to ``time`` (seconds, what the compute does not hide) and returns
    their calls per group size. ``cluster.collective_s``: bus bandwidth of the span the group covers, or the
    measured links; ``phases``: a micro-batch's forward and backward seconds."""
    counts, t, p, c, e, m, run, blocks, tokens = r.counts, r.t, r.p, r.c, r.e, r.m, r.run, r.blocks, r.tokens
    calls: dict[int, float] = {}

    def coll(op: str, nbytes: float, n: int, span: int, count: float) -> float:
        if n <= 1 or count <= 0:
            return 0.0
        calls[n] = calls.get(n, 0.0) + count
        return cluster.collective_s(op, n, span, nbytes, count)

    if r.shards > 1:
        time["data-parallel collectives (exposed)"] = fsdp_exposed(r, cluster, phases, a.dp_overlap, calls)
    else:
        time["data-parallel collectives (exposed)"] = ddp_exposed(r, phases, a.dp_overlap, coll)
    if t > 1:
        time["tensor-parallel collectives"] = tp_collectives(r, coll) \
            * (1 - (a.async_tp_overlap if run.async_tp else 0.0))
    if e > 1:
        # Per MoE layer and micro-batch: the rows out and back (dispatch, combine), twice again in the backward
        # (and once more under full recompute), on the critical path; the group is ep consecutive ranks.
        moe = sum(1 for i in blocks if r.experts[i])
        rows = sum(counts.block_routed[i] for i in blocks) * tokens / t * a.expert_imbalance / max(moe, 1)
        again = sum(1 for i in r.recomputed if r.experts[i]) if run.recompute == "full" else 0
        time["expert all-to-all"] = coll("all_to_all", rows, e, e, m * (4 * moe + 2 * again))
    if c > 1:
        time["context-parallel ring (exposed)"] = ring_exposed(r, rate, coll)
    if p > 1:
        hop = tokens * counts.block_input / t
        slots = m + (p - 1) / r.v
        # To the next stage, world / p ranks on.
        time["pipeline send/recv"] = coll("send", hop, 2, cluster.gpus // p + 1, 2 * slots * r.v)
    return calls


def ring_exposed(r: Rank, rate: float, coll) -> float:
    """Seconds a step of PyTorch's ring attention (``context_parallel``'s SDPA dispatch, what ``mg.parallelize``
    runs for causal SDPA on CUDA) leaves exposed, block by block, as its default all-gather rotater runs it
    (torch's ``_templated_ring_attention``): the forward all-gathers the whole K and V once, issued as the local
    chunk's attention starts and waited for before the next chunk, so only that chunk (1/cp of the attention) hides
    it, and again where full recompute runs the forward twice; the backward gathers them again, hidden alike, and
    passes the K/V gradients round the ring (all-to-all, cp - 1 hops of a share: an all-gather's bytes), each hop
    under the next chunk's (the other (cp - 1)/cp of the backward's attention)."""
    counts, c, t, blocks = r.counts, r.c, r.t, r.blocks
    kv = sum(counts.block_kv[i] for i in blocks) * r.b * r.run.seq_len / t / len(blocks)  # a block's whole K, V
    calls = r.m * len(blocks)
    forwards = 1 + (len(r.recomputed) / len(blocks) if r.run.recompute == "full" else 0)  # a block's, on average
    gather = coll("all_gather", kv, c, c * t, calls * (forwards + 2)) / (calls * (forwards + 2))
    forward = micro_flops(counts, blocks, r.tokens, t, "none")[1] / 3 / len(blocks) / rate  # a block's, seconds
    backward = 2 * forward
    block = (forwards * max(0.0, gather - forward / c) + max(0.0, gather - backward / c)
             + max(0.0, gather - backward * (c - 1) / c))
    return calls * block


def ddp_exposed(r: Rank, phases: tuple[float, float], overlap: float, coll) -> float:
    """Seconds of a step's DDP (and ZeRO-1) collectives its compute does not hide (``exposed``), by ``coll(op, bytes,
    n, span, calls)``; ``phases``: a micro-batch's forward and backward seconds.

    DDP: the float32 gradients all-reduced, one 25 MiB bucket at a time, in the last micro-batch's backward
    (``mg.accumulate`` syncs only there; with sync "each" in every one's: ``Rank.reductions``), the last bucket
    exposed. ZeRO-1 as multigpu runs it (``mg.wrap``'s
    "zero1": DDP and ``ZeroRedundancyOptimizer``): that all-reduce, then, once the optimizer has stepped its shard,
    every rank broadcasts its shard of the float32 parameters, waited for before the step returns: all of it
    exposed, nothing computes beside it (counted as one all-gather of the parameters, the bytes each rank
    receives). ZeRO-1 as Megatron's distributed optimizer runs it with ``--overlap-grad-reduce
    --overlap-param-gather`` (``Run.overlap_param_gather``, a run multigpu does not make): its buckets of
    max(40M, 1M x dp) parameters reduce-scattered in float32 in that backward, and the 16-bit parameters
    all-gathered bucket by bucket under the next step's first forward, the first bucket exposed."""
    dp, span, params, k = r.dp, r.dp * r.c * r.t, r.held, r.reductions
    megatron = r.zero1 and r.run.overlap_param_gather
    size = 4.0 * max(MEGATRON_BUCKET[0], MEGATRON_BUCKET[1] * dp) if megatron else DDP_BUCKET
    buckets = max(1, math.ceil(4.0 * params / size))
    op = "reduce_scatter" if megatron else "all_reduce"
    bucket = coll(op, 4.0 * params / buckets, dp, span, k * buckets) / (k * buckets)
    s = k * exposed(buckets * bucket, bucket, phases[1], buckets, overlap)  # in each reducing micro-batch's backward
    if megatron:
        gather = coll("all_gather", r.width * params / buckets, dp, span, buckets) / buckets
        s += exposed(buckets * gather, gather, phases[0], buckets, overlap)
    elif r.zero1:
        s += coll("all_gather", 4.0 * params, dp, span, 1)
    return s


def exposed(comm: float, edges: float, compute: float, pieces: int, overlap: float) -> float:
    """Seconds of one phase's communication (``comm``) that its compute does not hide. The compute runs as
    ``pieces`` equal pieces (blocks, DDP's buckets) on one stream, the collectives in order on another; a piece's
    collective overlaps the other pieces' compute, never its own: what waits for the first piece or follows the last
    (``edges``: the first block's gather, the last block's or bucket's reduction) is exposed whatever the compute,
    and the rest hides under at most ``overlap`` x the compute of every piece but one. Exact for equal pieces where
    the compute or the collectives bound the phase (gathers only, or reductions only: the bound one's time plus one
    piece of the other), within a piece where they alternate."""
    return min(comm, max(edges, comm - overlap * compute * (1 - 1 / max(pieces, 1))))


def fsdp_exposed(r: Rank, cluster: Cluster, phases: tuple[float, float], overlap: float,
                 calls: dict[int, float]) -> float:
    """Seconds of a step's FSDP (and HSDP) collectives its compute does not hide, phase by phase (``exposed``), their
    calls added to ``calls`` by group size. FSDP's units: each of the stage's blocks' dense part and its experts (a
    unit of their own, over efsdp), and the root (tables, final norm, head: the stage's); ``phases``: a
    micro-batch's forward and backward seconds.

    Each micro-batch's forward gathers the root, then every block in turn: hidden under the forward only, the
    root's and the first block's exposed. Its backward gathers every block again (hidden under the backward, the
    first exposed); the last micro-batch's (``mg.accumulate`` syncs only there; with sync "each" every one's,
    ``Rank.reductions``) also reduce-scatters every unit in float32, each after its block's backward, and HSDP
    all-reduces each shard over the replicas after its reduce-scatter in the last: the first block's and the
    root's, after the backward's last piece, are exposed. A pipeline
    stage gathers once a step (its first micro-batch's forward) and reduces in its last micro-batch's backward."""
    t, p, f, ef, m, width, root = r.t, r.p, r.f, r.ef, r.m, r.width, r.root
    units = [(r.dense_of(i), r.gathered_bytes(i, r.dense_of(i)), r.experts[i] / r.e) for i in r.blocks]
    replicas = r.layout.dp_replicate

    def one(op: str, nbytes: float, n: int, over: int = 1) -> float:  # one call's seconds; the span f x t (x replicas)
        return cluster.collective_s(op, n, over * f * t, nbytes)

    def reduced(size: float, n: int, last: bool = True) -> float:  # a unit's float32 gradient reduce-scattered,
        # its shard all-reduced over the replicas (HSDP) in the step's last micro-batch
        return one("reduce_scatter", 4.0 * size, n) + (one("all_reduce", 4.0 * size / n, replicas, replicas) if last
                                                       else 0.0)

    gathers = [one("all_gather", nbytes, f) + one("all_gather", width * x, ef) for _, nbytes, x in units]
    reduces = [reduced(size, f) + reduced(x, ef) for size, _, x in units]
    # A rank holding neither end (a middle pipeline rank) has no root unit: FSDP issues nothing for it.
    g_root, r_root = (one("all_gather", width * root, f), reduced(root, f)) if root else (0.0, 0.0)
    rounds = m if p == 1 else 1  # forwards that gather; a pipeline stage keeps its weights gathered
    passes = 2 * rounds if p == 1 else 1  # each block's gathers a step
    again = (sum(gathers), max(gathers)) if p == 1 else (0.0, 0.0)  # the backward's gathers, the first exposed
    n, moe = len(units), sum(x > 0 for _, _, x in units)
    ends, k = (1 if root else 0), r.reductions  # k: the micro-batches that reduce-scatter (sync "each": every one)
    for size, count in ((f, n * passes + rounds * ends + k * (n + ends)), (ef, moe * (passes + k)),
                        (replicas, n + ends + moe)):
        if size > 1 and count:
            calls[size] = calls.get(size, 0.0) + count
    # The backwards that reduce-scatter before the last (sync "each"), without HSDP's all-reduce, which waits for it.
    early = [reduced(size, f, False) + reduced(x, ef, False) for size, _, x in units]
    r_early = reduced(root, f, False) if root else 0.0
    fwd, bwd = phases
    return (rounds * exposed(g_root + sum(gathers), g_root + max(gathers), fwd, n, overlap)
            + (k - 1) * exposed(again[0] + sum(early) + r_early, again[1] + max(early) + r_early, bwd, n, overlap)
            + (rounds - k) * exposed(again[0], again[1], bwd, n, overlap)
            + exposed(again[0] + sum(reduces) + r_root, again[1] + max(reduces) + r_root, bwd, n, overlap))


def tp_collectives(r: Rank, coll) -> float:
    """Seconds of a step's tensor-parallel collectives on rank ``r``, as PyTorch's plans issue them, each moving a
    micro-batch's hidden states (``coll(op, bytes, n, span, calls)``). With sequence parallelism, per sub-layer
    an all-gather in and a reduce-scatter out, mirrored in the backward; without, an all-reduce after each
    row-wise linear (one per sub-layer) and, in the backward, one of each column-wise linear's input gradient
    (q, k and v each one); under fp8 TP gathers (``Run.fp8_tp_all_gather``) the sub-layers' gathers carry 1 byte an
    element. Full recompute runs the forward's again; selective (torchtitan's op policy, which
    saves the reduce-scatters' outputs and not the all-gathers') gathers each sub-layer's input again, for the
    recomputed matmuls and the weight gradients that read it (without sequence parallelism, what that policy
    runs again of the all-reduces is not counted: torchtitan runs TP with it). The token table's output is reduced
    on the rank of the first stage; on the rank of the last the head's input gathered (SP) or its gradient reduced,
    and the logits gathered unless the loss is parallel."""
    counts, layout, blocks, tokens, m, run = r.counts, r.layout, r.blocks, r.tokens, r.m, r.run
    t, head = layout.tp, int(r.holds_last)
    act = tokens * counts.block_input
    forwards = len(blocks) + (len(r.recomputed) if run.recompute == "full" else 0)  # of a block, of the blocks
    if layout.sequence_parallel:
        each = 2 * (forwards + len(blocks))  # all-gathers, as many reduce-scatters
        again = 2 * len(r.recomputed) if run.recompute == "selective" else 0  # selective: the inputs re-gathered
        # The sub-layers' inputs 1 byte an element under fp8 TP gathers; the head's input (not fp8) 16-bit.
        gather = act / counts.dtype_bytes if run.fp8_tp_all_gather else act
        s = coll("all_gather", gather, t, t, m * (each + again)) + coll("all_gather", act, t, t, m * head) \
            + coll("reduce_scatter", act, t, t, m * (each + head))
        if r.holds_first:
            s += coll("all_reduce", act, t, t, m) + coll("all_gather", act, t, t, m)  # the table's, its gradient
    else:
        colwise = sum(max(counts.block_linears[i] - 2, 0) for i in blocks)  # all but the 2 row-wise
        reduces = 2 * forwards + colwise + head + int(r.holds_first)  # + head, table
        s = coll("all_reduce", act, t, t, m * reduces)
    if not run.loss_parallel and counts.vocab and head:
        s += coll("all_gather", tokens * counts.vocab * counts.dtype_bytes, t, t, m)
    return s
