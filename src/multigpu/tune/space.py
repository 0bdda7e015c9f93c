"""The candidates ``multigpu tune`` weighs, for any workload: every way to spread one model over N ranks.

A candidate is a ``mg.parallel.Layout`` with every degree given (its data-parallel strategy, DDP, FSDP
or HSDP, is the Layout's own reading of the degrees), a micro-batch size, activation checkpointing on
or off and, with a pipeline, a schedule. ``candidates`` takes the mesh's own factorings (``layouts``) and
weighs each with every micro-batch that splits a rank's share of the global batch and checkpointing off and
on; the workload says which it would refuse and why (the GPT recipe: ``gpt_refusal``, the Layout's size rules
on the GPT's sizes; a script: its own, asked on its model). ``layout.flags`` is the command line for one, and
the accumulation is the ``BatchPlan``'s (``Layout.accum_steps``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..errors import UsageError
from ..parallel.layout import Layout
from ..parallel.pp import microbatches_refusal


def candidates(found: list[Layout], global_batch: int, refuse: Callable[[Layout], str | None], *,
               micro_batches: list[int] | None = None, model: str = "this model") -> tuple[list[Layout], list[dict]]:
    """(the candidate Layouts, those left out with their reason) of the resolved layouts ``found`` (the mesh's
    factorings, ``parallel.space.layouts``): each with every micro-batch size (``micro_batches``, else the powers
    of 2) that divides a rank's share of ``global_batch``, checkpointing off and on, less those ``refuse`` says
    the workload would not run (a reason once per layout: the first micro-batch's)."""
    kept: list[Layout] = []
    out: list[dict] = []
    for layout in found:
        share = global_batch // layout.dp_size
        sizes = splits(share, micro_batches)
        if micro_batches and not sizes:  # the sizes asked for, not a size nobody asked for
            out.append({"layout": layout.label, "degrees": layout.label, "reason": f"--micro-batches "
                        f"{','.join(map(str, micro_batches))} divides no rank's share of {share} sequences"})
            continue
        for m in sizes or [1]:  # 1: the batch's own refusal
            chosen = dataclasses.replace(layout, micro_batch=m)
            why = refuse(chosen)
            if why is None:
                kept += [dataclasses.replace(chosen, activation_checkpointing=ac) for ac in (False, True)]
            elif why not in (o["reason"] for o in out if o["degrees"] == layout.label):
                out.append({"layout": chosen.label, "reason": why, "degrees": layout.label})
    if not kept:
        raise UsageError(f"no layout of {found[0].world_size} ranks fits {model} and global batch {global_batch}: "
                         + "; ".join(f"{o['layout']}: {o['reason']}" for o in out[:4]) + "; change -n or the global batch")
    return kept, [{"layout": o["layout"], "reason": o["reason"]} for o in out]


def splits(per_rank: int, asked: list[int] | None = None) -> list[int]:
    """The micro-batch sizes (``asked``, else the powers of 2) that divide a rank's share of the global batch."""
    return [m for m in (asked or [1 << k for k in range(per_rank.bit_length())]) if per_rank % m == 0]


def pipeline_short(layout: Layout, global_batch: int) -> str | None:
    """Why ``layout``'s pipeline schedule cannot run its micro-batches a step (the BatchPlan's count), in the
    library's own line (``pp.microbatches_refusal``, which ``mg.parallel.pipeline`` raises), or None. Raises
    the BatchPlan's UsageError where the global batch does not split (any layout)."""
    accum = layout.accum_steps(global_batch)
    return microbatches_refusal(layout.schedule, layout.pp, accum) if layout.pp > 1 else None


def gpt_refusal(cfg, global_batch: int) -> Callable[[Layout], str | None]:
    """Why the GPT recipe would not run a layout of its model ``cfg``: the BatchPlan's split, then the recipe's
    own rule (the Layout's size rules on the GPT's sizes), then the schedule's micro-batches; or None."""
    from ..batch import check_splits
    from ..recipes.gpt.parallelize import check_layout

    def why(layout: Layout) -> str | None:
        try:
            check_splits(global_batch, [(f"{layout.dp_size} data-parallel ranks", layout.dp_size)])
            check_layout(cfg, layout)
            return pipeline_short(layout, global_batch)
        except UsageError as err:
            return str(err)

    return why
