"""The layouts ``multigpu tune`` weighs: every way the GPT recipe can spread one model over N ranks.

A ``Candidate`` is a data-parallel strategy (DDP, FSDP, HSDP) times tensor-
and pipeline-parallel degrees, a micro-batch size, activation checkpointing on
or off and, with a pipeline, a schedule. ``candidates`` lists those that compute
the same training (same model, same global batch) and says why each other
combination is out; ``Candidate.args`` is the recipe's command line for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..values import divisors


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
        return global_batch // (self.dp_size * self.micro_batch)

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
    """(the candidates, the combinations left out with their reason) for ``world`` ranks."""
    if world < 1:
        raise UsageError(f"tune needs at least 1 rank, got {world}")
    found: list[Candidate] = []
    out: list[dict] = []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            dp = world // (pp * tp)
            why = _why_not(cfg, tp, pp, dp, global_batch)
            if why:
                out.append({"layout": f"DP {dp} x TP {tp} x PP {pp}", "reason": why})
                continue
            shapes = [("ddp", dp, 1)] if tp == 1 and pp == 1 else []
            shapes += [("fsdp", 1, dp)] + [("hsdp", r, dp // r) for r in divisors(dp) if 1 < r < dp]
            per_rank = global_batch // dp
            sizes = [m for m in (micro_batches or _powers_of_two(per_rank)) if per_rank % m == 0]
            for dp_kind, rep, shard in shapes:
                for m in sizes:
                    micro = per_rank // m
                    if pp > 1 and micro < pp:
                        out.append({"layout": f"PP {pp}, micro-batch {m}",
                                    "reason": f"{micro} micro-batches per step, fewer than {pp} stages"})
                        continue
                    for ac in (False, True):
                        for schedule in (schedules if pp > 1 else (None,)):
                            found.append(Candidate(dp_kind, rep, shard, tp, pp, m, ac, schedule))
    if not found:
        raise UsageError(f"no layout of {world} ranks fits this model and global batch {global_batch}: "
                         + "; ".join(f"{o['layout']}: {o['reason']}" for o in out[:4]))
    return found, out


def _powers_of_two(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if (1 << k) <= n]


def _why_not(cfg, tp: int, pp: int, dp: int, global_batch: int) -> str | None:
    if global_batch % dp:
        return f"global batch {global_batch} does not split over {dp} data-parallel ranks"
    if tp > 1:
        bad = [f"{name} {n}" for name, n in (("n_head", cfg.n_head), ("4 x n_embd", 4 * cfg.n_embd),
                                             ("vocab_size", cfg.vocab_size)) if n % tp]
        if bad:
            return f"TP {tp} does not divide {', '.join(bad)}"
    if pp > 1:
        if cfg.tie_embeddings:
            return "a pipeline puts the token table and the head on two stages: the model must be untied (--untied)"
        if pp > cfg.n_layer:
            return f"{pp} stages for {cfg.n_layer} blocks"
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
