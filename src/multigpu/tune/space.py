"""The layouts ``multigpu tune`` weighs: every way the GPT recipe can spread one model over N ranks.

A candidate is a ``mg.parallel.Layout`` with every degree given (its data-parallel strategy, DDP, FSDP
or HSDP, is the Layout's own reading of the degrees), a micro-batch size, activation checkpointing on
or off and, with a pipeline, a schedule. ``candidates`` lists those that compute the same training
(same model, same global batch) and says why each other combination is out; ``name`` is the report's
label, ``recipe_args`` the recipe's command line for one. The degrees are the mesh's own factorings
(``layouts``, which a script's tune runs as they are), checked by the ``Layout``'s size rules; the
accumulation is the ``BatchPlan``'s (``Layout.accum_steps``).
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError
from ..parallel.layout import Layout
from ..runtime.values import divisors


def name(layout: Layout) -> str:
    """The report's label of a candidate, e.g. ``HSDP 2x2, micro-batch 4, AC`` (one rank: ``FSDP 1``)."""
    world = layout.world_size
    s, kind = layout.shape(world), layout.strategy(world)
    parts = [{"ddp": f"DDP {s.dp}", "hsdp": f"HSDP {s.dp_replicate}x{s.dp_shard}"}.get(kind, f"FSDP {s.dp_shard}")] \
        if s.dp > 1 or s.tp == s.pp == 1 else []
    if s.tp > 1:
        parts.append(f"TP {s.tp}")
    if s.pp > 1:
        parts.append(f"PP {s.pp} {layout.schedule}")
    return " x ".join(parts) + f", micro-batch {layout.micro_batch}" + (", AC" if layout.activation_checkpointing else "")


def recipe_args(layout: Layout) -> list[str]:
    """The GPT recipe's flags for a candidate (added to the user's own)."""
    out = ["--micro-batch", str(layout.micro_batch)]
    if layout.strategy(layout.world_size) == "ddp":
        out.append("--ddp")
    else:
        out += ["--dp-replicate", str(layout.dp_replicate), "--dp-shard", str(layout.dp_shard)]
    if layout.tp > 1:
        out += ["--tp", str(layout.tp)]
    if layout.pp > 1:
        out += ["--pp", str(layout.pp), "--schedule", layout.schedule]
    if layout.activation_checkpointing:
        out.append("--activation-checkpointing")
    return out


def candidates(world: int, cfg, global_batch: int, *, micro_batches: list[int] | None = None,
               schedules: tuple[str, ...] = ("1f1b", "gpipe")) -> tuple[list[Layout], list[dict]]:
    """(the candidate Layouts, the combinations left out with their reason) for ``world`` ranks: the mesh's
    own factorings (``layouts``), the Layout's size rules, the BatchPlan's accumulation."""
    found: list[Layout] = []
    out: list[dict] = []
    for layout in layouts(world):
        s = layout.shape(world)
        why = _why_not(cfg, s, global_batch)
        if why:
            entry = {"layout": f"DP {s.dp} x TP {s.tp} x PP {s.pp}", "reason": why}
            out += [entry] if entry not in out else []  # one line per degrees, not per data-parallel split
            continue
        if layout.strategy(world) == "hsdp" and s.dp_shard == 1:
            continue  # replication alone beside TP or PP: the recipe's data parallelism there is FSDP's (sharded)
        per_rank = global_batch // s.dp
        for m in [m for m in (micro_batches or _powers_of_two(per_rank)) if per_rank % m == 0]:
            accum = dataclasses.replace(layout, micro_batch=m).accum_steps(global_batch)
            if s.pp > 1 and accum < s.pp:
                out.append({"layout": f"PP {s.pp}, micro-batch {m}",
                            "reason": f"{accum} micro-batches per step, fewer than {s.pp} stages"})
                continue
            for ac in (False, True):
                for schedule in (schedules if s.pp > 1 else (layout.schedule,)):
                    found.append(dataclasses.replace(layout, micro_batch=m, activation_checkpointing=ac,
                                                     schedule=schedule))
    if not found:
        raise UsageError(f"no layout of {world} ranks fits this model and global batch {global_batch}: "
                         + "; ".join(f"{o['layout']}: {o['reason']}" for o in out[:4]))
    return found, out


def _powers_of_two(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if (1 << k) <= n]


def _why_not(cfg, s, global_batch: int) -> str | None:
    if global_batch % s.dp:
        return f"global batch {global_batch} does not split over {s.dp} data-parallel ranks"
    try:  # the Layout's own rules: TP divides the heads, the MLP width and the vocabulary; stages <= blocks
        Layout(tp=s.tp).check_sizes(heads=cfg.n_head, hidden=4 * cfg.n_embd, vocab=cfg.vocab_size, model="the model")
        if s.pp > 1 and cfg.tie_embeddings:
            return "a pipeline puts the token table and the head on two stages: the model must be untied (--untied)"
        Layout(pp=s.pp).check_sizes(blocks=cfg.n_layer, model="the model")
    except UsageError as err:
        return str(err)
    return None


def layouts(world: int, *, micro_batches: list[int] | None = None,
            schedules: tuple[str, ...] = ("1f1b",)) -> list[Layout]:
    """Every ``Layout`` of ``world`` ranks, for a script that reads its layout from its command line: each
    factoring of the world into (pp, dp_replicate, dp_shard, tp) that the mesh itself accepts, times the
    micro-batch sizes (None: the script's own) and, with a pipeline, the schedules. The script refuses
    those its model or batch cannot take (heads tp does not divide, a batch that does not split)."""
    from ..parallel.mesh import factor

    if world < 1:
        raise UsageError(f"tune needs at least 1 rank, got {world}")
    found = []
    for pp in divisors(world):
        for rep in divisors(world // pp):
            for tp in divisors(world // (pp * rep)):
                shape = factor(world, tp=tp, dp_replicate=rep, pp=pp)  # dp_shard takes the rest
                for m in micro_batches or [None]:
                    for schedule in (schedules if pp > 1 else ("1f1b",)):
                        found.append(Layout(dp_replicate=shape.dp_replicate, dp_shard=shape.dp_shard, tp=shape.tp,
                                            pp=shape.pp, micro_batch=m, schedule=schedule))
    return found
