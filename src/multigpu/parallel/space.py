"""Every ``Layout`` of N ranks, and a layout's label: what ``multigpu tune`` measures and ``multigpu forecast``
predicts, below both (neither imports the other for them).

``layouts`` lists each factoring of the world into (pp, dp_replicate, dp_shard, tp) that the mesh accepts (with
experts, context parallelism and ZeRO-1 when asked); ``name`` is the reports' label of one.
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from ..runtime.values import divisors
from .layout import Layout


def name(layout: Layout) -> str:
    """The report's label of a candidate, e.g. ``HSDP 2x2, micro-batch 4, AC`` or ``FSDP 8 x TP 2, EP 4,
    micro-batch 1`` (one rank: ``FSDP 1``)."""
    # ZeRO-1 of the replicas, also beside tp or pp where a layout only describes it (``Layout.unbuilt``)
    s, kind = layout, "ddp" if layout.zero1 else layout.strategy
    ddp = f"{'ZeRO-1' if s.zero1 else 'DDP'} {s.dp_size}"
    parts = [{"ddp": ddp, "hsdp": f"HSDP {s.dp_replicate}x{s.dp_shard}"}.get(kind, f"FSDP {s.dp_shard}")] \
        if s.dp_size > 1 or s.tp == s.pp == 1 else []
    for degree, label in ((s.cp, "CP"), (s.tp, "TP")):
        if degree > 1:
            parts.append(f"{label} {degree}")
    if s.pp > 1:
        per_rank = f" ({s.stages // s.pp} stages a rank)" if s.stages_per_rank is not None else ""  # where asked
        parts.append(f"PP {s.pp} {layout.schedule}{per_rank}")
    experts = f", EP {s.ep}" if s.ep > 1 else ""  # borrowed from dp_shard and tp: no factor of the world of its own
    return " x ".join(parts) + experts + f", micro-batch {layout.micro_batch}" + _checkpointing(layout)


def _checkpointing(layout: Layout) -> str:
    if not layout.activation_checkpointing:
        return ""
    return ", AC" + (f" of {layout.checkpoint_blocks} blocks a stage" if layout.checkpoint_blocks else "")


def layouts(world: int, *, micro_batches: list[int] | None = None,
            schedules: tuple[str, ...] = ("1f1b",), experts: bool = False, context: bool = False,
            zero1: bool = False, described: bool = False) -> list[Layout]:
    """Every ``Layout`` of ``world`` ranks, for a script that reads its layout from its command line: each
    factoring of the world into (pp, dp_replicate, dp_shard, tp) that the mesh itself accepts, times the
    micro-batch sizes (None: the script's own) and, with a pipeline, the schedules; with ``experts`` (a
    mixture of experts) each ep > 1 of tp x a divisor of dp_shard too; with ``context`` each cp > 1 that divides
    what dp_replicate and tp leave; with ``zero1`` each layout whose data parallelism only replicates with its
    optimizer state sharded too. What multigpu does not build yet (``Layout.unbuilt``: cp beside a pipeline,
    ZeRO-1 beside tp or pp) is left out, unless ``described`` (the forecast of a layout a user names).
    The script refuses those its model or batch cannot take (heads tp does not divide, a batch that does
    not split, experts ep does not divide)."""
    if world < 1:
        raise UsageError(f"tune needs at least 1 rank, got {world}")
    found = []
    for pp in divisors(world):
        for rep in divisors(world // pp):
            for tp in divisors(world // (pp * rep)):
                for m in micro_batches or [None]:
                    for schedule in (schedules if pp > 1 else ("1f1b",)):  # dp_shard takes the rest
                        layout = Layout(dp_replicate=rep, tp=tp, pp=pp, micro_batch=m, schedule=schedule).resolve(world)
                        # ep takes every tp rank and a divisor of dp_shard (dp_shard x tp = efsdp x ep)
                        eps = [d * tp for d in divisors(layout.dp_shard) if d * tp > 1] if experts else []
                        # ZeRO-1 shards the optimizer state over the replicas (FSDP's dp_shard shards it already)
                        zero = [dataclasses.replace(layout, zero1=True)] if zero1 and rep > 1 and layout.dp_shard == 1 \
                            else []
                        cps = [dataclasses.replace(layout, cp=cp, dp_shard=layout.dp_shard // cp)
                               for cp in divisors(layout.dp_shard) if cp > 1] if context else []
                        found += [x for x in [layout, *(dataclasses.replace(layout, ep=ep) for ep in eps), *zero, *cps]
                                  if described or not x.unbuilt()]  # the builders' one rule
    return found
