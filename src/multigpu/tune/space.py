"""The layouts ``multigpu tune`` weighs: every way the GPT recipe can spread one model over N ranks.

A candidate is a ``mg.parallel.Layout`` with every degree given (its data-parallel strategy, DDP, FSDP
or HSDP, is the Layout's own reading of the degrees), a micro-batch size, activation checkpointing on
or off and, with a pipeline, a schedule. ``candidates`` lists those that compute the same training
(same model, same global batch) and says why each other combination is out; ``name`` is the report's
label, ``layout.flags`` the recipe's command line for one (as for any script). The degrees are the mesh's own factorings
(``layouts``, which a script's tune runs as they are), checked by the ``Layout``'s size rules; the
accumulation is the ``BatchPlan``'s (``Layout.accum_steps``).
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from ..parallel.layout import Layout
from ..parallel.pp import microbatches_refusal
from ..runtime.values import divisors


def name(layout: Layout) -> str:
    """The report's label of a candidate, e.g. ``HSDP 2x2, micro-batch 4, AC`` or ``FSDP 8 x TP 2, EP 4,
    micro-batch 1`` (one rank: ``FSDP 1``)."""
    s, kind = layout, layout.strategy
    parts = [{"ddp": f"DDP {s.dp_size}", "hsdp": f"HSDP {s.dp_replicate}x{s.dp_shard}"}.get(kind, f"FSDP {s.dp_shard}")] \
        if s.dp_size > 1 or s.tp == s.pp == 1 else []
    for degree, label in ((s.cp, "CP"), (s.tp, "TP")):
        if degree > 1:
            parts.append(f"{label} {degree}")
    if s.pp > 1:
        parts.append(f"PP {s.pp} {layout.schedule}")
    experts = f", EP {s.ep}" if s.ep > 1 else ""  # borrowed from dp_shard and tp: no factor of the world of its own
    return " x ".join(parts) + experts + f", micro-batch {layout.micro_batch}" + (", AC" if layout.activation_checkpointing else "")


def candidates(world: int, cfg, global_batch: int, *, micro_batches: list[int] | None = None,
               schedules: tuple[str, ...] = ("1f1b", "gpipe")) -> tuple[list[Layout], list[dict]]:
    """(the candidate Layouts, the combinations left out with their reason) for ``world`` ranks: the mesh's
    own factorings (``layouts``), the Layout's size rules, the BatchPlan's accumulation."""
    found: list[Layout] = []
    out: list[dict] = []
    for layout in layouts(world):
        s = layout
        why = _why_not(cfg, s, global_batch)
        if why:
            entry = {"layout": f"DP {s.dp_size} x TP {s.tp} x PP {s.pp}", "reason": why}
            out += [entry] if entry not in out else []  # one line per degrees, not per data-parallel split
            continue
        if layout.strategy == "hsdp" and s.dp_shard == 1:
            continue  # replication alone beside TP or PP: the recipe's data parallelism there is FSDP's (sharded)
        for m in splits(global_batch // s.dp_size, micro_batches):
            for schedule in (schedules if s.pp > 1 else (layout.schedule,)):
                chosen = dataclasses.replace(layout, micro_batch=m, schedule=schedule)
                short = pipeline_short(chosen, global_batch)
                if short:
                    out.append({"layout": f"PP {s.pp} {schedule}, micro-batch {m}", "reason": short})
                    continue
                found += [dataclasses.replace(chosen, activation_checkpointing=ac) for ac in (False, True)]
    if not found:
        raise UsageError(f"no layout of {world} ranks fits this model and global batch {global_batch}: "
                         + "; ".join(f"{o['layout']}: {o['reason']}" for o in out[:4]))
    return found, out


def splits(per_rank: int, asked: list[int] | None = None) -> list[int]:
    """The micro-batch sizes (``asked``, else the powers of 2) that divide a rank's share of the global batch."""
    return [m for m in (asked or [1 << k for k in range(per_rank.bit_length())]) if per_rank % m == 0]


def pipeline_short(layout: Layout, global_batch: int) -> str | None:
    """Why ``layout``'s pipeline schedule cannot run its micro-batches a step (the BatchPlan's count), in the
    library's own line (``pp.microbatches_refusal``, which ``mg.parallel.pipeline`` raises), or None. Raises
    the BatchPlan's UsageError where the global batch does not split (any layout)."""
    accum = layout.accum_steps(global_batch)
    return microbatches_refusal(layout.schedule, layout.pp, accum) if layout.pp > 1 else None


def _why_not(cfg, s, global_batch: int) -> str | None:
    from ..batch import check_splits
    from ..recipes.gpt.parallelize import check_layout

    try:  # BatchPlan's rule, then the recipe's own: the Layout's size rules on the GPT's sizes
        check_splits(global_batch, [(f"{s.dp_size} data-parallel ranks", s.dp_size)])
        check_layout(cfg, s)
    except UsageError as err:
        return str(err)
    return None


def layouts(world: int, *, micro_batches: list[int] | None = None,
            schedules: tuple[str, ...] = ("1f1b",), experts: bool = False, context: bool = False) -> list[Layout]:
    """Every ``Layout`` of ``world`` ranks, for a script that reads its layout from its command line: each
    factoring of the world into (pp, dp_replicate, dp_shard, tp) that the mesh itself accepts, times the
    micro-batch sizes (None: the script's own) and, with a pipeline, the schedules; with ``experts`` (a
    mixture of experts) each ep > 1 of tp x a divisor of dp_shard too; with ``context`` each cp > 1 that divides
    what dp_replicate and tp leave, without a pipeline.
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
                        found += [layout] + [dataclasses.replace(layout, ep=ep) for ep in eps]
                    if context and pp == 1:
                        found += [Layout(dp_replicate=rep, tp=tp, cp=cp, micro_batch=m).resolve(world)
                                  for cp in divisors(world // (rep * tp)) if cp > 1]
    return found
