"""One layout: the mesh degrees and the choices that go with them, resolved once, and every rule that follows.

A ``Layout`` is what a run is spread by: data parallelism replicated (``dp_replicate``) and sharded (``dp_shard``;
None takes what the other degrees leave of the world), tensor parallelism (``tp``), pipeline stages (``pp``), the
micro-batch, activation checkpointing (of every block, or with ``checkpoint_blocks`` k the first k of each pipeline
stage, Megatron's ``--recompute-method block``), the pipeline schedule and its stages per rank (``stages_per_rank``:
the looped schedules run any number, torchtitan's and Megatron's virtual stages; None is the schedule's own).
``layout.resolve(world_size)`` is the same layout with every degree set (the one place the world is factored, and
refused when it does not factor); a resolved layout owns its world size, data-parallel size and rank, strategy,
label, command-line flags and device mesh, so nothing else derives a degree. The strategy is read from the degrees,
not named twice: replicate-only is DDP, any sharding is FSDP (HSDP with both), and FSDP also carries data
parallelism beside TP or PP (DDP does not compose with them; torchtitan refuses it too). ``BatchPlan`` stays the
only batch arithmetic: ``layout.plan`` builds one over the data-parallel ranks, so ``accum_steps`` is the
micro-batch count.

>>> layout = mg.parallel.Layout(tp=2, micro_batch=4).resolve(dist.world_size)
>>> layout.dp_size, layout.strategy, layout.label
(2, 'fsdp', 'dp_shard=2,tp=2,micro_batch=4')
>>> model = mg.parallelize(model, layout)
>>> plan = layout.plan(global_batch=32, dist=dist)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..data.share import DataShare
from ..errors import UsageError
from ..runtime.values import divisors, is_positive_int, positive_int
from .pp import LOOPED, stage_ids, stages_per_rank

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # the device mesh's dimensions, outer to inner
# With expert parallelism dp_shard is built as (efsdp, ep) and flattened back to "dp_shard" (torchtitan's
# dp_shard x tp = efsdp x ep): the experts shard over "ep" and FSDP over "efsdp", everything else over
# "dp_shard". Beside tensor parallelism ep takes every tp rank too: dp_shard is (efsdp, ep_dp) and "ep" the
# flattened (ep_dp, tp), so the tp ranks hold different experts instead of copies of the same.
EP_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")
EP_TP_DIMS = ("pp", "dp_replicate", "efsdp", "ep_dp", "tp")
# With context parallelism the cp ranks of a data-parallel rank read the same samples, each a share of every
# sequence; they hold the same parameters, so FSDP shards over (dp_shard, cp) flattened ("dp_shard_cp", as
# torchtitan does) and averages the gradients over them too.
CP_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The command-line flags of a script's layout (mg.layout_from_args reads them, Layout.flags writes them):
# flag -> Layout field, the integer degrees first. Every flag is one of the frozen Layout's fields.
INT_FLAGS = {"--tp": "tp", "--pp": "pp", "--dp-replicate": "dp_replicate", "--dp-shard": "dp_shard",
             "--ep": "ep", "--cp": "cp", "--micro-batch": "micro_batch", "--stages-per-rank": "stages_per_rank",
             "--checkpoint-blocks": "checkpoint_blocks"}
BOOL_FLAGS = {"--activation-checkpointing": "activation_checkpointing", "--compile": "compile",
              "--sequence-parallel": "sequence_parallel", "--zero1": "zero1"}
# What only a pipeline reads: a layout without one (pp 1) leaves them out of its label and flags.
PIPELINE_FIELDS = ("schedule", "stages_per_rank")
# Names a user may have called on a Layout that went (CHANGELOG.md): what to write instead.
_MOVED = {"shape": "layout.resolve(world_size): the same Layout with every degree set (.dp_size, .world_size)",
          "of": "the Layout itself: meshes are the resolved Layout's (layout.device_mesh(device_type))",
          "mesh": "layout.resolve(world_size).device_mesh(device_type), or pass the Layout to mg.parallelize"}


@dataclass(frozen=True)
class Layout:
    """Mesh degrees (outer to inner: pp, dp_replicate, dp_shard, cp, tp), the micro-batch, activation
    checkpointing per block, ``torch.compile`` per block, sequence parallelism, the pipeline schedule, ZeRO-1
    (``zero1``: DDP's optimizer state sharded over the replicas, ``mg.wrap``'s ``"zero1"``; only where the layout
    only replicates) and the pipeline's stages per rank (``stages_per_rank``: any number for a looped schedule,
    ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``; None: 1 single-stage, 2 multi-stage).
    ``checkpoint_blocks`` (with ``activation_checkpointing``): how many blocks of each pipeline stage (of the model
    without a pipeline) are checkpointed, the first ones, the rest keeping their activations; a stage of fewer
    blocks checkpoints them all; None: every block."""

    dp_replicate: int = 1
    dp_shard: int | None = None
    tp: int = 1
    pp: int = 1
    micro_batch: int | None = None
    activation_checkpointing: bool = False
    compile: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    ep: int = 1
    cp: int = 1
    zero1: bool = False
    stages_per_rank: int | None = None
    checkpoint_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "ep", "cp") + (("dp_shard",) if self.dp_shard is not None else ()):
            positive_int(getattr(self, name), f"layout {name}", f"e.g. mg.parallel.Layout({name}=2)")
        if self.micro_batch is not None and not is_positive_int(self.micro_batch):
            raise UsageError(f"layout micro_batch must be a positive integer or None, got {self.micro_batch!r}")
        if self.checkpoint_blocks is not None:
            positive_int(self.checkpoint_blocks, "layout checkpoint_blocks", "e.g. Layout(activation_checkpointing=True, "
                         "checkpoint_blocks=2), or None to checkpoint every block")
            if not self.activation_checkpointing:
                raise UsageError(f"checkpoint_blocks={self.checkpoint_blocks} says how many blocks activation "
                                 "checkpointing recomputes, but activation_checkpointing is off; add "
                                 "activation_checkpointing=True (--activation-checkpointing) or drop checkpoint_blocks")
        stages_per_rank(self.schedule, self.stages_per_rank)  # an unknown schedule, stages a rank it cannot run
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("sequence_parallel splits the sequence over tensor-parallel ranks but tp is 1; "
                             "use Layout(tp=2, sequence_parallel=True) or drop it")
        if self.zero1 and ((self.dp_shard or 1) > 1 or self.cp > 1):  # not a layout at all: FSDP shards it already
            raise UsageError(f"zero1 shards DDP's optimizer state over the replicas, but FSDP (dp_shard "
                             f"{self.dp_shard}, cp {self.cp}) shards it already; use dp_replicate with zero1, or drop zero1")
        # Which ep the other degrees take (ep_problem) is decided with the model's experts, where every
        # degree is known: mg.parallelize (experts.check) refuses it, its suggestions by the same rule.

    def unbuilt(self) -> str | None:
        """Why multigpu does not build this layout yet (published runs used it; the forecast predicts it), in one
        line, or None: cp beside ep, pp or sequence parallelism; ep beside sequence parallelism; ZeRO-1 beside tp, pp
        or ep (beside FSDP's dp_shard or cp it is no layout: refused on construction). The one rule: every builder
        raises it (``built``) before any work; ``parallel.space.layouts`` never proposes what it names."""
        if self.ep > 1 and self.sequence_parallel and self.cp == 1:
            return (f"expert parallelism with sequence_parallel is not built yet (ep {self.ep}): the experts would see "
                    "a share of each sequence's tokens; use sequence_parallel=False with ep")
        if self.cp > 1 and (self.ep > 1 or self.pp > 1 or self.sequence_parallel):
            other = "ep" if self.ep > 1 else "pp" if self.pp > 1 else "sequence_parallel"
            return (f"context parallelism (cp {self.cp}) with {other} is not built yet; use cp with "
                    "dp_shard, dp_replicate and tp, or drop one of them")
        others = [f"{n} {getattr(self, n)}" for n in ("tp", "pp", "ep") if getattr(self, n) > 1]
        if self.zero1 and others:
            return (f"zero1 (DDP's optimizer state sharded over the replicas) beside {', '.join(others)} is not built "
                    "yet; use dp_replicate alone with zero1, or FSDP (dp_shard) beside them")
        return None

    def built(self) -> "Layout":
        """This layout, or the ``UsageError`` of ``unbuilt``'s line where multigpu does not build it: what a
        builder calls first."""
        if why := self.unbuilt():
            raise UsageError(why)
        return self

    def __getattr__(self, name: str) -> Any:  # only for names a Layout does not have
        if name in _MOVED:
            raise AttributeError(f"Layout.{name} is gone; use {_MOVED[name]}")
        raise AttributeError(f"'Layout' object has no attribute {name!r}")

    def ep_problem(self, ep: int | None = None) -> str | None:
        """Why expert parallelism of degree ``ep`` (this layout's own by default) does not fit this layout's
        other degrees, or None: ep takes every tensor-parallel rank and ep / tp of dp_shard (dp_shard x tp =
        efsdp x ep). The one rule: ``mg.parallelize`` refuses by it and picks the degrees it suggests with it
        (``experts.check``, beside the model's experts); dp_shard left to the world is not checked."""
        ep = self.ep if ep is None else ep
        if ep > 1 and self.tp > 1 and ep % self.tp:
            return (f"ep {ep} takes every tensor-parallel rank (dp_shard x tp = efsdp x ep), but it is not a multiple "
                    f"of tp {self.tp}")
        borrowed = ep // self.tp if ep > 1 else 1
        if self.dp_shard is not None and self.dp_shard % borrowed:
            whole = f"ep / tp = {borrowed}" if self.tp > 1 else f"ep {ep}"
            return (f"{whole} borrows its ranks from dp_shard (dp_shard x tp = efsdp x ep), but dp_shard "
                    f"{self.dp_shard} is not a multiple of it")
        return None

    # -- the one resolution ----------------------------------------------------------------------------
    def resolve(self, world_size: int) -> "Layout":
        """This layout on ``world_size`` processes, every degree set (``dp_shard`` takes what the others
        leave); degrees that do not multiply to the world are refused in one line, with the ones that would."""
        positive_int(world_size, "world size", "run on 1 or more processes")
        fixed = self.tp * self.dp_replicate * self.pp * self.cp
        given = (f"{'pp ' + str(self.pp) + ' x ' if self.pp > 1 else ''}dp_replicate {self.dp_replicate} x "
                 f"{'cp ' + str(self.cp) + ' x ' if self.cp > 1 else ''}tp {self.tp}")
        if self.dp_shard is None:
            if world_size % fixed:
                outer = self.dp_replicate * self.pp
                fix = (f"use dp_replicate{' x pp' if self.pp > 1 else ''} in {', '.join(map(str, divisors(world_size)))}"
                       if world_size % outer else f"use {'cp x ' if self.cp > 1 else ''}tp in "
                       f"{', '.join(map(str, divisors(world_size // outer)))}")
                raise UsageError(f"world size {world_size} is not divisible by {given} = {fixed}; {fix}, or run on a "
                                 f"multiple of {fixed} processes")
            return dataclasses.replace(self, dp_shard=world_size // fixed)
        if self.world_size != world_size:
            raise UsageError(
                f"mesh {'pp ' + str(self.pp) + ' x ' if self.pp > 1 else ''}dp_replicate {self.dp_replicate} x "
                f"dp_shard {self.dp_shard} x {'cp ' + str(self.cp) + ' x ' if self.cp > 1 else ''}tp {self.tp} = "
                f"{self.world_size} processes, but this job has {world_size}; "
                f"run on {self.world_size} processes or leave dp_shard out to fill the world")
        return self

    def _at(self, world_size: int | None) -> "Layout":
        if world_size is not None:
            return self.resolve(world_size)
        if self.dp_shard is None:
            raise UsageError("the layout leaves dp_shard to the world size; use layout.resolve(world_size) "
                             "(or pass world_size), or give dp_shard")
        return self

    # -- what a resolved layout owns -----------------------------------------------------------------
    @property
    def world_size(self) -> int | None:
        """The processes this layout spans when every degree is set (None while ``dp_shard`` is left to the world)."""
        return None if self.dp_shard is None else self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the number of distinct sample streams (replicate x shard; cp peers read the same)."""
        return self.dp_replicate * self._at(None).dp_shard

    @property
    def strategy(self) -> str:
        """How the data-parallel degrees are applied: ``none``, ``ddp`` (replicate only, nothing else
        parallel), ``fsdp`` (shard) or ``hsdp`` (replicate x shard, or replicate beside TP/PP)."""
        if self.dp_size == 1 and self.cp == 1:
            return "none"
        if self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.cp == 1:
            return "ddp"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks x stages per rank (``stages_per_rank``, else the schedule's own)."""
        return self.pp * stages_per_rank(self.schedule, self.stages_per_rank) if self.pp > 1 else 1

    @property
    def label(self) -> str:
        """The layout as ``--layouts`` spells it, e.g. ``dp_shard=2,tp=2`` (``one process`` when nothing is set)."""
        base = Layout(dp_shard=1)
        parts = []
        for f in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "micro_batch", "activation_checkpointing",
                  "checkpoint_blocks", "compile", "sequence_parallel", "schedule", "stages_per_rank", "zero1"):
            value = getattr(self, f)
            if value != getattr(base, f) and not (f in PIPELINE_FIELDS and self.pp == 1):
                parts.append(f"{f}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(parts) or "one process"

    @property
    def flags(self) -> list[str]:
        """The command line that makes ``mg.layout_from_args`` read this layout back (its non-default fields)."""
        out: list[str] = []
        for flag, field in INT_FLAGS.items():
            value = getattr(self, field)
            if value not in (None, getattr(Layout, field)) and not (field in PIPELINE_FIELDS and self.pp == 1):
                out += [flag, str(value)]
        out += [flag for flag, field in BOOL_FLAGS.items() if getattr(self, field)]
        return out + (["--schedule", self.schedule] if self.pp > 1 else [])

    def dp_rank(self, rank: int, world_size: int | None = None) -> int:
        """The data-parallel rank of global ``rank``: the mesh's flattened (replicate, shard) coordinate."""
        r = self._at(world_size)
        return (rank // (r.tp * r.cp)) % r.dp_size

    def cp_rank(self, rank: int, world_size: int | None = None) -> int:
        """Which share of every sequence global ``rank`` holds (0 to cp - 1)."""
        r = self._at(world_size)
        return (rank // r.tp) % r.cp

    def data_share(self, rank: int, world_size: int | None = None) -> DataShare:
        """What global ``rank`` evaluates and counts: its data-parallel rank's share (its tensor-parallel
        peers and pipeline stages read the same), and its sums count when it is tensor-parallel peer 0 on
        the rank that holds the last pipeline stage (placed by the schedule): each data-parallel rank once."""
        r = self._at(world_size)
        holds_last = r.stages - 1 in stage_ids(r.schedule, rank // (r.dp_size * r.cp * r.tp), r.pp, r.stages_per_rank)
        return DataShare(r.dp_rank(rank), r.dp_size, counts=holds_last and rank % r.tp == 0, pp=r.pp, layout=r.label)

    def accum_steps(self, global_batch: int, world_size: int | None = None) -> int:
        """Micro-batches per optimizer step: the ``BatchPlan``'s count over the data-parallel ranks."""
        from ..batch import BatchPlan

        return BatchPlan(global_batch, self._at(world_size).dp_size, micro_batch=self.micro_batch).accum_steps

    def plan(self, global_batch: int, dist: Any, max_micro_batch: int | None = None):
        """The ``BatchPlan`` over this layout's data-parallel ranks, bound to this process's one."""
        from ..batch import BatchPlan

        r = self.resolve(dist.world_size)
        return BatchPlan(global_batch, r.dp_size, micro_batch=self.micro_batch, max_micro_batch=max_micro_batch,
                         dp_rank=r.dp_rank(dist.rank))

    def device_mesh(self, device_type: str) -> Any:
        """The one device mesh over ``DIMS`` (collective the first time: every rank calls it; built once per
        shape), on the job's device type (gloo meshes are "cpu", NCCL meshes "cuda")."""
        r = self._at(None).built()
        if r.cp > 1:
            return _device_mesh(device_type, (r.pp, r.dp_replicate, r.dp_shard, r.cp, r.tp), CP_DIMS)
        if r.ep == 1:
            return _device_mesh(device_type, (r.pp, r.dp_replicate, r.dp_shard, r.tp), DIMS)
        if why := r.ep_problem():  # mg.parallelize refuses it first, with the degrees that fit
            raise UsageError(f"{why}; use an ep that divides dp_shard x tp and is a multiple of tp, or ep=1")
        return _device_mesh(device_type, (r.pp, r.dp_replicate, r.efsdp, r.ep_dp, r.tp),
                            EP_TP_DIMS if r.tp > 1 else EP_DIMS)

    @property
    def ep_dp(self) -> int:
        """What expert parallelism borrows of dp_shard (ep, or ep / tp beside tensor parallelism)."""
        return self.ep // self.tp if self.ep > 1 else 1

    @property
    def efsdp(self) -> int:
        """What expert parallelism leaves of dp_shard: the ranks FSDP shards each rank's experts over."""
        return self._at(None).dp_shard // self.ep_dp

    def ep_mesh(self, device_type: str) -> Any:
        """The expert-parallel ranks of this process (its experts are Shard(0) over them): ep_dp x tp ranks."""
        mesh = self.device_mesh(device_type)
        return _MESHES[("ep",) + _key(device_type, mesh)] if self.tp > 1 else mesh["ep"]

    def tokens_group(self, device_type: str) -> Any | None:
        """The ranks whose tokens together make a micro-batch, each token once: the data-parallel ranks and,
        where expert parallelism takes the tp ranks (each routing its share of their common tokens), those."""
        if self.ep == 1 or self.tp == 1:
            return self.dp_group(device_type)
        return _MESHES[("tokens",) + _key(device_type, self.device_mesh(device_type))].get_group()

    def efsdp_mesh(self, device_type: str) -> Any:
        """The ranks that hold the same experts: FSDP shards them over these (``efsdp``, often 1); with
        dp_replicate 2-D (replicate, efsdp), HSDP of the experts as of everything else."""
        mesh = self.device_mesh(device_type)
        return mesh["dp_replicate", "efsdp"] if self.dp_replicate > 1 else mesh["efsdp"]

    def cp_mesh(self, device_type: str) -> Any:
        """The context-parallel ranks of this process: each holds a share of the same sequences."""
        return self.device_mesh(device_type)["cp"]

    def dp_mesh(self, device_type: str) -> Any | None:
        """What FSDP shards over: 2-D (replicate, shard) for HSDP, 1-D (shard) for FSDP, None without data
        parallelism; with cp the shard dimension is (dp_shard, cp) flattened."""
        mesh = self.device_mesh(device_type)
        if self.cp > 1:
            flat = _MESHES[("flat",) + _key(device_type, mesh)]
            return mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else flat
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        if self.ep > 1:  # the flattened (efsdp, ep), kept by the builder (slicing it from the root is deprecated)
            return _MESHES[("flat",) + _key(device_type, mesh)]
        return mesh["dp_shard"] if self.dp_shard > 1 else None

    def dp_group(self, device_type: str) -> Any | None:
        """The process group of this rank's data-parallel peers, in data-parallel rank order (None on one);
        with cp, of the ranks that average gradients (dp x cp), whose tokens together make the batch."""
        if self._at(None).dp_size * self.cp == 1:
            return None
        mesh = self.dp_mesh(device_type)
        if mesh is None:  # replicate only (DDP)
            return self.device_mesh(device_type)["dp_replicate"].get_group()
        if mesh.ndim == 2:  # HSDP: (replicate, shard) as one dimension
            key = ("dp",) + _key(device_type, self.device_mesh(device_type))
            if key not in _MESHES:
                _MESHES[key] = mesh._flatten("dp")
            mesh = _MESHES[key]
        return mesh.get_group()

    def check_sizes(self, *, heads: int | None = None, kv_heads: int | None = None, hidden: int | None = None,
                    vocab: int | None = None, seq: int | None = None, blocks: int | None = None,
                    tied: bool = False, model: str = "the model") -> None:
        """Refuse a TP degree that does not divide what it shards (heads, KV heads, hidden units,
        vocabulary, and the sequence under sequence parallelism), more pipeline stages than blocks, and a
        pipeline over a model whose token table is tied to its head (``tied``)."""
        sizes = {"attention heads": heads, "KV heads": kv_heads, "hidden units": hidden, "vocabulary": vocab}
        if self.sequence_parallel:
            sizes["sequence length"] = seq  # sequence parallelism splits it
        sizes = {k: v for k, v in sizes.items() if v is not None}
        bad = [f"{name} {n}" for name, n in sizes.items() if n % self.tp]
        if bad:
            fits = [d for d in range(1, self.tp + 1) if all(n % d == 0 for n in sizes.values())]
            raise UsageError(f"tensor-parallel degree {self.tp} does not divide {', '.join(bad)} of {model}; "
                             f"use tp={max(fits)}, or a model whose sizes it divides")
        if self.pp > 1 and tied:
            raise UsageError(f"the token table of {model} is tied to its head, but a pipeline puts them on different "
                             "stages; untie them (the GPT recipe: --untied) or use pp=1")
        if blocks is not None and self.pp > 1 and self.stages > blocks:
            per = self.stages // self.pp
            fewer = f", stages_per_rank <= {blocks // self.pp}" if self.schedule in LOOPED and blocks >= self.pp else ""
            raise UsageError(f"{self.stages} pipeline stages (pp {self.pp} x {per} per rank, schedule "
                             f"{self.schedule!r}) but {model} has {blocks} blocks; use pp <= {max(1, blocks // per)}"
                             f"{fewer} or a deeper model")


_MESHES: dict[Any, Any] = {}


def _device_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
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
        mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        if "efsdp" in names:  # dp_shard = efsdp x ep (or ep_dp), one dimension again for what FSDP shards
            _MESHES[("flat",) + key] = mesh["efsdp", names[3]]._flatten("dp_shard")
        if "ep_dp" in names:  # the experts' ranks (ep_dp, tp), and every rank of a micro-batch's tokens
            _MESHES[("ep",) + key] = mesh["ep_dp", "tp"]._flatten("ep")
            _MESHES[("tokens",) + key] = mesh["dp_replicate", "efsdp", "ep_dp", "tp"]._flatten("dp_tp")
        if "cp" in names:  # the ranks holding the same parameters: (dp_shard, cp) as one dimension
            _MESHES[("flat",) + key] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        _MESHES[key] = mesh
    return _MESHES[key]


def _key(device_type: str, mesh: Any) -> tuple:
    return (device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names))
