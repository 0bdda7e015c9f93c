"""What a forecast is asked and rests on: the assumptions, a machine's measured overheads, the run (the layout is a
resolved ``mg.parallel.Layout``, built by multigpu or only described: ``Layout.unbuilt``); and ``Rank``, what one
rank of a layout holds and runs of a counted model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..parallel.layout import Layout
from ..parallel.pp import stage_ids
from ..parallel.stages import stage_ranges
from .counts import Counts

GiB = 2**30


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
    grad_sync: str = "last"          # ``mg.accumulate``'s sync=: the data-parallel gradients reduced on the last
                                     # micro-batch of a step ("last") or on each ("each": FSDP holds its shard of
                                     # them between micro-batches, not every block's unsharded one); a pipeline's
                                     # schedule reduces on its last
    overlap_param_gather: bool = False  # ZeRO-1 as Megatron's distributed optimizer runs it with its overlap flags
                                        # (``comm.ddp_exposed``), not multigpu's: a run multigpu does not make


def Degrees(dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, micro_batch: int, schedule: str = "1f1b",
            ep: int = 1, sequence_parallel: bool = True, zero1: bool = False, overlap_param_gather: bool = False,
            stages_per_rank: int | None = None, checkpoint_blocks: int | None = None) -> Layout:
    """Deprecated (one release): the ``mg.parallel.Layout`` of these degrees, which describes every layout Degrees
    did (the library builds what ``Layout.unbuilt`` allows); sequence parallelism beside tp, as Degrees' default.
    ``overlap_param_gather`` is the run's now (``Run(overlap_param_gather=True)``): a Layout cannot carry it, so it
    is refused rather than dropped (the forecast would be multigpu's ZeRO-1, not Megatron's)."""
    import warnings

    from ..errors import UsageError

    warnings.warn("multigpu.forecast Degrees(...) is deprecated; use mg.parallel.Layout(dp_replicate=..., "
                  "dp_shard=..., tp=..., pp=..., cp=..., micro_batch=..., sequence_parallel=tp > 1, ...) and "
                  "Run(overlap_param_gather=True) for Megatron's overlapped ZeRO-1", DeprecationWarning, stacklevel=2)
    if overlap_param_gather:
        raise UsageError("Degrees(overlap_param_gather=True) is the run's now, not the layout's: pass "
                         "Run(..., overlap_param_gather=True) and a mg.parallel.Layout(..., zero1=True)")
    return Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, micro_batch=micro_batch,
                  schedule=schedule, ep=ep, sequence_parallel=sequence_parallel and tp > 1, zero1=zero1,
                  stages_per_rank=stages_per_rank, checkpoint_blocks=checkpoint_blocks)


class Rank:
    """Pipeline rank ``pp_rank`` of a layout on a counted model: the layout's degrees (tp, pp, cp, ep; f, the ranks
    FSDP shards over: dp_shard x cp), its micro-batches (m of b sequences), its stages as ``mg.parallel.pipeline``
    cuts and places them (``stages.stage_ranges``, ``pp.stage_ids``: the embeddings and the head count as a block
    each), their blocks, whether it holds the first stage (the table) and the last (the head), and what of the
    parameters it holds (``held``), keeps states of (``stored``) and keeps optimizer state of and steps
    (``stepped``: under ZeRO-1 1/dp of the stored). Without a pipeline the one rank holds everything."""

    def __init__(self, counts: Counts, layout: Layout, run: Run, pp_rank: int = 0):
        self.counts, self.layout, self.run, self.pp_rank = counts, layout, run, pp_rank
        t, p, e = self.t, self.p, self.e = layout.tp, layout.pp, layout.ep
        self.c, f = layout.cp, layout.dp_shard * layout.cp
        self.f = self.shards = f  # FSDP shards over dp_shard x cp; DDP (both 1) keeps whole states
        self.dp, self.b = layout.dp_size, layout.micro_batch
        self.m = layout.accum_steps(run.global_batch)  # the BatchPlan's count, which refuses a batch that does not split
        self.v = layout.stages // p  # stages per rank
        self.layers = L = counts.layers
        # This rank's stages and their blocks, as the library cuts and places them.
        self.stage_ids = stage_ids(layout.schedule, pp_rank, p, self.v) if p > 1 else [0]
        ranges = stage_ranges(L, layout.stages)
        self.blocks = [i for s in self.stage_ids for i in ranges[s]]
        # The blocks whose forward ``run.recompute`` runs again: all, or the first checkpoint_blocks of each stage, as
        # mg.parallelize checkpoints them (Megatron's --recompute-method block); the others keep their activations.
        self.recomputed = [i for s in self.stage_ids for i in ranges[s][:layout.checkpoint_blocks]]
        self.holds_first, self.holds_last = 0 in self.stage_ids, layout.stages - 1 in self.stage_ids
        self.tokens = self.b * run.seq_len / self.c  # per micro-batch on this rank (before tp, which shares them)
        self.width = counts.dtype_bytes
        self.sp = t == 1 or layout.sequence_parallel  # the activations cut by tp as sequence parallelism cuts them
        # Parameters this rank's TP/PP position owns: its blocks, the table with the first stage, the head and the
        # rest (final norm) with the last. A mixture of experts' experts: 1/ep of them, whole (ep spans the tp
        # ranks), FSDP-sharded over what ep leaves of dp_shard (efsdp); everything else over dp_shard x cp.
        self.experts = [counts.block_experts[i] if counts.block_experts else 0 for i in range(L)]
        self.block_held = sum(self.dense_of(i) for i in self.blocks)
        self.experts_held = sum(self.experts[i] for i in self.blocks) / e
        # TP cuts the tables; a tied table's copy sits on the last stage too (each stage is a copy of the model).
        self.first = counts.embed_params / t if self.holds_first else 0.0
        head = counts.embed_params if counts.tied and p > 1 else counts.head_params
        self.last = head / t + counts.other_params if self.holds_last else 0.0
        self.root = self.first + self.last  # FSDP's root unit, the rank's ends
        dense = self.block_held + self.root
        self.held = dense + self.experts_held
        self.ef = f // (e // t if e > 1 else 1)  # efsdp: ep takes every tp rank and ep / tp of dp_shard (Layout.ep_dp)
        self.stored = dense / f + self.experts_held / self.ef  # the states' parameters per rank
        self.zero1 = layout.zero1 and self.dp > 1  # DDP's optimizer state sharded over its replicas (f is 1)
        self.stepped = self.stored / (self.dp if self.zero1 else 1)
        # Micro-batches whose backward reduces the data-parallel gradients: the last, or each under mg.accumulate's
        # sync="each" (a pipeline's schedule reduces in its last either way).
        self.reductions = self.m if run.grad_sync == "each" and p == 1 else 1
        # FSDP (not a pipeline stage) holds every block's unsharded gradient while the micro-batches that do not
        # reduce wait: what sync "each" frees.
        self.held_aside = f > 1 and p == 1 and self.m > self.reductions

    def dense_of(self, i: int) -> float:
        """Block ``i``'s parameters besides its experts that this tp rank holds."""
        c = self.counts
        return (c.block_sharded[i] - self.experts[i]) / self.t + c.block_params[i] - c.block_sharded[i]

    def gathered_bytes(self, i: int, size: float) -> float:
        """Bytes of block ``i``'s weights as FSDP gathers them (``size`` of them on this rank): 16-bit, but for the
        linears' weight matrices in fp8 (1 byte) under torchao's float8 all-gather."""
        fp8_saving = self.width - 1.0 if self.run.fp8_all_gather else 0.0
        return self.width * size - (fp8_saving * self.counts.block_fp8_params[i] / self.t if fp8_saving else 0.0)
