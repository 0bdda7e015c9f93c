"""The layouts ``multigpu tune`` weighs: every way the GPT recipe can spread one model over N ranks.

A ``Candidate`` is a data-parallel strategy (DDP, FSDP, HSDP) times tensor-
and pipeline-parallel degrees, a micro-batch size, activation checkpointing on
or off and, with a pipeline, a schedule. ``candidates`` lists those that compute
the same training (same model, same global batch) and says why each other
combination is out; ``Candidate.args`` is the recipe's command line for it. The
degrees are the mesh's own factorings (``layouts``, which a script's tune runs as they
are), checked by the ``Layout``'s size rules; the accumulation is the ``BatchPlan``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..runtime.values import divisors


@dataclass(frozen=True)
class Candidate:
    dp: str  # "ddp" | "fsdp" | "hsdp"
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    micro_batch: int
    activation_checkpointing: bool
    schedule: str | None = None  # with pp > 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        parts = [{"ddp": f"DDP {self.dp_size}", "fsdp": f"FSDP {self.dp_shard}",
                  "hsdp": f"HSDP {self.dp_replicate}x{self.dp_shard}"}[self.dp]] if self.dp_size > 1 or self.tp == self.pp == 1 else []
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp} {self.schedule}")
        return " x ".join(parts) + f", micro-batch {self.micro_batch}" + (", AC" if self.activation_checkpointing else "")

    def accum(self, global_batch: int) -> int:
        from ..batch import BatchPlan

        return BatchPlan(global_batch, self.dp_size, micro_batch=self.micro_batch).accum_steps

    def args(self) -> list[str]:
        """The GPT recipe's flags for this layout (added to the user's own)."""
        out = ["--micro-batch", str(self.micro_batch)]
        if self.dp == "ddp":
            out.append("--ddp")
        else:
            out += ["--dp-replicate", str(self.dp_replicate), "--dp-shard", str(self.dp_shard)]
        if self.tp > 1:
            out += ["--tp", str(self.tp)]
        if self.pp > 1:
            out += ["--pp", str(self.pp), "--schedule", self.schedule or "1f1b"]
        if self.activation_checkpointing:
            out.append("--activation-checkpointing")
        return out


def candidates(world: int, cfg, global_batch: int, *, micro_batches: list[int] | None = None,
               schedules: tuple[str, ...] = ("1f1b", "gpipe")) -> tuple[list[Candidate], list[dict]]:
    """(the candidates, the combinations left out with their reason) for ``world`` ranks: the mesh's own
    factorings (``layouts``), the Layout's size rules, the BatchPlan's accumulation."""
    from ..batch import BatchPlan

    found: list[Candidate] = []
    out: list[dict] = []
    for layout in layouts(world):
        s = layout.shape(world)
        why = _why_not(cfg, s, global_batch)
        if why:
            entry = {"layout": f"DP {s.dp} x TP {s.tp} x PP {s.pp}", "reason": why}
            out += [entry] if entry not in out else []  # one line per degrees, not per data-parallel split
            continue
        kind = layout.strategy(world)
        if kind == "hsdp" and s.dp_shard == 1:
            continue  # replication alone beside TP or PP: the recipe's data parallelism there is FSDP's (sharded)
        kind = "fsdp" if kind == "none" else kind  # one data-parallel rank: the recipe's FSDP over nobody
        per_rank = global_batch // s.dp
        for m in [m for m in (micro_batches or _powers_of_two(per_rank)) if per_rank % m == 0]:
            accum = BatchPlan(global_batch, s.dp, micro_batch=m).accum_steps
            if s.pp > 1 and accum < s.pp:
                out.append({"layout": f"PP {s.pp}, micro-batch {m}",
                            "reason": f"{accum} micro-batches per step, fewer than {s.pp} stages"})
                continue
            for ac in (False, True):
                for schedule in (schedules if s.pp > 1 else (None,)):
                    found.append(Candidate(kind, s.dp_replicate, s.dp_shard, s.tp, s.pp, m, ac, schedule))
    if not found:
        raise UsageError(f"no layout of {world} ranks fits this model and global batch {global_batch}: "
                         + "; ".join(f"{o['layout']}: {o['reason']}" for o in out[:4]))
    return found, out


def _powers_of_two(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if (1 << k) <= n]


def _why_not(cfg, s, global_batch: int) -> str | None:
    from ..parallel.layout import Layout

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
            schedules: tuple[str, ...] = ("1f1b",)) -> list:
    """Every ``Layout`` of ``world`` ranks, for a script that reads its layout from its command line: each
    factoring of the world into (pp, dp_replicate, dp_shard, tp) that the mesh itself accepts, times the
    micro-batch sizes (None: the script's own) and, with a pipeline, the schedules. The script refuses
    those its model or batch cannot take (heads tp does not divide, a batch that does not split)."""
    from ..parallel.layout import Layout
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
