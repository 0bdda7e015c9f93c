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
from ..parallel.space import layouts


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


