"""Memory per GPU and step time of one layout of a counted model on a cluster: the formulas, each part named.

Each pipeline rank is forecast on the stages ``mg.parallel.pipeline`` gives it (``Rank``: the library's split,
``stages.stage_ranges``, the embeddings and the head a block each, and placement, ``pp.stage_ids``): its blocks, the
token table where it holds the first stage, the head (a tied table's copy), final norm and loss where it holds the
last. The step is the slowest rank's, the memory the fullest's; without a pipeline the one rank holds everything.

Memory per GPU (bytes), on the rank that holds the most:
- parameters, gradients, optimizer: fp32 weights, fp32 gradients and AdamW's two fp32 moments (4 + 4 + 8
  bytes per parameter, ZeRO's 16 with the 16-bit copy counted under buffers), of what tensor and pipeline
  parallelism leave the rank, divided over the ranks FSDP shards across (dp_shard x cp; DDP: 1); ZeRO-1 (DDP's
  ``zero1``) divides the optimizer's moments alone over the data-parallel ranks;
- buffers: the 16-bit weights FSDP gathers (the float8 linears' in fp8 under ``Run.fp8_all_gather``; two blocks in
  flight: the one computing and the prefetch; the root unit, tables and head, for the whole step), one block's
  unsharded gradient (every block's, in float32, when micro-batches accumulate: the reduce-scatter waits for the
  last) and the float32 reduce-scatter input FSDP2 keeps of the block before; a pipeline stage keeps all its
  weights gathered and gradients unsharded; DDP's gradient buckets (a float32 copy);
- activations: the bytes autograd saves per token and block (``counts``) x tokens per micro-batch / (tp x cp)
  (cp cuts every saved tensor, tp all but the sub-layers' inputs and, without sequence parallelism, what the
  norms save: ``saved_under_tp``), for the rank's blocks and the micro-batches in flight as torch's schedules warm
  up (1; 1F1B p - k on rank k; v stages a rank ((v - 1) min(m, p) + 2 (p - 1 - k) + 1) / v, rank 0's p (1 +
  (p-1)/(p v)); never above m; GPipe m: ``memory.micro_batches_in_flight``); full recompute keeps the block
  input, selective the input, attention's outputs and every other matmul's output (of the first
  ``checkpoint_blocks`` of each stage where the layout gives it: the others keep all, ``Rank.recomputed``); one
  block's backward at a time adds its gradients in flight (counted on fake tensors) and what recompute makes again
  (less what the kept blocks after it have freed by then);
  the rank of the last stage adds the embedding output, the logits and the loss's float32 copy (a compiled loss:
  the 16-bit logits), twice: the backward starts by making their gradients while all of the above is still held;
  they are freed before the last block's backward (the larger of the two counts);
- optimizer step: where the step's own peak tops the backward's (small activations): the states, DDP's
  buckets and foreach AdamW's float32 temporary of what it steps (4 bytes per parameter);
- allocator: what PyTorch's caching allocator reserves beyond the live tensors (fragmentation), as a
  fraction of them (``Assumptions.allocator_overhead``; published peaks are reserved bytes), and the loss's
  freed blocks it keeps under the last block's backward (``Assumptions.reserved``; tune measures live tensors);
- runtime: the CUDA context, NCCL's buffers and cuBLAS's workspace (``Assumptions.runtime_gib``).

A mixture of experts under ``ep`` (as ``mg.parallelize`` spreads it: ep takes every tp rank and ep / tp of
dp_shard): each rank holds 1/ep of the experts, whole, their states sharded by FSDP over efsdp = dp_shard x
tp / ep; each tp rank routes its share (1/tp) of the tokens, the busiest rank ``expert_imbalance`` x the
mean; the dispatch's all-to-all (the top-k rows out and back, twice again in the backward) is exposed.

Step time: compute (FLOPs / (peak x achieved fraction)), recompute included, of the rank's blocks (the head's
FLOPs on the rank of the last stage only), the pipeline's bubble, (p-1)/v of that rank's micro-batches (where
ranks share cores, ``Cluster.slowdown``, only what the critical path adds beyond every rank's work); the
collectives by the alpha-beta model with nccl-tests' bus bandwidth of the link the group spans, exposed as
``Assumptions`` says (data-parallel traffic phase by phase, ``exposed``: FSDP's gathers under the forward and
the backward they feed, its reduce-scatters and DDP's all-reduce under the last micro-batch's backward, each up to
``dp_overlap`` of that phase's compute, the first gather and the last reduction never; ZeRO-1's parameter broadcast
after the optimizer step not at all, ``comm.ddp_exposed``; tensor-parallel not, cp's
ring as torch's all-gather rotater overlaps it, ``comm.ring_exposed``); the optimizer step (of what the rank steps: ZeRO-1's shard) by HBM bandwidth; and, for a machine whose ``Overheads`` are
measured, the wrapper's work per micro-batch and step and each collective's wait (counted per group size).
"""

