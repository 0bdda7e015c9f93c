"""Fault-tolerant replica groups (torchft): what the loop gets under ``multigpu run --fault-tolerant G``.

The launcher starts G torch jobs, the *replica groups*, and one torchft lighthouse. Inside a group
everything is as today (``mg.init``'s process group, DDP/FSDP/TP over its ranks); across groups a
``torchft.Manager`` forms a quorum every step, averages each rank's gradients with the same rank of
the other live groups, and lets a group that (re)starts fetch the weights and optimizer state from a
live peer before its first step (no checkpoint is read). This is HSDP's replicate dimension made
fault tolerant.

What a step does when a group is missing, stated once: **its share of the global batch is skipped**.
Every global batch is the world-size-invariant one (``mg.loader``'s order over all G groups' ranks);
group g always reads share g, so a committed step's update is the mean gradient over exactly the
shares of the groups that took part, and which groups took part is measured, not assumed: a one-hot
vector of group ids is summed in the same quorum as the gradients. Each committed step is recorded
(``Replicas.record``; under the launcher also ``<run dir>/replicas/group<g>.jsonl``), so a run can be
replayed by one process and every skipped sample is counted. The data position follows the committed
step, so no sample is used twice (an uncommitted step changes nothing and is retried).

Without the launcher's ``--fault-tolerant`` the same script runs as one replica group: no torchft,
the plain optimizer, every share used.

    with mg.init(seed=0) as dist:
        model = mg.wrap(Net(), "ddp")                        # inside the group, as today
        replicas = mg.fault_tolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), dist)
        train = mg.loader(data, replicas.plan(global_batch=64), dist)
        for step, micro_batches in replicas.steps(train, 100):   # a quorum per step; the committed step
            for x, y in mg.accumulate(model, micro_batches):
                loss_fn(model(x), y).div(len(micro_batches)).backward()
            replicas.optimizer.step()                      # averaged over the live groups, stepped on commit
            replicas.optimizer.zero_grad()
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch

from ..batch import BatchPlan
from ..dist import Dist, at_teardown
from ..errors import UsageError
from ..runtime import contract

# A quorum or a collective that waits longer than this for a peer gives up: the step is not
# committed and the next quorum goes on without the peer (a cut link never resets a connection).
TIMEOUT_S = 10.0
START_TIMEOUT_S = 300.0  # how long the first step waits for every group to start


@dataclass(frozen=True)
class Committed:
    """One committed step: its number, the groups whose shares went into it, and the samples skipped."""

    step: int
    groups: tuple[int, ...]  # the replica groups whose gradients were averaged (measured in the quorum)
    skipped: int  # samples of the global batch left out: the missing groups' shares
    healed: bool  # this group fetched its state from a live peer before this step
    time: float
    heal_s: float = 0.0  # how long that step's quorum took, the state's transfer and load included


class _Optimizer:
    """The user's optimizer, stepped only when the quorum commits, after averaging every gradient over the
    live replica groups (``Manager.allreduce``: each rank with the same rank of the other groups)."""

    def __init__(self, replicas: "Replicas", optimizer: torch.optim.Optimizer) -> None:
        self.replicas, self.optim = replicas, optimizer

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self, closure=None) -> bool:
        """Average, then step if every live group agrees; True when the step was committed."""
        if closure is not None:
            raise UsageError("the fault-tolerant optimizer's step takes no closure (got one); compute the loss "
                             "and call backward() before replicas.optimizer.step()")
        return self.replicas._commit(self.optim)


class Replicas:
    """This process's replica group and the quorum across groups. Get it from ``mg.fault_tolerant``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: Dist,
                 timeout: float = TIMEOUT_S, start_timeout: float = START_TIMEOUT_S) -> None:
        found = contract.replica_group()
        self.start_timeout = start_timeout
        self.dist, self.model = dist, model
        self.group, self.groups = (found[0], found[1]) if found else (0, 1)
        self.optimizer = _Optimizer(self, optimizer)
        self.record: list[Committed] = []
        self._step, self._share, self._healed, self._heal_s, self._layout = 0, 0, False, 0.0, "data parallel"
        self.quorum_s = 0.0  # how long the last step's quorum took (a heal included)
        # Samples the job skipped so far (missing groups' shares): kept as a running count (the meter reads it every
        # step), set from a live group's on a heal, so the steps this group missed count too.
        self.skipped = 0
        self._path = (os.path.join(found[3], f"group{self.group}.jsonl")
                      if found and found[3] and dist.rank == 0 else None)
        self.setup: dict[str, Any] = {}
        self._fingerprint = 0  # of the setup, set with it in steps()
        self._peer_differs = False  # a live group's state, offered to heal this one, did not fit its setup
        self.manager = _manager(found[2], self.group, self, timeout) if found else None
        if self.manager is not None:
            at_teardown(self.close)

    @property
    def fault_tolerant(self) -> bool:
        return self.manager is not None

    def plan(self, global_batch: int, *, layout: Any = None, micro_batch: int | None = None,
             max_micro_batch: int | None = None) -> BatchPlan:
        """The ``BatchPlan`` over every group's data-parallel ranks, bound to this process's one: group g's
        ranks read share g of every global batch (``layout``: a Layout inside the group, else every rank reads).

        >>> plan = replicas.plan(global_batch=64)        # 3 groups of 2 ranks: 6 shares of 10 + ...
        """
        inner, rank = self.dist.world_size, self.dist.rank
        if layout is not None:
            layout = layout.resolve(self.dist.world_size)
            inner, rank, self._layout = layout.dp_size, layout.dp_rank(self.dist.rank), layout.label
        return BatchPlan(global_batch, self.groups * inner, micro_batch=micro_batch, max_micro_batch=max_micro_batch,
                         dp_rank=self.group * inner + rank)

    def steps(self, loader, steps: int) -> Iterator[tuple[int, list[Any]]]:
        """(committed step, this rank's micro-batches of that global batch) until ``steps`` are committed.

        Each item starts with a quorum; a group that joins is healed from a live peer there, and the loader
        is set to the committed step, so a retried step reads the same samples and a healed group the next ones.
        """
        plan = loader.plan
        inner = plan.world_size // self.groups
        if plan.world_size % self.groups or plan.dp_rank_of(self.dist) // inner != self.group:
            raise UsageError(f"the loader's plan (world_size {plan.world_size}, dp_rank {plan.dp_rank_of(self.dist)}) "
                             f"is not replica group {self.group}'s share of {self.groups} groups; build it with "
                             "mg.loader(data, replicas.plan(global_batch), dist)")
        self._share = plan.global_batch // self.groups
        self.setup = self._setup(loader.plan.global_batch)
        self._fingerprint = zlib.crc32(json.dumps(self.setup, sort_keys=True).encode()) & 0xFFFFF  # once, not a step
        if self._path is not None:
            with open(os.path.join(os.path.dirname(self._path), f"group{self.group}.setup.json"), "w") as fp:
                json.dump(self.setup, fp)
        while True:
            self._healed, started = False, time.monotonic()
            if self.manager is not None:
                self._quorum()
            self.quorum_s = time.monotonic() - started  # the meter takes it out of the data wait
            if self._step >= steps:
                return
            loader.epoch, loader.batch_index = divmod(self._step, loader.steps_per_epoch)
            yield self._step, next(iter(loader))

    def _quorum(self) -> None:
        """Join this step's quorum (synchronous: a group behind fetches a live peer's state before it returns).

        The first step waits for every group: otherwise the first groups up would train alone, and a group
        starting later would heal from them, or, once they finished, train again from the start alone.
        """
        deadline = time.monotonic() + self.start_timeout
        while True:
            before, started = self.manager.current_step(), time.monotonic()
            self.manager.start_quorum()
            self._step = self.manager.current_step()
            self._healed = self._step != before
            self._heal_s = time.monotonic() - started if self._healed else 0.0
            joined = self.manager.num_participants()
            if self._step > 0 or joined == self.groups:
                return
            if time.monotonic() > deadline:
                raise UsageError(f"--fault-tolerant {self.groups}: {joined} of {self.groups} replica groups joined "
                                 f"the first step within {self.start_timeout:g} s; see the other groups' logs for why")
            time.sleep(0.05)

    def _commit(self, optim: torch.optim.Optimizer) -> bool:
        if self.manager is None:
            optim.step()
            self._committed((0,))
            return True
        from torch.distributed import ReduceOp

        params = [p for group in optim.param_groups for p in group["params"] if p.requires_grad]
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        # Which groups take part, and whether they are alike, summed first (the same size in every group):
        # a one-hot of this group, then its setup's fingerprint f and f^2. n * sum(f^2) == sum(f)^2 holds
        # only when every f is equal (exact: 20-bit integers in float64).
        seen = torch.zeros(self.groups + 2, dtype=torch.float64, device=flat.device)
        seen[self.group], seen[-2], seen[-1] = 1, self._fingerprint, self._fingerprint ** 2
        self.manager.allreduce(seen, reduce_op=ReduceOp.SUM).wait()
        # A peer lost mid all-reduce leaves the sums partial: that step is not committed, and says nothing of setups.
        if self._peer_differs or (self.manager.errored() is None and seen[:-2].sum() * seen[-1] != seen[-2] ** 2):
            self._refuse()
        self.manager.allreduce(flat).wait()
        if not self.manager.should_commit():
            return False
        seen = seen[:-2]
        offset = 0
        for p, g in zip(params, grads):
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
            if p.grad is None:
                p.grad = g
        optim.step()
        self._committed(tuple(int(i) for i in torch.nonzero(seen.round()).flatten().tolist()))
        return True

    def _committed(self, groups: tuple[int, ...]) -> None:
        rec = Committed(self._step, groups, self._share * (self.groups - len(groups)), self._healed, time.time(),
                        self._heal_s if self._healed else 0.0)
        self.record.append(rec)
        self.skipped += rec.skipped
        if self._path is not None:
            with open(self._path, "a") as fp:
                fp.write(json.dumps(dict(asdict(rec), group=self.group)) + "\n")
        self._step += 1

    def _setup(self, global_batch: int) -> dict[str, Any]:
        """What every replica group must share: torchft's release, the layout inside a group, the parameters'
        local shapes, the optimizer and the global batch (``group<g>.setup.json`` under the launcher)."""
        import importlib.metadata

        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        shapes = [list(_local(p).shape) for p in params]
        return {"torchft": importlib.metadata.version("torchft") if self.manager is not None else None,
                "ranks": self.dist.world_size, "layout": self._layout,
                "parameters": f"{len(shapes)} tensors, {sum(math.prod(s) for s in shapes)} values (rank 0's)",
                "shapes": zlib.crc32(json.dumps(shapes).encode()), "optimizer": type(self.optimizer.optim).__name__,
                "global_batch": global_batch}

    def _differs(self, peer: int, setup: dict[str, Any]) -> None:
        """A live group's state does not fit this one: keep its setup beside this group's (the launcher names what
        differs) and refuse at this step's all-reduce, where every group of the quorum sees the fingerprints
        differ and refuses too: on several nodes, every node then stops its groups, not only this one's."""
        self._peer_differs = True
        if self._path is not None:
            with open(os.path.join(os.path.dirname(self._path), f"group{peer}.setup.json"), "w") as fp:
                json.dump(setup, fp)

    def _refuse(self) -> None:
        """Groups that differ cannot average their gradients: say so once (the launcher reads the marker and
        stops every group) and end this one with exit 2."""
        if self._path is not None:
            with open(os.path.join(os.path.dirname(self._path), "refused"), "w") as fp:
                fp.write(str(self.group))
        raise UsageError(f"replica group {self.group} differs from another group in torchft's release, the layout, "
                         f"the parameters, the optimizer or the global batch (this one: {self.setup}); start every "
                         "group from the same script and torchft")

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP, TP: the same shard on the same rank of every group), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _manager(lighthouse: str, group: int, replicas: Replicas, timeout: float):
    """torchft's Manager for this rank of replica group ``group`` (torchft imported only here)."""
    import torchft
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    wait = timedelta(seconds=timeout)
    dist, model, optimizer = replicas.dist, replicas.model, replicas.optimizer.optim
    pg = ProcessGroupNCCL(timeout=wait) if dist.backend == "nccl" else ProcessGroupGloo(timeout=wait)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "setup": replicas.setup,
                "group": replicas.group, "skipped": replicas.skipped}

    def load_state_dict(state: dict[str, Any]) -> None:
        if state["setup"] != replicas.setup:  # a peer's state does not fit this group: no heal can work
            return replicas._differs(state["group"], state["setup"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        replicas.skipped = state["skipped"]  # the live group's count: the steps this one missed included

    # Synchronous quorum (use_async_quorum=False): a joining group heals before its forward, so every
    # group in the quorum takes part with its share; init_sync: the first step starts from one group's weights.
    return torchft.Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
                           use_async_quorum=False, timeout=wait, quorum_timeout=timedelta(seconds=max(60.0, timeout)),
                           connect_timeout=wait, rank=dist.rank, world_size=dist.world_size,
                           lighthouse_addr=lighthouse, replica_id=f"group{group}", init_sync=True,
                           **_advertised(contract.replica_host(), wait))


def _advertised(host: str | None, wait: timedelta) -> dict[str, Any]:
    """On several nodes, what this group's Manager tells the other groups to dial: this node's address (the
    launcher's ``MULTIGPU_REPLICA_HOST``) for its store, its quorum server and the state a joining group fetches.
    torchft's defaults are the host name and ``MASTER_ADDR``, which resolve to a loopback address on many hosts
    (and are, for a group's own rendezvous on one node). Its servers bind every interface either way."""
    if host is None:
        return {}
    from torchft.checkpointing.http_transport import HTTPTransport

    name = f"[{host}]" if ":" in host else host

    class Transport(HTTPTransport):
        def address(self) -> str:  # torchft's: http://<socket.gethostname()>:<port>/checkpoint/
            return f"http://{name}:{super().address().rsplit(':', 1)[1]}"

    return {"hostname": name, "store_addr": host, "checkpoint_transport": Transport(timeout=wait, num_chunks=0)}


def fault_tolerant(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: Dist,
                   timeout: float = TIMEOUT_S) -> Replicas:
    """This process's replica group under ``multigpu run --fault-tolerant G`` (one group elsewhere).

    >>> replicas = mg.fault_tolerant(model, opt, dist)
    >>> for step, micro_batches in replicas.steps(mg.loader(data, replicas.plan(64), dist), 100): ...
    """
    return Replicas(model, optimizer, dist, timeout)
