"""The cost model: memory per rank and step time of a layout, from a few measured parts.

Measured once (``probe.py``): the time of one micro-batch's forward and
backward on one process, and the bytes autograd saves for it, for each
micro-batch size with activation checkpointing off and on; the links' time
for each collective at a few sizes on 2 and N ranks (``multigpu bench``'s
measurement); what each wrapper (DDP, FSDP2, TP's DTensors, FSDP x TP) and
the recipe's loop add to a micro-batch and to a step, on one process over a
group of one rank; and what a collective costs inside a step where every rank
is busy, on the real N ranks. Everything else is counting:

- state per rank: 16 bytes per held parameter (fp32 weight, gradient and
  AdamW's two moments); TP holds 1/t of each sharded weight (the plan of
  ``recipes/gpt/parallelize.py``), FSDP 1/d of what TP left, a pipeline
  stage its blocks (the largest stage counts);
- activations: the measured bytes x the stage's share of the blocks / t,
  times the micro-batches in flight (1 without a pipeline, min(p, m) under
  1F1B, m under GPipe);
- compute: m micro-batches x the measured time / t; a pipeline runs
  (m + p - 1) slots of a stage's share (the bubble); plus clipping and the
  optimizer step over the parameters the rank holds;
- on CPU, N workers of T threads on C cores compute max(1, N T / C) times
  slower than the probe's one process (the fixed costs too: they are CPU work);
- communication, with no overlap assumed (an upper bound; on CPU gloo's
  all-reduce competes with the backward for the cores anyway), one
  collective per unit as the strategies issue them: DDP an all-reduce per
  25 MiB bucket; FSDP per block an all-gather in the forward and one in the
  backward of every micro-batch, the root's once, and a reduce-scatter per
  unit per step (a pipeline stage gathers once per step); HSDP also an
  all-reduce per unit over the replicas; TP per micro-batch 6 all-reduces of
  the activations per block (8 under activation checkpointing), 2 for the
  table and head, and the logits' all-gather; a pipeline 2 sends per
  micro-batch and stage boundary; the gradient norm's and the token count's
  all-reduces once per step;
- fixed costs: the wrapper's measured cost per micro-batch x m, the loop's
  and the wrapper's per step, and each of the collectives counted above
  times the measured wait of its group size.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..parallel.layout import Layout

_COL_BIASES = ("attn.q.bias", "attn.k.bias", "attn.v.bias", "mlp.up.bias")


@dataclass(frozen=True)
class Shape:
    """Parameter counts of the GPT recipe's model, split the way the layouts shard them."""

    n_layer: int
    n_embd: int
    block_size: int
    block_sharded: int    # per block: what TP shards (2-D weights, column-wise biases)
    block_replicated: int  # per block: norms, row-wise biases
    embed_sharded: int     # token table (row-wise under TP)
    embed_replicated: int  # position table
    head: int              # untied head (0 when tied), column-wise under TP
    final_norm: int
    vocab_size: int = 0

    @classmethod
    def of(cls, cfg) -> "Shape":
        import torch

        from ..recipes.gpt.model import GPT

        with torch.device("meta"):
            model = GPT(cfg)
        counts = {"bs": 0, "br": 0, "es": 0, "er": 0, "head": 0, "norm": 0}
        for name, p in model.named_parameters():
            n = p.numel()
            if name.startswith("blocks.0."):
                sharded = p.dim() == 2 or name.endswith(_COL_BIASES)
                counts["bs" if sharded else "br"] += n
            elif name.startswith("blocks."):
                continue
            elif name.startswith("embed.wte"):
                counts["es"] += n
            elif name.startswith("embed."):
                counts["er"] += n
            elif name.startswith("head"):
                counts["head"] += n
            else:
                counts["norm"] += n
        return cls(cfg.n_layer, cfg.n_embd, cfg.block_size, counts["bs"], counts["br"], counts["es"], counts["er"],
                   counts["head"], counts["norm"], cfg.vocab_size)

    @property
    def parameters(self) -> int:
        return (self.n_layer * (self.block_sharded + self.block_replicated) + self.embed_sharded + self.embed_replicated
                + self.head + self.final_norm)

    def stage_params(self, layout: Layout) -> tuple[float, float]:
        """(parameters this rank holds before data-parallel sharding, share of the blocks it runs) on the
        largest stage."""
        from ..parallel.stages import balance

        t, pp = layout.tp, layout.pp
        block = self.block_sharded / t + self.block_replicated
        first = self.embed_sharded / t + self.embed_replicated
        last = self.head / t + self.final_norm
        if pp == 1:
            held = self.n_layer * block + first + last
            return held, 1.0
        stages = balance(self.n_layer, pp)
        sizes = [len(r) * block + (first if i == 0 else 0) + (last if i == pp - 1 else 0) for i, r in enumerate(stages)]
        i = max(range(pp), key=lambda k: sizes[k])
        return sizes[i], max(len(r) for r in stages) / self.n_layer


