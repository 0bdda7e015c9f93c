"""Memory per GPU and step time of one layout of a counted model on a cluster: the formulas, each part named.

Memory per GPU (bytes), on the stage that holds the most:
- parameters, gradients, optimizer: fp32 weights, fp32 gradients and AdamW's two fp32 moments (4 + 4 + 8
  bytes per parameter, ZeRO's 16 with the 16-bit copy counted under buffers), of what tensor and pipeline
  parallelism leave the rank, divided over the ranks FSDP shards across (dp_shard x cp; DDP: 1);
- buffers: the 16-bit weights FSDP gathers (the float8 linears' in fp8 under ``Run.fp8_all_gather``; two blocks in
  flight: the one computing and the prefetch; the root unit, tables and head, for the whole step), one block's
  unsharded gradient (every block's, in float32, when micro-batches accumulate: the reduce-scatter waits for the
  last) and the float32 reduce-scatter input FSDP2 keeps of the block before; a pipeline stage keeps all its
  weights gathered and gradients unsharded; DDP's gradient buckets (a float32 copy);
- activations: the bytes autograd saves per token and block (``counts``) x tokens per micro-batch / (tp x cp)
  (cp cuts every saved tensor, tp all but the sub-layers' inputs and, without sequence parallelism, what the
  norms save: ``saved_under_tp``), for the blocks of the stage and the micro-batches in flight (1; 1F1B p on
  the first stage, x (1 + (p-1)/(p v)) interleaved, never above m; GPipe m); full recompute keeps the block
  input, selective the input, attention's outputs and every other matmul's output; one block's backward at a
  time adds its gradients in flight (counted on fake tensors) and what recompute makes again;
  the last stage adds the embedding output, the logits and the loss's float32 copy (a compiled loss: the 16-bit
  logits), twice: the backward starts by making their gradients while all of the above is still held; they are
  freed before the last block's backward (the larger of the two counts);
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

Step time: compute (FLOPs / (peak x achieved fraction)), recompute included, the pipeline's bubble (where
ranks share cores, ``Cluster.slowdown``, only what the critical path adds beyond every rank's work); the
collectives by the alpha-beta model with nccl-tests' bus bandwidth of the link the group spans, exposed as
``Assumptions`` says (data-parallel traffic phase by phase, ``exposed``: FSDP's gathers under the forward and
the backward they feed, its reduce-scatters and DDP's all-reduce under the last micro-batch's backward, each up to
``dp_overlap`` of that phase's compute, the first gather and the last reduction never; tensor-parallel not, cp's
ring under attention); the optimizer step by HBM bandwidth; and, for a machine whose ``Overheads`` are
measured, the wrapper's work per micro-batch and step and each collective's wait (counted per group size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..parallel.layout import Layout
from ..parallel.pp import stages_per_rank
from .counts import Counts
from .compute import float8_flops, micro_flops
from .hardware import Cluster

GiB = 2**30
DDP_BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb
WORK = ("compute", "pipeline bubble", "optimizer")  # a step's parts that are work, not transfers


@dataclass(frozen=True)
class Assumptions:
    """Every constant a forecast rests on; each is a flag of ``multigpu forecast`` and named in its output.
    ``efficiency`` and the two speedups come from a calibration set (``tables/calibration.json``)."""

    efficiency: float = 0.45         # achieved fraction of the dense bf16 peak in eager mode
    compile_speedup: float = 1.0     # compute time / this with torch.compile
    fp8_speedup: float = 1.0         # matmul time / this with fp8 matmuls (attention stays 16-bit)
    dp_overlap: float = 1.0          # fraction of each phase's compute (forward, backward) under which that phase's
                                     # data-parallel collectives can hide (``exposed``)
    async_tp_overlap: float = 0.5    # fraction of tensor-parallel traffic async TP hides
    runtime_gib: float = 2.0         # CUDA context, NCCL buffers, cuBLAS workspace per GPU
    allocator_overhead: float = 0.0  # what the caching allocator reserves beyond the tensors, x their bytes
    reserved: bool = True            # memory as a caching allocator reserves it (published peaks, what runs out on
                                     # a GPU); False: the live tensors' peak (tune's measurement)
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
    sequence_parallel: bool = True  # the published runs' (torchtitan, Megatron) beside tp


@dataclass(frozen=True)
class Overheads:
    """Seconds a machine spends beyond its FLOPs and bytes, for one layout, where they are measured (tune's
    probe on this machine: the wrapper's work per micro-batch and per step, what one collective among n
    ranks waits in a busy step after a stretch of work; ``benchmarks/forecast_cpu.py``). A cluster described
    by spec figures has none."""

    micro_s: float = 0.0
    step_s: float = 0.0
    # {group size: ((seconds of work since the last collective, the collective's wait), ...)}, by work
    wait_s: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def wait(self, n: int, gap: float) -> float:
        """What one collective among ``n`` ranks waits after ``gap`` seconds of work: the measured points
        joined by straight lines, the nearest one's outside them (0 where none is measured)."""
        points = self.wait_s.get(n, ())
        return float(np.interp(gap, [g for g, _ in points], [w for _, w in points])) if points else 0.0