from __future__ import annotations

from ..parallel.layout import Layout
from .comm import DDP_BUCKET, communication_parts, exposed
from .compute import float8_flops, micro_flops
from .counts import Counts
from .hardware import Cluster
from .inputs import GiB, Assumptions, Degrees, Overheads, Rank, Run
from .memory import memory_parts, saved_under_tp

# Degrees: deprecated for one release (mg.parallel.Layout), kept importable from here.
__all__ = ["GiB", "DDP_BUCKET", "WORK", "Assumptions", "Degrees", "Overheads", "Run", "predict", "exposed",
           "saved_under_tp"]
WORK = ("compute", "pipeline bubble", "optimizer")  # a step's parts that are work, not transfers


def predict(counts: Counts, cluster: Cluster, layout: Layout, run: Run, a: Assumptions,
            overheads: Overheads | None = None) -> dict:
    """The forecast of one layout: {"memory": parts (bytes), "time": parts (s), "step_s", "tokens_per_s_per_gpu",
    "mfu", "memory_bytes", "allocated_bytes", "fits", "collectives": {group size: calls per step}, "slowest_rank",
    "fullest_rank"}.
    ``layout`` is resolved (every degree given) and has its micro-batch; one multigpu does not build yet
    (``Layout.unbuilt``: published runs' cp beside a pipeline, ZeRO-1 beside tp or pp) is forecast as described.
    Each pipeline rank is forecast on its own stages (``Rank``): the step waits for the slowest (its time, its
    collectives), memory is the fullest's."""
    ranks = [rank_forecast(Rank(counts, layout, run, k), cluster, a, overheads) for k in range(layout.pp)]
    slowest = max(range(layout.pp), key=lambda k: ranks[k]["step_s"])
    fullest = max(range(layout.pp), key=lambda k: ranks[k]["memory_bytes"])
    step, total = ranks[slowest]["step_s"], ranks[fullest]["memory_bytes"]
    tps = run.global_batch * run.seq_len / step / cluster.gpus
    # What the caching allocator reserves (``Assumptions.reserved``: what runs out, what torchtitan's log line prints),
    # and the tensors' own peak under it (torch.cuda.max_memory_allocated's; the runtime's term in both), each the
    # most over the ranks: the allocator's part differs by rank (the loss's freed blocks sit on the last stage's).
    allocated = max(rk["memory_bytes"] - rk["memory"]["allocator"] for rk in ranks)
    return {"memory": ranks[fullest]["memory"], "memory_bytes": total, "allocated_bytes": allocated,
            "fits": total <= cluster.gpu.hbm_bytes,
            "time": ranks[slowest]["time"], "step_s": step, "tokens_per_s_per_gpu": tps,
            "collectives": ranks[slowest]["collectives"], "slowest_rank": slowest, "fullest_rank": fullest,
            "mfu": tps * counts.flops_per_token / cluster.peak("bf16")}  # against bf16's peak, fp8 or not