class Links:
    """Seconds of a collective of ``nbytes`` on ``n`` ranks, interpolated from measured points (log-log)."""

    def __init__(self, points: dict[tuple[str, int], list[tuple[int, float]]]) -> None:
        self.points = {k: sorted(v) for k, v in points.items()}

    def time(self, op: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        pts = self.points.get((op, n))
        if not pts:
            raise KeyError(f"no measurement of {op} on {n} ranks")
        sizes = [s for s, _ in pts]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return pts[0][1]  # latency-bound below the smallest size
        if i == len(pts):
            (s0, t0), (s1, t1) = pts[-2], pts[-1]
            return t1 + (nbytes - s1) * (t1 - t0) / (s1 - s0)  # the largest sizes' bandwidth
        (s0, t0), (s1, t1) = pts[i - 1], pts[i]
        w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


DDP_BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb


def family(layout: Layout) -> str:
    """Which wrapper a layout puts around the model (the key of the measured fixed costs): none, ddp, fsdp
    (HSDP too), tp or fsdp+tp."""
    kind = layout.strategy
    if kind == "ddp":
        return "ddp"
    sharded = kind in ("fsdp", "hsdp")
    if layout.tp > 1:
        return "fsdp+tp" if sharded else "tp"
    return "fsdp" if sharded else "none"


def predict(layout: Layout, shape: Shape, global_batch: int, compute: dict, links: Links, slowdown: float = 1.0,
            fixed: dict | None = None, sync: dict | None = None) -> dict:
    """Memory per rank (bytes) and step time (s) of ``layout`` (every degree given), with their parts.

    ``compute[(micro_batch, ac)]`` = {"time_s": one micro-batch's forward+backward on one process,
    "optimizer_s": clipping and AdamW over the whole model, "activation_bytes": what autograd saved}.
    ``slowdown``: how much slower each rank computes than the probe did (on CPU, more worker threads
    than cores share them: N x threads / cores).
    ``fixed[family(layout) + ("+ac" if checkpointed)]`` = {"micro_s": what the wrapper adds to each
    micro-batch, "step_s": what the loop and the wrapper add to each step} (``probe.overheads``);
    ``sync[g]``: what one collective among g ranks costs inside a busy step (``probe.sync``), beyond its
    own transfer. Without them those parts are 0.
    """
    s, ddp = layout, layout.strategy == "ddp"
    held, share = shape.stage_params(layout)
    if not ddp:
        held /= s.dp_shard
    measured = compute[(layout.micro_batch, layout.activation_checkpointing)]
    m = layout.accum_steps(global_batch)
    in_flight = 1 if s.pp == 1 else (min(s.pp, m) if layout.schedule == "1f1b" else m)
    state = 16.0 * held
    activations = measured["activation_bytes"] * share / s.tp * in_flight
    t_micro = measured["time_s"] / s.tp * slowdown
    compute_s = m * t_micro if s.pp == 1 else (m + s.pp - 1) * t_micro * share
    compute_s += measured["optimizer_s"] * slowdown * held / shape.parameters  # each rank steps what it holds
    blocks = round(shape.n_layer * share)
    block_bytes = 4.0 * (shape.block_sharded / s.tp + shape.block_replicated)
    root_bytes = 4.0 * (held * (s.dp_shard if not ddp else 1)) - blocks * block_bytes  # tables, head, norm
    comm = {}
    calls: dict[int, float] = {}  # group size -> collectives per step, each a wait for the group's slowest rank

    def called(n: int, count: float) -> None:
        if n > 1:
            calls[n] = calls.get(n, 0.0) + count

    if ddp:
        grads = 4.0 * held
        buckets = max(1, math.ceil(grads / DDP_BUCKET))
        comm["all_reduce (gradients)"] = buckets * links.time("all_reduce", s.dp_size, grads / buckets)
        called(s.dp_size, buckets)
    else:
        # FSDP units: every block and the root. Without a pipeline each block is gathered in the forward and
        # again in the backward of every micro-batch (resharded after the forward), the root once per
        # micro-batch; a pipeline stage keeps its weights gathered for the step. Gradients are
        # reduce-scattered once per step (no sync before the last micro-batch).
        gathers = m if s.pp == 1 else 1
        ag = links.time("all_gather", s.dp_shard, block_bytes) * blocks * (2 if s.pp == 1 else 1) \
            + links.time("all_gather", s.dp_shard, max(root_bytes, 0.0))
        comm["all_gather (weights)"] = gathers * ag
        comm["reduce_scatter (gradients)"] = blocks * links.time("reduce_scatter", s.dp_shard, block_bytes) \
            + links.time("reduce_scatter", s.dp_shard, max(root_bytes, 0.0))
        called(s.dp_shard, gathers * (blocks * (2 if s.pp == 1 else 1) + 1) + blocks + 1)
        if s.dp_replicate > 1:
            comm["all_reduce (replicas)"] = blocks * links.time("all_reduce", s.dp_replicate, block_bytes / s.dp_shard) \
                + links.time("all_reduce", s.dp_replicate, max(root_bytes, 0.0) / s.dp_shard)
            called(s.dp_replicate, blocks + 1)
        called(s.dp_shard, 1)  # the gradient norm's all-reduce over the sharded parameters
    act = 4.0 * layout.micro_batch * shape.block_size * shape.n_embd
    if s.tp > 1:
        # Per micro-batch, the recipe's plan: per block 2 all-reduces forward (attention out, MLP down; again
        # in the backward's recomputation under activation checkpointing) and 4 backward (the inputs of
        # q, k, v and MLP up), the token table's forward and the head's backward, and the head's logits
        # gathered (the recipe's replicated logits); the gradient norm's all-reduce once per step.
        logits = 4.0 * layout.micro_batch * shape.block_size * shape.vocab_size
        reduces = (6 + (2 if layout.activation_checkpointing else 0)) * blocks + 2
        per_micro = reduces * links.time("all_reduce", s.tp, act) + links.time("all_gather", s.tp, logits)
        comm["all_reduce (tensor parallel)"] = m * per_micro
        called(s.tp, m * (reduces + 1) + 1)
    if s.pp > 1:
        comm["send/recv (pipeline)"] = 2 * m * links.time("broadcast", 2, act)
        called(2, 2 * m + 1)  # and the gradient norm over the stages
    called(layout.world_size, 1)  # the step's token count (mg.token_divisor)
    comm_s = sum(comm.values())
    overhead = {}
    if fixed is not None:
        f = fixed[family(layout) + ("+ac" if layout.activation_checkpointing else "")]
        overhead["wrapper (per micro-batch)"] = m * f["micro_s"] * slowdown * share
        overhead["loop and wrapper (per step)"] = f["step_s"] * slowdown
    if sync:
        # The sync probe's collective moved 1 KiB, whose transfer the links already count.
        floor = {n: links.time("all_reduce", n, 1024) if ("all_reduce", n) in links.points else 0.0 for n in calls}
        overhead["collectives' waits"] = sum(count * max(0.0, sync.get(n, 0.0) - floor[n])
                                             for n, count in calls.items())
    overhead_s = sum(overhead.values())
    return {"memory_bytes": state + activations, "state_bytes": state, "activation_bytes": activations,
            "step_time_s": compute_s + comm_s + overhead_s, "compute_s": compute_s, "comm_s": comm_s, "comm": comm,
            "overhead_s": overhead_s, "overhead": overhead, "collectives": calls}