@dataclass(frozen=True)
class Run:
    """What a forecast needs besides the layout: the training's shape and the kernels' options."""

    global_batch: int                # sequences per step
    seq_len: int
    recompute: str = "none"          # none, selective, full
    compile: bool = False
    precision: str = "bf16"          # bf16 or fp8 (matmuls)
    async_tp: bool = False
    loss_parallel: bool = False      # the logits stay cut by vocabulary into the loss (torchtitan's); else gathered
    fp8_all_gather: bool = False     # FSDP gathers the fp8 linears' weights in fp8 (torchao's float8 all-gather)
    compile_loss: bool = False       # the loss compiled too (torchtitan's since 2025): it saves the 16-bit logits,
                                     # not their float32 log-probabilities
    fp8_tp_all_gather: bool = False  # under tp with sequence parallelism the sub-layers' inputs are gathered in fp8
                                     # (torchao's Float8ColwiseParallel, PrepareFloat8ModuleInput: torchtitan's with
                                     # tensorwise fp8)
    logits_held: bool = False        # the loop holds the logits through the backward (``out = model(x)`` then
                                     # ``loss.backward()``, as most scripts do and PyTorch's pipelining does);
                                     # torchtitan frees them first (``del pred``)


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

    def dense_of(i: int) -> float:  # a block's parameters besides its experts that this tp rank holds
        return (counts.block_sharded[i] - experts[i]) / t + counts.block_params[i] - counts.block_sharded[i]

    # Bytes of block i's weights as FSDP gathers them (``size`` of them on this rank): 16-bit, but for the linears'
    # weight matrices in fp8 (1 byte) under torchao's float8 all-gather.
    fp8_saving = width - 1.0 if run.fp8_all_gather else 0.0

    def gathered_bytes(i: int, size: float) -> float:
        return width * size - (fp8_saving * counts.block_fp8_params[i] / t if fp8_saving else 0.0)

    block_held = sum(dense_of(i) for i in blocks)
    experts_held = sum(experts[i] for i in blocks) / e
    first = counts.embed_params / t  # TP cuts the tables; a tied table's copy sits on the last stage too
    last = (counts.embed_params if counts.tied and p > 1 else counts.head_params) / t + counts.other_params
    dense = block_held + (max(first, last) if p > 1 else first + last)
    held = dense + experts_held
    shards = f  # FSDP shards over dp_shard x cp; DDP (both 1) keeps whole states
    ef = f // (e // t if e > 1 else 1)  # efsdp: ep takes every tp rank and ep / tp of dp_shard (Layout.ep_dp)
    stored = dense / f + experts_held / ef  # the states' parameters per rank
    on_rank = [(counts.block_params[i] - experts[i]) / t + experts[i] / e for i in range(L)]  # each block, this rank
    biggest = max(on_rank)
    biggest_bytes = max(gathered_bytes(i, size) for i, size in enumerate(on_rank))
    memory = {"parameters": 4.0 * stored, "gradients": 4.0 * stored, "optimizer": 8.0 * stored}
    # A pipeline stage keeps its weights gathered and its gradients unsharded in float32 across the
    # micro-batches (PyTorch's pipelining turns FSDP's resharding and gradient sync off until the last).
    # Without a pipeline FSDP's root unit (tables, final norm, head) stays gathered from the forward's first
    # op to the backward's last (FSDP2 does not reshard the root after the forward).
    # Accumulating (m > 1) FSDP skips the reduce-scatter until the last micro-batch (mg.accumulate): every
    # block's unsharded gradient is held meanwhile (float32: FSDP2 accumulates in the reduce dtype). Otherwise a
    # block's unsharded gradient (in the compute dtype) exists only while its backward runs, beside the block
    # before's reduce-scatter input (its gradient in float32, the reduce dtype), which FSDP2 keeps until the next
    # is made (``reduce_scatter_max_input_buffers``, 1): both belong to a block's backward (``block_grads``, added
    # with that phase below), not to the loss's before it.
    grads = 4.0 * held if m > 1 else 0.0
    block_grads = (0.0 if m > 1 else width * biggest) + 4.0 * biggest if shards > 1 and p == 1 else 0.0
    gathered = (4.0 * held + width * (held - block_held) + sum(gathered_bytes(i, dense_of(i)) for i in blocks)
                if p > 1 else 2 * biggest_bytes + width * (first + last) + grads)
    # DDP's reducer keeps a float32 bucket copy of every gradient (PyTorch's default, no gradient_as_bucket_view).
    memory["buffers"] = gathered if shards > 1 else (4.0 * held if dp > 1 else 0.0)
    # Sequence parallelism cuts the block input full recompute keeps; without it that stays whole. The logits are
    # cut by vocabulary only under a parallel loss.
    sp = t == 1 or layout.sequence_parallel
    per_block = {"none": [saved_under_tp(counts, i, t, sp) for i in blocks],
                 "selective": [counts.block_input / (t if sp else 1) + counts.block_kept[i] / t for i in blocks],
                 "full": [counts.block_input / (t if sp else 1)] * len(blocks)}[run.recompute]
    stage_bytes = sum(per_block) * tokens  # kept per micro-batch in flight

    # While a block's backward runs, once (a micro-batch's backward at a time): what recompute makes again of its
    # activations (full: all it saved; selective: what the policy did not keep) and its gradients in flight
    # (counted on fake tensors; cut by tp with the matmuls that make them).
    def again(i: int, keep: float) -> float:
        saved = saved_under_tp(counts, i, t, sp)
        return {"none": 0.0, "full": saved, "selective": max(0.0, saved - keep)}[run.recompute]

    transient = max(again(i, keep) + counts.block_backward[i] / t for i, keep in zip(blocks, per_block)) * tokens
    interleaving = (1 + (p - 1) / (p * v)) if v > 1 else 1.0
    # Never more than the step's m micro-batches (the interleaved schedule's warm-up runs every forward first when
    # m <= p: measured, 2 ranks x 2 stages, GPT, rank 0's saved activations: m = 2: 2.0 micro-batches, m = 4, 8: 2.5).
    in_flight = 1.0 if p == 1 else (m if layout.schedule == "gpipe" else min(m, min(p, m) * interleaving))
    # What the head and loss saved, and at the backward's start their gradients of the same size (the logits'
    # float32 and 16-bit gradients). A compiled loss fuses the float32 upcast into its kernels: it saves the 16-bit
    # logits in place of their float32 log-probabilities, and its gradient comes out 16-bit.
    head_saved = counts.other_saved - (counts.logits_f32 * (1 - width / 4) if run.compile_loss else 0.0)
    loss_bytes = 2 * head_saved * tokens / (t if run.loss_parallel else 1)
    # The loss's part is freed once the head's backward has run, before the last block's backward: the two come
    # one after the other (the first stage, without the loss, runs a block's backward under its micro-batches in
    # flight).
    logits = counts.vocab * width * tokens / (t if run.loss_parallel else 1) if run.logits_held else 0.0

    def peak(block_phase: float) -> float:  # the larger of a block's backward (on the first stage too) and the loss's
        return max(stage_bytes * in_flight + block_phase, stage_bytes + logits + max(loss_bytes, block_phase))

    phase = transient + block_grads  # a block's backward, FSDP's gradient buffers included
    memory["activations"] = peak(transient)
    memory["buffers"] += peak(phase) - memory["activations"]  # FSDP's, where that phase tops
    # A caching allocator keeps the loss's freed blocks reserved under the block's backward that follows (whose
    # tensors have other sizes): reserved, the two add (torchtitan's peaks; live, on CPU, the larger counts).
    reserved_more = max(0.0, peak(0.0) + phase - peak(phase)) if a.reserved else 0.0
    if p > 1:
        # PyTorch's pipelining allocates a receive buffer per micro-batch at each stage boundary: a stage's input
        # (forward) and its output's gradient (backward); the first stage receives only the one, the last only
        # the other. A rank of 2 stages holds one boundary's buffers; of more, or of several stages, up to two each.
        boundary = counts.block_input * tokens / (t if sp else 1)
        memory["buffers"] += m * boundary * (1 if p == 2 and v == 1 else 2 * v)
    # The optimizer's step, after the activations are freed: the states, DDP's buckets, and foreach AdamW's
    # float32 temporary of everything it steps (its sqrt of the second moments); counted where it tops the above.
    at_step = 16.0 * stored + (memory["buffers"] if shards == 1 else 0.0) + 4.0 * stored
    memory["optimizer step"] = max(0.0, at_step - sum(memory.values()))
    memory["allocator"] = a.allocator_overhead * (sum(memory.values()) + reserved_more) + reserved_more
    memory["runtime"] = a.runtime_gib * GiB
    total = sum(memory.values())

    # Compute: training FLOPs of the stage's share, recompute added, at the achieved rate (a measured machine's
    # own rate for this micro-batch).
    rate = cluster.rate(b, run.recompute)
    if rate is None:  # a described GPU: its peak at the calibrated fraction
        rate = cluster.peak("bf16") * a.efficiency * (a.compile_speedup if run.compile else 1.0)
    # fp8: the matmuls of the layers float8 converts (counted with the choice ``mg.Precision("fp8")`` makes) run
    # fp8_speedup x faster; the rest (layers left out, attention) as in bf16.

    def seconds(recompute: str) -> float:  # a micro-batch's forward and backward, that recompute's forward included
        matmul, attention = micro_flops(counts, blocks, tokens, t, recompute, a.expert_imbalance if e > 1 else None)
        fast = float8_flops(counts, blocks, tokens, t, recompute) if run.precision == "fp8" else 0.0
        return (matmul - fast + fast / a.fp8_speedup + attention) / rate

    micro_s = seconds(run.recompute)
    fwd_s = seconds("none") / 3  # the forward: a third of the FLOPs without recompute (the backward twice it)
    slots = m + (p - 1) / v if p > 1 else m
    time = {"compute": m * micro_s}
    if p > 1:
        # The critical path is slots micro-batches; where ranks share cores (``cluster.slowdown``), a stage runs
        # faster than micro_s while others sit in the bubble, so the step is the longer of that path at full
        # speed and every rank's work over the cores (m micro-batches at the shared rate).
        time["pipeline bubble"] = max(0.0, slots / cluster.slowdown - m) * micro_s

    # Collectives: ``cluster.collective_s`` (bus bandwidth of the span the group covers, or the measured
    # links); ``calls`` counts them per group size (each one waits where a machine's overheads say so).
    calls: dict[int, float] = {}

    def coll(op: str, nbytes: float, n: int, span: int, count: float) -> float:
        if n <= 1 or count <= 0:
            return 0.0
        calls[n] = calls.get(n, 0.0) + count
        return cluster.collective_s(op, n, span, nbytes, count)

    inner = c * t
    # FSDP's units: each block's dense part and its experts (a unit of their own, over efsdp), and the root (tables,
    # final norm, head: the stage's).
    units = [(dense_of(i), gathered_bytes(i, dense_of(i)), experts[i] / e) for i in blocks]
    root = max(first, last) if p > 1 else first + last
    phases = (fwd_s, micro_s - fwd_s)
    if shards > 1:
        dp_s = fsdp_exposed(cluster, layout, m, units, root, width, phases, a.dp_overlap, calls)
    else:  # DDP: one all-reduce per 25 MiB bucket, in the last micro-batch's backward (mg.accumulate)
        buckets = max(1, math.ceil(4.0 * held / DDP_BUCKET))
        bucket = coll("all_reduce", 4.0 * held / buckets, dp, dp * inner, buckets) / buckets
        dp_s = exposed(buckets * bucket, bucket, phases[1], buckets, a.dp_overlap)
    time["data-parallel collectives (exposed)"] = dp_s
    if t > 1:
        time["tensor-parallel collectives"] = tp_collectives(counts, layout, blocks, tokens, m, run, coll) \
            * (1 - (a.async_tp_overlap if run.async_tp else 0.0))
    if e > 1:
        # Per MoE layer and micro-batch: the rows out and back (dispatch, combine), twice again in the backward
        # (and once more under full recompute), on the critical path; the group is ep consecutive ranks.
        moe = sum(1 for i in blocks if experts[i])
        rows = sum(counts.block_routed[i] for i in blocks) * tokens / t * a.expert_imbalance / max(moe, 1)
        per = 4 + (2 if run.recompute == "full" else 0)
        time["expert all-to-all"] = coll("all_to_all", rows, e, e, m * moe * per)
    if c > 1:
        kv = sum(counts.block_kv[i] for i in blocks) * b * run.seq_len / t / per_stage  # a block's whole K, V
        ring = coll("all_gather", kv, c, inner, m * 3 * per_stage)  # gathered forward, gradients back (x2) backward
        attention = micro_flops(counts, blocks, tokens, t, run.recompute)[1]
        time["context-parallel ring (exposed)"] = max(0.0, ring - m * attention / rate)
    if p > 1:
        hop = tokens * counts.block_input / t
        time["pipeline send/recv"] = coll("send", hop, 2, cluster.gpus // p + 1, 2 * slots * v)  # next stage: world/p on
    time["optimizer"] = a.optimizer_bytes * stored / cluster.gpu.hbm_bandwidth
    # The gradient norm's all-reduce over each dimension the parameters are cut along, the step's token count.
    for n in (f, t, p, cluster.gpus):
        if n > 1:
            calls[n] = calls.get(n, 0.0) + 1
    if overheads is not None:
        # A collective waits for its group's slowest rank, the longer the more work since the last (the step's work,
        # the wrapper's too, shared evenly between its collectives). Blocks that issue collectives along two mesh
        # dimensions (HSDP: a unit's reduce-scatter among its shards, at once its all-reduce among the replicas; FSDP
        # x TP, CP, EP) chain their groups into one of all the ranks; a pipeline's stages meet at sends (the bubble).
        work = m * overheads.micro_s * (per_stage / L if p > 1 else 1.0) + overheads.step_s
        gap = (work + sum(v for k, v in time.items() if k in WORK)) / max(1.0, sum(calls.values()))
        crossed = sum(d > 1 for d in (layout.dp_replicate, layout.dp_shard, t, c, e)) > 1
        time["fixed costs"] = work + sum(k * overheads.wait(cluster.gpus if crossed else n, gap) for n, k in calls.items())
    step = sum(time.values())
    tps = run.global_batch * run.seq_len / step / cluster.gpus
    return {"memory": memory, "memory_bytes": total, "fits": total <= cluster.gpu.hbm_bytes, "time": time,
            "step_s": step, "tokens_per_s_per_gpu": tps, "collectives": calls,
            "mfu": tps * counts.flops_per_token / cluster.peak("bf16")}  # against bf16's peak, fp8 or not


def exposed(comm: float, edges: float, compute: float, pieces: int, overlap: float) -> float:
    """Seconds of one phase's communication (``comm``) that its compute does not hide. The compute runs as
    ``pieces`` equal pieces (blocks, DDP's buckets) on one stream, the collectives in order on another; a piece's
    collective overlaps the other pieces' compute, never its own: what waits for the first piece or follows the last
    (``edges``: the first block's gather, the last block's or bucket's reduction) is exposed whatever the compute,
    and the rest hides under at most ``overlap`` x the compute of every piece but one. Exact for equal pieces where
    the compute or the collectives bound the phase (gathers only, or reductions only: the bound one's time plus one
    piece of the other), within a piece where they alternate."""
    return min(comm, max(edges, comm - overlap * compute * (1 - 1 / max(pieces, 1))))


def fsdp_exposed(cluster: Cluster, layout: Layout | Degrees, m: int, units: list[tuple[float, float, float]],
                 root: float, width: int, phases: tuple[float, float], overlap: float, calls: dict[int, float]) -> float:
    """Seconds of a step's FSDP (and HSDP) collectives its compute does not hide, phase by phase (``exposed``), their
    calls added to ``calls`` by group size. ``units`` are the stage's blocks as (dense parameters, their gathered
    bytes, expert parameters) on this rank; ``phases`` a micro-batch's forward and backward seconds.

    Each micro-batch's forward gathers the root, then every block in turn: hidden under the forward only, the
    root's and the first block's exposed. Its backward gathers every block again (hidden under the backward, the
    first exposed); the last micro-batch's (``mg.accumulate`` syncs only there) also reduce-scatters every unit in
    float32, each after its block's backward, and HSDP all-reduces each shard over the replicas after its
    reduce-scatter: the first block's and the root's, after the backward's last piece, are exposed. A pipeline
    stage gathers once a step (its first micro-batch's forward) and reduces in its last micro-batch's backward."""
    t, p, f, r, e = layout.tp, layout.pp, layout.dp_shard * layout.cp, layout.dp_replicate, layout.ep
    ef = f // (e // t if e > 1 else 1)  # efsdp: ep takes every tp rank and ep / tp of dp_shard (Layout.ep_dp)

    def one(op: str, nbytes: float, n: int, replicas: int = 1) -> float:  # one call's seconds; the span f x t (x r)
        return cluster.collective_s(op, n, replicas * f * t, nbytes)

    def reduced(size: float, n: int) -> float:  # a unit's float32 gradient reduce-scattered, its shard all-reduced
        return one("reduce_scatter", 4.0 * size, n) + one("all_reduce", 4.0 * size / n, r, r)

    gathers = [one("all_gather", nbytes, f) + one("all_gather", width * x, ef) for _, nbytes, x in units]
    reduces = [reduced(size, f) + reduced(x, ef) for size, _, x in units]
    g_root, r_root = one("all_gather", width * root, f), reduced(root, f)
    rounds = m if p == 1 else 1  # forwards that gather; a pipeline stage keeps its weights gathered
    passes = 2 * rounds if p == 1 else 1  # each block's gathers a step
    again = (sum(gathers), max(gathers)) if p == 1 else (0.0, 0.0)  # the backward's gathers, the first exposed
    n, moe = len(units), sum(x > 0 for _, _, x in units)
    for size, k in ((f, n * (passes + 1) + rounds + 1), (ef, moe * (passes + 1)), (r, n + 1 + moe)):
        if size > 1 and k:
            calls[size] = calls.get(size, 0.0) + k
    fwd, bwd = phases
    return (rounds * exposed(g_root + sum(gathers), g_root + max(gathers), fwd, n, overlap)
            + (rounds - 1) * exposed(again[0], again[1], bwd, n, overlap)
            + exposed(again[0] + sum(reduces) + r_root, again[1] + max(reduces) + r_root, bwd, n, overlap))


def saved_under_tp(counts: Counts, i: int, t: int, sequence_parallel: bool) -> float:
    """Bytes per token block ``i`` saves on one of ``t`` tensor-parallel ranks: its one-process bytes cut by t,
    except those every rank holds whole (as counted: ``Counts.block_gathered``, ``block_unsplit``). Each
    sub-layer's input (attention's, the MLP's) is whole on every rank, replicated without sequence parallelism
    and all-gathered with it, and saved by its column-wise linears; without sequence parallelism what the norms
    save outside the sub-layers is whole too."""
    if t == 1:
        return counts.block_saved[i]
    whole = min(counts.block_gathered[i] + (0.0 if sequence_parallel else counts.block_unsplit[i]),
                counts.block_saved[i])
    return (counts.block_saved[i] - whole) / t + whole


def tp_collectives(counts: Counts, layout, blocks, tokens: float, m: int, run: Run, coll) -> float:
    """Seconds of a step's tensor-parallel collectives, as PyTorch's plans issue them, each moving a
    micro-batch's hidden states (``coll(op, bytes, n, span, calls)``). With sequence parallelism, per sub-layer
    an all-gather in and a reduce-scatter out, mirrored in the backward; without, an all-reduce after each
    row-wise linear (one per sub-layer) and, in the backward, one of each column-wise linear's input gradient
    (q, k and v each one); under fp8 TP gathers (``Run.fp8_tp_all_gather``) the sub-layers' gathers carry 1 byte an
    element. Full recompute runs the forward's again; selective (torchtitan's op policy, which
    saves the reduce-scatters' outputs and not the all-gathers') gathers each sub-layer's input again, for the
    recomputed matmuls and the weight gradients that read it (without sequence parallelism, what that policy
    runs again of the all-reduces is not counted: torchtitan runs TP with it). The token table's output is reduced, the
    head's input gathered (SP) or its gradient reduced, and the logits gathered unless the loss is parallel.
    With a pipeline the stage counted is the last (the head's)."""
    t, p, full = layout.tp, layout.pp, run.recompute == "full"
    act = tokens * counts.block_input
    fwd = 2 if full else 1
    if layout.sequence_parallel:
        each = 2 * (fwd + 1) * len(blocks)  # all-gathers, as many reduce-scatters
        again = 2 * len(blocks) if run.recompute == "selective" else 0  # selective: the inputs re-gathered
        # The sub-layers' inputs 1 byte an element under fp8 TP gathers; the head's input (not fp8) 16-bit.
        gather = act / counts.dtype_bytes if run.fp8_tp_all_gather else act
        s = coll("all_gather", gather, t, t, m * (each + again)) + coll("all_gather", act, t, t, m) \
            + coll("reduce_scatter", act, t, t, m * (each + 1))
        if p == 1:
            s += coll("all_reduce", act, t, t, m) + coll("all_gather", act, t, t, m)  # the table's, its gradient
    else:
        colwise = sum(max(counts.block_linears[i] - 2, 0) for i in blocks)  # all but the 2 row-wise
        reduces = 2 * fwd * len(blocks) + colwise + 1 + (1 if p == 1 else 0)  # + head, table
        s = coll("all_reduce", act, t, t, m * reduces)
    if not run.loss_parallel and counts.vocab:
        s += coll("all_gather", tokens * counts.vocab * counts.dtype_bytes, t, t, m)
    return s
