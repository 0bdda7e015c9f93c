"""The device mesh: the world factored into pipeline, data parallel (replicate x shard) and tensor parallel.

``world = pp x dp_replicate x dp_shard x tp``, outer to inner, as torchtitan
and Accelerate order them: a tensor-parallel group is a run of consecutive
ranks (the GPUs of one node, where TP's per-layer collectives belong), and
the data-parallel rank is the flattened (replicate, shard) coordinate. Every
tensor-parallel peer and pipeline stage of a data-parallel rank reads the same samples
(``plan()`` puts that rank into the ``BatchPlan``). Degrees that do not
multiply to the world are refused before any process-group work, with the
equation and the degrees that would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.share import DataShare, describe, record
from ..errors import UsageError
from ..runtime.values import divisors, is_positive_int

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshShape:
    """The degrees of a mesh; ``dp_shard`` is what remains of the world after the others."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the number of distinct sample streams."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp


def factor(world_size: int, *, tp: int = 1, dp_replicate: int = 1, dp_shard: int | None = None, pp: int = 1) -> MeshShape:
    """The mesh degrees for ``world_size`` processes; ``dp_shard=None`` takes the rest of the world.

    >>> factor(8, tp=2, dp_replicate=2)
    MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    """
    for name, value in (("tp", tp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("pp", pp)):
        if value is not None and not is_positive_int(value):
            raise UsageError(f"mesh degree {name} must be a positive integer, got {value!r}")
    fixed = tp * dp_replicate * pp
    given = f"{'pp ' + str(pp) + ' x ' if pp > 1 else ''}dp_replicate {dp_replicate} x tp {tp}"
    if dp_shard is None:
        if world_size % fixed:
            if world_size % (dp_replicate * pp):
                fix = f"use dp_replicate{' x pp' if pp > 1 else ''} in {', '.join(map(str, divisors(world_size)))}"
            else:
                fix = f"use tp in {', '.join(map(str, divisors(world_size // (dp_replicate * pp))))}"
            raise UsageError(
                f"world size {world_size} is not divisible by {given} = {fixed}; "
                f"{fix}, or run on a multiple of {fixed} processes"
            )
        dp_shard = world_size // fixed
    shape = MeshShape(dp_replicate, dp_shard, tp, pp)
    if shape.world_size != world_size:
        raise UsageError(
            f"mesh {'pp ' + str(pp) + ' x ' if pp > 1 else ''}dp_replicate {dp_replicate} x dp_shard {dp_shard} x tp {tp} "
            f"= {shape.world_size} processes, but this job has {world_size}; run on {shape.world_size} processes "
            "or leave dp_shard out to fill the world"
        )
    return shape


class Mesh:
    """A ``DeviceMesh`` over ``DIMS`` and what the loop needs from it: the data-parallel size and rank.

    >>> mesh = mg.parallel.mesh(dist, tp=2)           # 4 processes: dp_shard 2 x tp 2
    >>> plan = mesh.plan(global_batch=64, micro_batch=8)
    """

    def __init__(self, shape: MeshShape, device_mesh: Any) -> None:
        self.shape = shape
        self.device_mesh = device_mesh
        rep, shard = device_mesh["dp_replicate"].get_local_rank(), device_mesh["dp_shard"].get_local_rank()
        self.dp_rank = rep * shape.dp_shard + shard
        self.dp_size = shape.dp
        # mg.eval_loader and mg.all_reduce_sum read it when they are not told the layout (data/share.py).
        record(self.data_share(), device_mesh.get_rank(), shape.world_size)

    @property
    def tp_rank(self) -> int:
        """This process's rank among its tensor-parallel peers."""
        return self.device_mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        """This process's pipeline coordinate (its first stage under a multi-stage schedule)."""
        return self.device_mesh["pp"].get_local_rank()

    @property
    def pp_mesh(self) -> Any:
        return self.device_mesh["pp"]

    @property
    def tp_mesh(self) -> Any:
        return self.device_mesh["tp"]

    @property
    def dp_mesh(self) -> Any | None:
        """What FSDP shards over: 2-D (replicate, shard) for HSDP, 1-D (shard) for FSDP, None without data parallelism."""
        if self.shape.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        if self.shape.dp_shard > 1:
            return self.device_mesh["dp_shard"]
        return None

    def data_share(self, rank: int | None = None, world_size: int | None = None) -> DataShare:
        """What this process evaluates and counts (``Layout.data_share``). A mesh does not know the pipeline
        schedule, which places the last stage: with pp > 1 whether this rank counts is unknown (None)."""
        if (rank, world_size) not in ((None, None), (self.device_mesh.get_rank(), self.shape.world_size)):
            raise UsageError(f"the mesh is rank {self.device_mesh.get_rank()} of {self.shape.world_size}, "
                             f"not rank {rank} of {world_size}; pass the mesh of this job")
        counts = self.tp_rank == 0 if self.shape.pp == 1 else None
        return DataShare(self.dp_rank, self.dp_size, counts=counts, pp=self.shape.pp, layout=describe(self.shape))

    def plan(self, global_batch: int, micro_batch: int | None = None, max_micro_batch: int | None = None):
        """The ``BatchPlan`` over this mesh's data-parallel ranks, bound to this process's data-parallel rank."""
        from ..batch import BatchPlan

        return BatchPlan(global_batch, self.dp_size, micro_batch=micro_batch, max_micro_batch=max_micro_batch,
                         dp_rank=self.dp_rank)

    def __repr__(self) -> str:
        s = self.shape
        pp = f"pp={s.pp}, " if s.pp > 1 else ""
        return (f"Mesh({pp}dp_replicate={s.dp_replicate}, dp_shard={s.dp_shard}, tp={s.tp}; "
                f"dp rank {self.dp_rank} of {self.dp_size})")


def mesh(dist: Any, *, tp: int = 1, dp_replicate: int = 1, dp_shard: int | None = None, pp: int = 1) -> Mesh:
    """The job's device mesh (collective: every rank calls it). Checks the degrees before building anything.

    >>> mesh = mg.parallel.mesh(dist, tp=2, dp_replicate=2)   # 8 processes: HSDP 2 x 2, TP 2
    """
    shape = factor(dist.world_size, tp=tp, dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp)
    return Mesh(shape, device_mesh(dist.device.type, (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp), DIMS))


_MESHES: dict[Any, Any] = {}


def device_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """The one device-mesh builder (collective the first time: every rank calls it), on the job's device
    type (gloo meshes are "cpu", NCCL meshes "cuda"). Built once per shape in a process group and reused:
    each ``init_device_mesh`` creates new process groups that live as long as the job, so a process that
    spreads many models (tune, verify, the test zoo) would otherwise gather hundreds of them, each
    collective slower for it."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    world = tdist.group.WORLD  # another object after the group is torn down and started again
    if _MESHES.get("world") is not world:
        _MESHES.clear()
        _MESHES["world"] = world
    key = (device_type, tuple(sizes), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    return _MESHES[key]
