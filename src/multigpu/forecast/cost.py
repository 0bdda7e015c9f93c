"""Memory per GPU and step time of one layout of a counted model on a cluster: the formulas, each part named.

Memory per GPU (bytes), on the stage that holds the most:
- parameters, gradients, optimizer: fp32 weights, fp32 gradients and AdamW's two fp32 moments (4 + 4 + 8
  bytes per parameter, ZeRO's 16 with the 16-bit copy counted under buffers), of what tensor and pipeline
  parallelism leave the rank, divided over the ranks FSDP shards across (dp_shard x cp; DDP: 1);
- buffers: the 16-bit weights FSDP gathers (two blocks in flight: the one computing and the prefetch; the
  root unit, tables and head, for the whole step) and one block's unsharded float32 gradient; a pipeline
  stage keeps all its weights gathered and gradients unsharded;
- activations: the bytes autograd saves per token and block (``counts``) x tokens per micro-batch / (tp x cp)
  (sequence parallelism and cp cut every saved tensor), for the blocks of the stage and the micro-batches in
  flight (1; 1F1B p on the first stage, x (1 + (p-1)/(p v)) interleaved; GPipe m); full recompute keeps the
  block input and one block's working set, selective the input, attention's outputs and every other matmul's
  output; the last stage adds the embedding output, the logits and the loss's float32 copy, twice: the
  backward starts by making their gradients while all of the above is still held;
- allocator: what PyTorch's caching allocator reserves beyond the live tensors (fragmentation), as a
  fraction of them (``Assumptions.allocator_overhead``; published peaks are reserved bytes);
- runtime: the CUDA context, NCCL's buffers and cuBLAS's workspace (``Assumptions.runtime_gib``).

A mixture of experts under ``ep`` (as ``mg.parallelize`` spreads it: ep takes every tp rank and ep / tp of
dp_shard): each rank holds 1/ep of the experts, whole, their states sharded by FSDP over efsdp = dp_shard x
tp / ep; each tp rank routes its share (1/tp) of the tokens, the busiest rank ``expert_imbalance`` x the
mean; the dispatch's all-to-all (the top-k rows out and back, twice again in the backward) is exposed.

Step time: compute (FLOPs / (peak x achieved fraction)), recompute included, the pipeline's bubble; the
collectives by the alpha-beta model with nccl-tests' bus bandwidth of the link the group spans, exposed as
``Assumptions`` says (data-parallel traffic hidden under compute up to ``dp_overlap``, tensor-parallel not,
cp's ring under attention); the optimizer step by HBM bandwidth; and, for a machine whose ``Overheads`` are
measured, the wrapper's work per micro-batch and step and each collective's wait (counted per group size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..parallel.layout import Layout
from ..parallel.pp import stages_per_rank
from .counts import Counts
from .hardware import Cluster

GiB = 2**30


@dataclass(frozen=True)
class Assumptions:
    """Every constant a forecast rests on; each is a flag of ``multigpu forecast`` and named in its output.
    ``efficiency`` and the two speedups come from a calibration set (``tables/calibration.json``)."""

    efficiency: float = 0.45         # achieved fraction of the dense bf16 peak in eager mode
    compile_speedup: float = 1.0     # compute time / this with torch.compile
    fp8_speedup: float = 1.0         # matmul time / this with fp8 matmuls (attention stays 16-bit)
    dp_overlap: float = 1.0          # fraction of compute under which data-parallel collectives hide
    async_tp_overlap: float = 0.5    # fraction of tensor-parallel traffic async TP hides
    runtime_gib: float = 2.0         # CUDA context, NCCL buffers, cuBLAS workspace per GPU
    allocator_overhead: float = 0.0  # what the caching allocator reserves beyond the tensors, x their bytes
    optimizer_bytes: float = 36.0    # HBM bytes AdamW moves per held parameter (read/write fp32 p, g, m, v)
    expert_imbalance: float = 1.0    # the busiest expert-parallel rank's routed rows over the mean (1: balanced)
    calibration: str = "none"


@dataclass(frozen=True)
class Degrees:
    """A layout's degrees, as ``mg.parallel.Layout`` names them, for layouts the library does not build yet
    (published ones: cp with a pipeline); a resolved ``Layout`` serves as well."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    micro_batch: int
    schedule: str = "1f1b"
    ep: int = 1


@dataclass(frozen=True)
class Overheads:
    """Seconds a machine spends beyond its FLOPs and bytes, for one layout, where they are measured (tune's
    probe on this machine: the wrapper's work per micro-batch and per step, what one collective among n
    ranks waits in a busy step; ``benchmarks/forecast_cpu.py``). A cluster described by spec figures has none."""

    micro_s: float = 0.0
    step_s: float = 0.0
    wait_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """What a forecast needs besides the layout: the training's shape and the kernels' options."""

    global_batch: int                # sequences per step
    seq_len: int
    recompute: str = "none"          # none, selective, full
    compile: bool = False
    precision: str = "bf16"          # bf16 or fp8 (matmuls)
    async_tp: bool = False


