"""One layout: the mesh degrees and the choices that go with them, and every rule that follows from them, once.

A ``Layout`` is what a run is spread by: data parallelism replicated
(``dp_replicate``) and sharded (``dp_shard``; None takes what the other
degrees leave of the world), tensor parallelism (``tp``), pipeline stages
(``pp``), the micro-batch, activation checkpointing and the pipeline schedule.
The strategy is read from the degrees, not named twice: replicate-only is DDP,
any sharding is FSDP (HSDP with both), and FSDP also carries data parallelism
beside TP or PP (DDP does not compose with them; torchtitan refuses it too).
``BatchPlan`` stays the only batch arithmetic: ``layout.plan`` builds one over
the data-parallel ranks, so ``accum_steps`` is the micro-batch count.

>>> layout = mg.parallel.Layout(tp=2, micro_batch=4)
>>> model = mg.parallelize(model, layout)
>>> plan = layout.plan(global_batch=32, dist=dist)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.share import LAYOUT_ATTR, DataShare, describe  # noqa: F401 (LAYOUT_ATTR: read here by noise, tests)
from ..errors import UsageError
from ..runtime.values import is_positive_int, positive_int
from .mesh import DIMS, Mesh, MeshShape, factor
from .pp import SCHEDULES, stage_ids, stages_per_rank


@dataclass(frozen=True)
class Layout:
    """Mesh degrees (outer to inner: pp, dp_replicate, dp_shard, tp), the micro-batch, activation
    checkpointing per block, ``torch.compile`` per block, sequence parallelism and the pipeline schedule."""

    dp_replicate: int = 1
    dp_shard: int | None = None
    tp: int = 1
    pp: int = 1
    micro_batch: int | None = None
    activation_checkpointing: bool = False
    compile: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp") + (("dp_shard",) if self.dp_shard is not None else ()):
            positive_int(getattr(self, name), f"layout {name}", f"e.g. mg.parallel.Layout({name}=2)")
        if self.micro_batch is not None and not is_positive_int(self.micro_batch):
            raise UsageError(f"layout micro_batch must be a positive integer or None, got {self.micro_batch!r}")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown pipeline schedule {self.schedule!r}; expected one of {', '.join(SCHEDULES)}")
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("sequence_parallel splits the sequence over tensor-parallel ranks but tp is 1; "
                             "use Layout(tp=2, sequence_parallel=True) or drop it")

    @classmethod
    def of(cls, mesh: Mesh) -> "Layout":
        """The layout a mesh was built for (its degrees; the other fields at their defaults)."""
        s = mesh.shape
        return cls(dp_replicate=s.dp_replicate, dp_shard=s.dp_shard, tp=s.tp, pp=s.pp)

    @property
    def world_size(self) -> int | None:
        """The processes this layout spans when every degree is given (None while ``dp_shard`` is left to
        the world)."""
        return None if self.dp_shard is None else self.pp * self.dp_replicate * self.dp_shard * self.tp

    def accum_steps(self, global_batch: int, world_size: int | None = None) -> int:
        """Micro-batches per optimizer step on ``world_size`` processes (default: the layout's own): the
        ``BatchPlan``'s count over the data-parallel ranks, not a second arithmetic."""
        from ..batch import BatchPlan

        world = self.world_size if world_size is None else world_size
        if world is None:
            raise UsageError("the layout leaves dp_shard to the world size; pass world_size, or give dp_shard")
        return BatchPlan(global_batch, self.shape(world).dp, micro_batch=self.micro_batch).accum_steps

    def shape(self, world_size: int) -> MeshShape:
        """The degrees on ``world_size`` processes; a layout for another number of processes is refused."""
        return factor(world_size, tp=self.tp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, pp=self.pp)

    def strategy(self, world_size: int) -> str:
        """How the data-parallel degrees are applied: ``none``, ``ddp`` (replicate only, nothing else
        parallel), ``fsdp`` (shard) or ``hsdp`` (replicate x shard, or replicate beside TP/PP)."""
        s = self.shape(world_size)
        if s.dp == 1:
            return "none"
        if s.dp_shard == 1 and s.tp == 1 and s.pp == 1:
            return "ddp"
        return "hsdp" if s.dp_replicate > 1 else "fsdp"

    def dp_rank(self, rank: int, world_size: int) -> int:
        """The data-parallel rank of global ``rank``: the mesh's flattened (replicate, shard) coordinate."""
        s = self.shape(world_size)
        return (rank // s.tp) % s.dp

    def data_share(self, rank: int, world_size: int) -> DataShare:
        """What global ``rank`` evaluates and counts: its data-parallel rank's share (its tensor-parallel
        peers and pipeline stages read the same), and its sums count when it is tensor-parallel peer 0 on
        the rank that holds the last pipeline stage (placed by the schedule): each data-parallel rank once."""
        s = self.shape(world_size)
        last_stage = s.pp * stages_per_rank(self.schedule) - 1
        holds_last = last_stage in stage_ids(self.schedule, rank // (s.dp * s.tp), s.pp)
        return DataShare(self.dp_rank(rank, world_size), s.dp, counts=holds_last and rank % s.tp == 0, pp=s.pp,
                         layout=describe(s))

    def plan(self, global_batch: int, dist: Any, max_micro_batch: int | None = None):
        """The ``BatchPlan`` over this layout's data-parallel ranks, bound to this process's one."""
        from ..batch import BatchPlan

        s = self.shape(dist.world_size)
        return BatchPlan(global_batch, s.dp, micro_batch=self.micro_batch, max_micro_batch=max_micro_batch,
                         dp_rank=self.dp_rank(dist.rank, dist.world_size))

    def mesh(self, world_size: int, device_type: str) -> Mesh:
        """The device mesh (collective: every rank calls it), after the degrees are checked."""
        from .mesh import device_mesh

        s = self.shape(world_size)
        return Mesh(s, device_mesh(device_type, (s.pp, s.dp_replicate, s.dp_shard, s.tp), DIMS))

    def check_sizes(self, *, heads: int | None = None, kv_heads: int | None = None, hidden: int | None = None,
                    vocab: int | None = None, seq: int | None = None, blocks: int | None = None,
                    model: str = "the model") -> None:
        """Refuse a TP degree that does not divide what it shards (heads, KV heads, hidden units,
        vocabulary, and the sequence under sequence parallelism) and more pipeline stages than blocks."""
        sizes = {"attention heads": heads, "KV heads": kv_heads, "hidden units": hidden, "vocabulary": vocab}
        if self.sequence_parallel:
            sizes["sequence length"] = seq  # sequence parallelism splits it
        sizes = {k: v for k, v in sizes.items() if v is not None}
        bad = [f"{name} {n}" for name, n in sizes.items() if n % self.tp]
        if bad:
            fits = [d for d in range(1, self.tp + 1) if all(n % d == 0 for n in sizes.values())]
            raise UsageError(f"tensor-parallel degree {self.tp} does not divide {', '.join(bad)} of {model}; "
                             f"use tp={max(fits)}, or a model whose sizes it divides")
        stages = self.pp * stages_per_rank(self.schedule)
        if blocks is not None and self.pp > 1 and stages > blocks:
            raise UsageError(f"{stages} pipeline stages (pp {self.pp} x {stages_per_rank(self.schedule)} per rank, "
                             f"schedule {self.schedule!r}) but {model} has {blocks} blocks; use pp <= "
                             f"{max(1, blocks // stages_per_rank(self.schedule))} or a deeper model")
