"""Every layout of a cluster for one counted model, forecast and ranked: what fits first, fastest first.

The layouts are the mesh's own enumeration, tune's too (``parallel.space.layouts``: pp x dp_replicate x
dp_shard x tp, cp without a pipeline, ZeRO-1 beside each DDP, and for a mixture of experts each ep of dp_shard),
times the micro-batch sizes, full recompute on or off (a named layout's ``checkpoint_blocks``: on its first k blocks
of each stage), and the pipeline schedules; a layout the model cannot take (tp or cp not dividing the heads, more stages than
blocks, a micro-batch count the schedule does not run, a sequence cp cannot cut in 2 cp chunks, ep not dividing the
experts) is left out with its reason. A layout multigpu does not build yet (``Layout.unbuilt``: cp beside a pipeline,
ZeRO-1 beside tp or pp) is never proposed; one a user names is forecast as described, the entry saying why
multigpu does not build it (``unbuilt``).
"""

from __future__ import annotations

import dataclasses

from ..batch import BatchPlan
from ..errors import UsageError
from ..parallel.layout import Layout
from ..parallel.pp import microbatches_refusal
from .cost import Assumptions, Run, predict
from .counts import Counts
from .hardware import Cluster


def _why_not(counts: Counts, layout: Layout, run: Run) -> str | None:
    s = layout
    if counts.heads and counts.heads % (s.tp * s.cp):
        return f"tp x cp = {s.tp * s.cp} does not divide the {counts.heads} attention heads"
    if counts.kv_heads and counts.kv_heads % s.tp:
        return f"tp {s.tp} does not divide the {counts.kv_heads} key/value heads"
    if s.ep > 1 and counts.experts % s.ep:
        return f"ep {s.ep} does not divide the {counts.experts} experts"
    if s.cp > 1 and not any(counts.block_kv):  # the ring's cost is what it passes: the keys and values SDPA reads
        return ("cp is forecast for attention through F.scaled_dot_product_attention; the count saw none (a model "
                "whose attention is its own, eager: its ring cannot be costed)")
    if s.stages > counts.layers and s.pp > 1:
        return f"{s.stages} pipeline stages ({s.schedule}) exceed the {counts.layers} blocks"
    if s.cp > 1 and run.seq_len % (2 * s.cp):
        return f"sequence {run.seq_len} does not cut into 2 x cp = {2 * s.cp} chunks"
    try:  # the BatchPlan's own rule and line
        m = BatchPlan(run.global_batch, s.dp_size, micro_batch=s.micro_batch).accum_steps
    except UsageError as err:
        return str(err)
    # The schedule's own rule on its micro-batch count, as mg.parallel.pipeline refuses it.
    return microbatches_refusal(s.schedule, s.pp, m) if s.pp > 1 else None


def _as_named(layout: Layout, named: list[Layout] | None) -> list[Layout]:
    """``layout`` as each of ``named`` with its degrees asks for it (its schedule under pp, and the stages per rank
    it gives there; its micro-batch where it gives one; the blocks of each stage it recomputes,
    ``checkpoint_blocks``; its sequence parallelism); ``[layout]`` where nothing is named."""
    if named is None:
        return [layout]
    degrees = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep", "zero1")
    found = [dataclasses.replace(layout, stages_per_rank=n.stages_per_rank if layout.pp > 1 else None,
                                 activation_checkpointing=n.checkpoint_blocks is not None,
                                 checkpoint_blocks=n.checkpoint_blocks, sequence_parallel=n.sequence_parallel)
             for n in named if all(getattr(layout, d) == getattr(n, d) for d in degrees)
             and (n.pp == 1 or n.schedule == layout.schedule)
             and (n.micro_batch is None or n.micro_batch == layout.micro_batch)]
    return list(dict.fromkeys(found))


def plan(counts: Counts, cluster: Cluster, run: Run, a: Assumptions, *, micro_batches=(1, 2, 4, 8),
         recompute=("none", "full"), schedules=("1f1b", "interleaved_1f1b"),
         named: list[Layout] | None = None) -> tuple[list[dict], list[dict]]:
    """(forecasts ranked: fitting first, then tokens/s per GPU, then the lesser memory and the name, so a tie is
    broken the same way every time; the layouts left out with their reason). ``named``: only those layouts, built
    by multigpu or only described (each entry's ``unbuilt``: why multigpu does not build it, or None)."""
    from ..parallel.space import layouts, name

    ranked, out = [], []
    if named:
        schedules = tuple(dict.fromkeys((*schedules, *(n.schedule for n in named if n.pp > 1))))
        micro_batches = tuple(dict.fromkeys((*micro_batches, *(n.micro_batch for n in named if n.micro_batch))))
    for base in layouts(cluster.gpus, schedules=schedules, context=True, experts=counts.experts > 0, zero1=True,
                        described=bool(named)):
        for mb in micro_batches:
            for layout in _as_named(dataclasses.replace(base, micro_batch=mb), named):
                why = _why_not(counts, layout, run)
                if why:
                    out.append({"layout": name(layout), "reason": why})
                    continue
                # A layout that recomputes the first k blocks of each stage is forecast so (full recompute on those).
                for rc in (("full",) if layout.checkpoint_blocks else recompute):
                    # The model cuts every saved tensor by tp, as sequence parallelism does: the command asks for it
                    # (not beside ep or cp, which multigpu does not build yet, unless a named layout names it).
                    sp = layout.sequence_parallel or (layout.tp > 1 and layout.ep == layout.cp == 1)
                    chosen = dataclasses.replace(layout, activation_checkpointing=rc == "full", sequence_parallel=sp)
                    got = predict(counts, cluster, chosen, dataclasses.replace(run, recompute=rc), a)
                    ranked.append({"name": name(chosen), "layout": chosen, "recompute": rc, **got,
                                   "unbuilt": chosen.unbuilt()})
    if not ranked:
        reasons = sorted({o["reason"] for o in out})
        what = "the named layouts" if named else "no layout"
        if named and not reasons:
            raise UsageError(f"--layout names no layout forecast enumerates on {cluster.gpus} GPUs "
                             f"({', '.join(n.label for n in named)}); forecast leaves it out of its own list too")
        raise UsageError(f"{what} of {cluster.gpus} GPUs {'fit' if named else 'fits'} {counts.name} with global batch "
                         f"{run.global_batch}: " + "; ".join(reasons[:3]))
    ranked.sort(key=lambda f: (not f["fits"], -f["tokens_per_s_per_gpu"], f["memory_bytes"], f["name"]))
    return ranked, out