def predict(counts: Counts, cluster: Cluster, layout: Layout | Degrees, run: Run, a: Assumptions,
            overheads: Overheads | None = None) -> dict:
    """The forecast of one layout: {"memory": parts (bytes), "time": parts (s), "step_s", "tokens_per_s_per_gpu",
    "mfu", "memory_bytes", "fits", "collectives": {group size: calls per step}}. ``layout`` is resolved (every
    degree given) and has its micro-batch."""
    t, p, c, f, e = layout.tp, layout.pp, layout.cp, layout.dp_shard * layout.cp, layout.ep
    dp = layout.dp_replicate * layout.dp_shard
    b = layout.micro_batch
    m = run.global_batch // (dp * b)
    v = stages_per_rank(layout.schedule) if p > 1 else 1
    L = counts.layers
    per_stage = -(-L // p)  # the largest stage's blocks
    blocks = sorted(range(L), key=lambda i: counts.block_params[i], reverse=True)[:per_stage]
    tokens = b * run.seq_len / c  # per micro-batch on this rank (before tp, which shares them)
    width = counts.dtype_bytes

    # Parameters this rank's TP/PP position owns; the largest stage (the first holds the table, the last the head).
    # A mixture of experts' experts: 1/ep of them, whole (ep spans the tp ranks), FSDP-sharded over what ep
    # leaves of dp_shard (efsdp); everything else over dp_shard x cp.
    experts = [counts.block_experts[i] if counts.block_experts else 0 for i in range(L)]
    block_held = sum((counts.block_sharded[i] - experts[i]) / t + counts.block_params[i] - counts.block_sharded[i]
                     for i in blocks)
    experts_held = sum(experts[i] for i in blocks) / e
    first = counts.embed_params / t  # TP cuts the tables; a tied table's copy sits on the last stage too
    last = (counts.embed_params if counts.tied and p > 1 else counts.head_params) / t + counts.other_params
    dense = block_held + (max(first, last) if p > 1 else first + last)
    held = dense + experts_held
    shards = f  # FSDP shards over dp_shard x cp; DDP (both 1) keeps whole states
    ef = f // (e // t if e > 1 else 1)  # efsdp: ep takes every tp rank and ep / tp of dp_shard (Layout.ep_dp)
    stored = dense / f + experts_held / ef  # the states' parameters per rank
    biggest = max((counts.block_params[i] - experts[i]) / t + experts[i] / e for i in range(L))
    memory = {"parameters": 4.0 * stored, "gradients": 4.0 * stored, "optimizer": 8.0 * stored}
    # A pipeline stage keeps its weights gathered and its gradients unsharded in float32 across the
    # micro-batches (PyTorch's pipelining turns FSDP's resharding and gradient sync off until the last).
    # Without a pipeline FSDP's root unit (tables, final norm, head) stays gathered from the forward's first
    # op to the backward's last (FSDP2 does not reshard the root after the forward).
    gathered = (width + 4.0) * held if p > 1 else (width * 2 + 4.0) * biggest + width * (first + last)
    memory["buffers"] = gathered if shards > 1 else 0.0
    per_block = {"none": [counts.block_saved[i] for i in blocks],
                 "selective": [counts.block_input + counts.block_kept[i] for i in blocks],
                 "full": [counts.block_input] * len(blocks)}[run.recompute]
    stage_bytes = sum(per_block) * tokens / t
    if run.recompute == "full":
        stage_bytes += max(counts.block_saved) * tokens / t  # the block being recomputed
    interleaving = (1 + (p - 1) / (p * v)) if v > 1 else 1.0
    in_flight = 1.0 if p == 1 else (m if layout.schedule == "gpipe" else min(p, m) * interleaving)
    loss_bytes = 2 * counts.other_saved * tokens / t  # what the head and loss saved, and at the backward's start
    # their gradients of the same size (the logits' float32 and 16-bit gradients), with every block's saved
    memory["activations"] = max(stage_bytes * in_flight, stage_bytes + loss_bytes) if p > 1 else stage_bytes + loss_bytes
    memory["allocator"] = a.allocator_overhead * sum(memory.values())
    memory["runtime"] = a.runtime_gib * GiB
    total = sum(memory.values())

    # Compute: training FLOPs of the stage's share, recompute added, at the achieved rate.
    expert_flops = sum(counts.block_expert_flops[i] for i in blocks) if counts.block_expert_flops else 0.0
    flops_mm = sum(counts.block_flops[i] - counts.block_attention[i] for i in blocks) - expert_flops
    flops_at = sum(counts.block_attention[i] for i in blocks)
    head = counts.other_flops  # with a pipeline the stage counted is the last (blocks and the head): the slowest
    redo = {"none": 0.0, "selective": 0.5, "full": 1.0}[run.recompute]  # forwards of the blocks run again
    # The experts' rows: under ep each tp rank routes its share of the tokens, the busiest expert-parallel
    # rank expert_imbalance x the mean; without ep every tp rank runs them all (mg.parallelize keeps them whole).
    routed = expert_flops * tokens / t * a.expert_imbalance if e > 1 else expert_flops * tokens
    matmul = (3 + redo) * (flops_mm * tokens / t + routed) + 3 * head * tokens / t
    attention = (3 + (1.0 if run.recompute == "full" else 0.0)) * flops_at * tokens / t  # selective keeps its output
    rate = cluster.peak("bf16") * a.efficiency * (a.compile_speedup if run.compile else 1.0)
    fp8 = a.fp8_speedup if run.precision == "fp8" else 1.0
    micro_s = (matmul / fp8 + attention) / rate
    slots = m + (p - 1) / v if p > 1 else m
    time = {"compute": m * micro_s}
    if p > 1:
        time["pipeline bubble"] = (slots - m) * micro_s

    # Collectives: seconds = bytes moved per rank x the busbw factor / busbw of the span the group covers;
    # ``calls`` counts them per group size (each one waits where a machine's overheads say so).
    calls: dict[int, float] = {}

    def coll(nbytes: float, n: int, span: int, factor: float, count: float = 1.0) -> float:
        if n <= 1:
            return 0.0
        calls[n] = calls.get(n, 0.0) + count
        return nbytes * factor * (n - 1) / n / cluster.busbw(span)

    inner = c * t
    moe = sum(1 for i in blocks if experts[i])
    if shards > 1:
        # FSDP gathers each block in forward and backward per micro-batch, the root once (a pipeline stage
        # once a step); a reduce-scatter per unit a step. The experts' FSDP group, efsdp, is outside ep in
        # the mesh, so it spans f x t as dp_shard does.
        gathers, units = (2 * m, 2 * m * per_stage + m) if p == 1 else (1, per_stage + 1)
        dp_s = coll(gathers * width * dense, f, f * t, 1, units) + coll(4.0 * dense, f, f * t, 1, per_stage + 1) \
            + coll(gathers * width * experts_held, ef, f * t, 1, gathers * moe) + coll(4.0 * experts_held, ef, f * t, 1, moe)
        if layout.dp_replicate > 1:
            dp_s += coll(4.0 * stored, layout.dp_replicate, layout.dp_replicate * f * t, 2, per_stage + 1)
    else:  # DDP: one all-reduce per 25 MiB bucket
        dp_s = coll(4.0 * held, dp, dp * inner, 2, max(1, math.ceil(4.0 * held / 2**20 / 25)))
    hidden_under = a.dp_overlap * time["compute"]
    time["data-parallel collectives (exposed)"] = max(0.0, dp_s - hidden_under)
    if t > 1:
        per_layer = (8 + (4 if run.recompute == "full" else 0)) * tokens * counts.block_input
        tp_s = m * per_stage * coll(per_layer, t, t, 1, m * per_stage * (4 + (2 if run.recompute == "full" else 0)))
        time["tensor-parallel collectives"] = tp_s * (1 - (a.async_tp_overlap if run.async_tp else 0.0))
    if e > 1:
        # Per MoE layer and micro-batch: the rows out and back (dispatch, combine), twice again in the backward
        # (and once more under full recompute), on the critical path; the group is ep consecutive ranks.
        rows = sum(counts.block_routed[i] for i in blocks) * tokens / t * a.expert_imbalance
        per = 4 + (2 if run.recompute == "full" else 0)
        time["expert all-to-all"] = m * coll(rows * per, e, e, 1, m * moe * per)
    if c > 1:
        kv = sum(counts.block_kv[i] for i in blocks) * b * run.seq_len / t  # the whole sequence's K, V per rank
        ring = m * 3 * coll(kv, c, inner, 1, m * 3 * per_stage)  # gathered forward, gradients back (x2) backward
        time["context-parallel ring (exposed)"] = max(0.0, ring - m * attention / rate)
    if p > 1:
        hop = tokens * counts.block_input / t
        time["pipeline send/recv"] = 2 * slots * v * hop / cluster.busbw(cluster.gpus // p + 1)  # next stage: world/p on
        calls[2] = calls.get(2, 0.0) + 2 * slots * v
    time["optimizer"] = a.optimizer_bytes * stored / cluster.gpu.hbm_bandwidth
    for n in (f, cluster.gpus):  # the gradient norm's all-reduce (over the shards), the step's token count
        if n > 1:
            calls[n] = calls.get(n, 0.0) + 1
    if overheads is not None:
        time["fixed costs"] = m * overheads.micro_s * (per_stage / L if p > 1 else 1.0) + overheads.step_s \
            + sum(k * overheads.wait_s.get(n, 0.0) for n, k in calls.items())
    step = sum(time.values())
    tps = run.global_batch * run.seq_len / step / cluster.gpus
    return {"memory": memory, "memory_bytes": total, "fits": total <= cluster.gpu.hbm_bytes, "time": time,
            "step_s": step, "tokens_per_s_per_gpu": tps, "collectives": calls,
            "mfu": tps * counts.flops_per_token / cluster.peak("bf16")}  # against bf16's peak, fp8 or not