def rank_forecast(r: Rank, cluster: Cluster, a: Assumptions, overheads: Overheads | None) -> dict:
    """One pipeline rank's {"memory": parts, "memory_bytes", "time": parts, "step_s", "collectives"}."""
    memory = memory_parts(r, a)
    time, micro_s, fwd_s, rate = compute_parts(r, cluster, a)
    calls = communication_parts(r, cluster, a, time, (fwd_s, micro_s - fwd_s), rate)
    time["optimizer"] = a.optimizer_bytes * r.stepped / cluster.gpu.hbm_bandwidth
    # The gradient norm's all-reduce over each dimension the parameters are cut along, the step's token count.
    for n in (r.f, r.t, r.p, cluster.gpus):
        if n > 1:
            calls[n] = calls.get(n, 0.0) + 1
    if overheads is not None:
        time["fixed costs"] = fixed_costs(r, cluster, overheads, time, calls)
    return {"memory": memory, "memory_bytes": sum(memory.values()), "time": time, "step_s": sum(time.values()),
            "collectives": calls}


def compute_parts(r: Rank, cluster: Cluster, a: Assumptions) -> tuple[dict[str, float], float, float, float]:
    """({"compute", "pipeline bubble"}: seconds a step, a micro-batch's seconds, its forward's, the FLOP/s): the
    stage's training FLOPs, recompute added, at the achieved rate (a measured machine's own rate for this
    micro-batch)."""
    run, m, p = r.run, r.m, r.p
    rate = cluster.rate(r.b, run.recompute)
    if rate is None:  # a described GPU: its peak at the calibrated fraction
        rate = cluster.peak("bf16") * a.efficiency * (a.compile_speedup if run.compile else 1.0)
    # fp8: the matmuls of the layers float8 converts (counted with the choice ``mg.Precision("fp8")`` makes) run
    # fp8_speedup x faster; the rest (layers left out, attention) as in bf16.

    def seconds(recompute: str) -> float:  # a micro-batch's forward and backward, that recompute's forward included
        imbalance = a.expert_imbalance if r.e > 1 else None
        matmul, attention = micro_flops(r.counts, r.blocks, r.tokens, r.t, recompute, imbalance, r.recomputed,
                                        head=r.holds_last)  # the head's FLOPs on the last stage's rank alone
        fast = float8_flops(r.counts, r.blocks, r.tokens, r.t, recompute, r.recomputed, head=r.holds_last) \
            if run.precision == "fp8" else 0.0
        return (matmul - fast + fast / a.fp8_speedup + attention) / rate

    micro_s = seconds(run.recompute)
    fwd_s = seconds("none") / 3  # the forward: a third of the FLOPs without recompute (the backward twice it)
    time = {"compute": m * micro_s}
    if p > 1:
        # The critical path is m + (p-1)/v micro-batches; where ranks share cores (``cluster.slowdown``), a stage
        # runs faster than micro_s while others sit in the bubble, so the step is the longer of that path at full
        # speed and every rank's work over the cores (m micro-batches at the shared rate).
        time["pipeline bubble"] = max(0.0, (m + (p - 1) / r.v) / cluster.slowdown - m) * micro_s
    return time, micro_s, fwd_s, rate


def fixed_costs(r: Rank, cluster: Cluster, overheads: Overheads, time: dict[str, float],
                calls: dict[int, float]) -> float:
    """Seconds a measured machine adds a step: the wrapper's work, and each collective's wait. A collective waits
    for its group's slowest rank, the longer the more work since the last (the step's work, the wrapper's too,
    shared evenly between its collectives). Blocks that issue collectives along two mesh dimensions (HSDP: a unit's
    reduce-scatter among its shards, at once its all-reduce among the replicas; FSDP x TP, CP, EP) chain their
    groups into one of all the ranks; a pipeline's stages meet at sends (the bubble)."""
    work = r.m * overheads.micro_s * (len(r.blocks) / r.layers) + overheads.step_s  # the rank's share of the blocks
    gap = (work + sum(v for k, v in time.items() if k in WORK)) / max(1.0, sum(calls.values()))
    crossed = sum(d > 1 for d in (r.layout.dp_replicate, r.layout.dp_shard, r.t, r.c, r.e)) > 1
    return work + sum(k * overheads.wait(cluster.gpus if crossed else n, gap) for n, k in calls.items())
