"""``NoiseScale``: the gradient noise scale B_simple of a running job, at almost no cost.

Data parallelism has two batch sizes for free: each rank's gradient (batch b,
before the reduction) and the averaged one (batch K*b, after); with one
process the accumulation micro-batches play the small batch. Their squared
norms give unbiased |G|^2 and tr(Sigma) (formulas.py), averaged separately
(debiased EMAs, time constant in examples) and only then divided: the mean of
per-step ratios is biased (tests/test_noise.py shows by how much).

Cost per measured step: two squared norms over the gradients, read at the end
of the backward (norms.py says when), and no collective: the ranks' ``|g_i|^2``
are averaged ``sync_every`` steps at a time in one small all-reduce, at the
same step on every rank. Nothing calls ``.item()`` during training on CUDA:
values stay on the device until a batch of them is folded into the EMAs.

The loss must be a mean over the examples of the optimizer step (divide by
``plan.accum_steps`` when accumulating), as in every multigpu example.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as tdist

from ..batch import BatchPlan
from ..errors import UsageError
from ..parallel import strategy_of
from ..parallel.fsdp import fsdp_modules
from ..runtime.values import positive_int
from ..spreads import refuse_stages, remember
from . import layout as shares, norms
from .estimates import Estimates

__all__ = ["NoiseScale"]


class NoiseScale:
    """Measure the gradient noise scale B_simple of a running training job.

    ``attach(model)`` after ``mg.wrap``/``mg.parallelize``: DDP (any comm hook), FSDP2 and HSDP
    on several ranks, also over tensor parallelism (plan: ``layout.plan(...)``), any model on one
    data-parallel rank with ``plan.accum_steps >= 2``. Elsewhere call ``observe`` with the norms.

    ``tau``: EMA time constant in training examples (default 100 global
    batches). ``every``: measure one optimizer step in ``every``.
    ``sync_every``: measured steps averaged across ranks in one all-reduce
    (batches of 1, 2, 4, ... at first); ``metrics()`` lags by up to that many
    steps, and ``flush()`` (every rank) averages the rest. ``scaler``: the
    ``mg.Precision`` or ``torch.amp.GradScaler`` whose loss scale the
    gradients carry (anything with ``get_scale()``).

    >>> noise = mg.NoiseScale(plan, every=1)
    >>> noise.attach(model)                  # after mg.wrap(model, "ddp")
    >>> ...train...
    >>> log(noise.metrics()); mg.print0(noise.summary())
    """

    def __init__(self, plan: BatchPlan, *, tau: float | None = None, every: int = 1, sync_every: int = 64,
                 scaler: Any = None, group=None):
        if not isinstance(plan, BatchPlan):
            raise UsageError(f"NoiseScale needs the run's mg.BatchPlan, got {type(plan).__name__}; pass plan=mg.BatchPlan(...)")
        for name, value, what in (("every", every, "measure one step in every"),
                                  ("sync_every", sync_every, "measured steps per all-reduce of the rank norms")):
            positive_int(value, f"NoiseScale {name}= ({what})")
        self.plan = plan
        self.tau = float(tau) if tau is not None else 100.0 * plan.global_batch
        if not self.tau > 0:
            raise UsageError(f"NoiseScale tau= is a time constant in examples and must be positive, got {tau}")
        self.every, self.sync_every, self.scaler, self.group = every, sync_every, scaler, group
        self.estimates = Estimates(plan.global_batch, self.tau, every)
        self._steps: list[tuple] = []  # measured, not yet averaged across ranks: (local, total, scale, total share)
        self._inflight: tuple | None = None  # the all-reduce of the last sync: (work, vec, scales)
        self._syncs = 0         # batches of steps processed so far
        self._rounds = 0        # optimizer steps seen, measured or not
        self._kind: str | None = None  # "ddp" | "fsdp" | "micro" (one process, micro-batches)
        self._layout = shares.Layout()  # what each rank's norms count for (layout.py)
        self._params: list[torch.Tensor] = []
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._handles: list = []
        self._queued = False    # this backward's callback is queued
        self._local: list[torch.Tensor] = []      # DDP: norm parts of this rank's gradient, this backward
        self._parts: list[torch.Tensor] = []      # FSDP: norms of this backward's reduce-scatter inputs
        self._reduced = False   # FSDP: this backward reduce-scattered (not a micro-batch without sync)
        self._plain_sum = False  # FSDP pre-divided a reduce-scatter input (fp16 reduce dtype)
        self._micro = 0         # one process: micro-batches of this step so far
        self._micro_parts: list[torch.Tensor] = []  # one process: norms of this step's micro-batch gradients
        self._grad_list: list[torch.Tensor] = []    # DDP: the gradients read before the reduction
        self._skip_next = False  # DDP static_graph: its first backward cannot be measured

    # ---- wiring ---------------------------------------------------------------
    def attach(self, model: torch.nn.Module, layout: Any = None, *, mesh: Any = None) -> "NoiseScale":
        """Measure ``model`` (DDP, FSDP2 on several ranks; any on one); ``layout``: its Layout, read not inferred."""
        if mesh is not None:  # went with mg.parallel.Mesh
            raise UsageError("NoiseScale.attach(mesh=) is gone; pass layout= the Layout the model was spread by")
        refuse_stages(model, "NoiseScale.attach", shares._OBSERVE)
        world = self.plan.world_size
        actual = tdist.get_world_size(self.group) if tdist.is_available() and tdist.is_initialized() else 1
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        tp = shares.tp_degree(layout, actual, world, model if self.group is None else None)  # a subgroup: not the job's
        if actual != world and tp < 2:
            raise UsageError(f"NoiseScale's plan is for world_size {world} but this job has {actual} processes; "
                             "build the plan with mg.BatchPlan(..., world_size=dist.world_size), or over the "
                             "data-parallel ranks of a tensor-parallel layout with layout.plan(...)")
        if self._kind is not None:
            raise UsageError("NoiseScale.attach was already called; use one NoiseScale per model")
        if world > 1:
            strategy = strategy_of(model)
            if strategy == "fsdp":
                self._attach_fsdp(fsdp_modules(model), named, tp)
            elif strategy in ("ddp", "zero1"):
                if tp > 1:
                    raise UsageError(f"NoiseScale's plan is for {world} data-parallel ranks of {actual} processes, but "
                                     f"this {strategy} model replicates over all of them; build the plan with "
                                     "world_size=dist.world_size")
                if getattr(model, "gradient_as_bucket_view", False):
                    # The rank gradients are read while the last bucket is being reduced: as
                    # views of the buckets they would be overwritten under the reader.
                    raise UsageError("NoiseScale needs DDP's default gradient_as_bucket_view=False, got True; "
                                     "wrap without gradient_as_bucket_view=True")
                self._kind, self._ddp = "ddp", model
                self._layout = shares.replicated(world)
                # With static_graph, DDP's first backward reduces in a callback of its own that
                # runs before ours: that step's rank gradients are already averaged (seen in tests).
                self._skip_next = bool(getattr(model, "static_graph", False))
            else:
                raise UsageError(
                    f"NoiseScale.attach on {world} data-parallel ranks needs a DDP or FSDP2 model, got "
                    f"{type(model).__name__}; wrap it first (mg.wrap(model, 'ddp')) or, for other sharding, "
                    "call noise.observe(...) each step"
                )
        else:
            if self.plan.accum_steps < 2:
                raise UsageError(
                    f"NoiseScale on one data-parallel rank measures with accumulation micro-batches and needs "
                    f"accum_steps >= 2, got global batch {self.plan.global_batch} in micro-batches of "
                    f"{self.plan.micro_batch}; use mg.BatchPlan(..., micro_batch={max(1, self.plan.global_batch // 2)}) "
                    "or run on 2+ data-parallel ranks"
                )
            self._kind = "micro"
            self._layout = shares.tensor_parallel(named, tp) if tp > 1 else shares.Layout()
        self._params = [p for _, p in named]
        if self._kind == "ddp":
            # The first gradient of a backward queues the end-of-backward callback; a
            # parameter's hook runs before DDP's own hook on it, so always before DDP
            # queues its finalize (when its last gradient is ready).
            self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        elif self._kind == "micro":
            # A tensor hook sees each micro-batch's gradient before it is accumulated: no copy
            # of the running sum is needed to tell the micro-batches apart.
            weights = self._layout.local or [None] * len(self._params)
            self._handles += [p.register_hook(functools.partial(self._on_micro_grad, w))
                              for p, w in zip(self._params, weights)]
        if self._kind in ("ddp", "fsdp"):  # it reads the gradients a rank accumulated: mg.accumulate(sync='each') asks
            remember(model, noise=weakref.ref(self))
        return self

    def _attach_fsdp(self, modules: list[torch.nn.Module], named: list, tp: int) -> None:
        for m in modules:
            if not hasattr(m, "set_custom_reduce_scatter"):
                raise UsageError(f"NoiseScale under FSDP2 needs FSDPModule.set_custom_reduce_scatter, which torch "
                                 f"{torch.__version__} lacks; upgrade torch (2.13 has it), or leave the model "
                                 "unattached and call noise.observe(..., sharded=True) each step")
        self._layout = shares.fsdp(modules, named, tp)
        for m, (blocks, weights) in zip(modules, self._layout.blocks):
            try:
                m.set_custom_reduce_scatter(norms.ReduceScatterNorms(self._on_reduce_scatter, blocks, weights))
            except ValueError as err:  # several parameter groups per module (per-parameter meshes)
                raise UsageError(f"NoiseScale cannot read this FSDP2 model's reduce-scatter ({err}); leave the "
                                 "model unattached and call noise.observe(..., sharded=True) each step") from None
        self._kind = "fsdp"

    def detach(self) -> None:
        """Stop measuring (FSDP keeps the reduce-scatter wrapper, which then only reduces)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._kind = "detached"

    def _measuring(self) -> bool:
        return self._rounds % self.every == 0

    def _scale(self, device: torch.device) -> torch.Tensor | None:
        return norms.loss_scale(self.scaler, device)

    # ---- the hooks (norms.py explains the timing) -------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if self._queued or (self._ddp is not None and not self._ddp.require_backward_grad_sync):
            return  # queued already, or a micro-batch under no_sync: its backward reduces nothing
        self._queued = True
        norms.queue_callback(self._before_reduction)

    def _before_reduction(self) -> None:
        """End of the backward, before DDP's finalize: ``p.grad`` is this rank's gradient."""
        if self._kind == "micro":
            self._queued = False
            self._micro_batch_done()
            return
        if self._kind == "ddp" and self._measuring() and not self._skip_next:
            # One foreach over all gradients: per-parameter norms in the hooks, while each gradient is still
            # in cache, cost the same on CPU (benchmarks/noise_overhead.py) and one launch per parameter on CUDA.
            self._grad_list = [p.grad for p in self._params if p.grad is not None]
            self._local = norms.norm_parts(self._grad_list)
        self._skip_next = False
        norms.queue_callback(self._after_reduction)

    def _after_reduction(self) -> None:
        """After DDP's finalize / FSDP's post-backward: ``p.grad`` is the average (or its shard)."""
        self._queued = False
        if self._kind == "fsdp":
            if not self._reduced:
                return  # a micro-batch without gradient sync
            self._reduced = False
            if self._plain_sum:
                raise UsageError("NoiseScale under FSDP2 reads unscaled reduce-scatter inputs, but FSDP pre-divided "
                                 "them (fp16 reduce dtype or force-sum reduction); reduce in fp32 or bf16: "
                                 "mg.wrap(model, 'fsdp', param_dtype='fp16', reduce_dtype='fp32')")
        measuring = self._measuring() and (self._kind != "ddp" or bool(self._grad_list))
        self._rounds += 1
        if not measuring:
            return
        if self._kind == "fsdp":
            total = self._total_parts()
            local, self._parts = self._parts or [torch.zeros_like(total[0])], []
        else:
            # DDP's finalize copied the averaged buckets into the tensors read before it.
            total = norms.norm_parts(self._grad_list)
            local, self._local, self._grad_list = self._local, [], []
        self._queue_step(local, total, self._scale(total[0].device), self._layout.total_share)

    def _on_reduce_scatter(self, flat_input: torch.Tensor, op, blocks=None, weights=None, shards: int = 1) -> None:
        if self._kind != "fsdp":
            return  # detached
        self._reduced = True
        if not self._queued:
            self._queued = True
            norms.queue_callback(self._before_reduction)
        if self._measuring():
            self._plain_sum = self._plain_sum or norms.is_plain_sum(op)
            self._parts += norms.block_norms(flat_input, blocks, weights, shards)

    def _on_micro_grad(self, weight: float | None, grad: torch.Tensor) -> None:
        if self._measuring():
            # The norm now, while the gradient is in cache; holding the tensor instead would
            # stop autograd from stealing it into p.grad (one more copy per micro-batch).
            # A tensor-parallel gradient is a DTensor: this rank's part, by its share.
            norm = norms.norm_parts(norms.local_tensors([grad]))[0]  # fp32 at least (fp64 stays fp64)
            self._micro_parts.append(norm if weight is None else norm * weight)
        if not self._queued:
            self._queued = True
            norms.queue_callback(self._before_reduction)

    def _micro_batch_done(self) -> None:
        """One process: each micro-batch's gradient, as its backward delivered it, then the sum."""
        self._micro += 1
        last = self._micro == self.plan.accum_steps
        if self._measuring() and last:
            local, self._micro_parts = self._micro_parts, []
            self._queue_step(local, self._total_parts(), self._scale(local[0].device), self._layout.total_share)
        if last:
            self._micro = 0
            self._rounds += 1

    def _total_parts(self) -> list[torch.Tensor]:
        """Norms of this rank's part of the summed or averaged gradient (a DTensor's local part), by their shares."""
        weights = self._layout.total
        present = [i for i, p in enumerate(self._params) if p.grad is not None]
        grads = norms.local_tensors(self._params[i].grad for i in present)
        return norms.norm_parts(grads, None if weights is None else [weights[i] for i in present])

    # ---- estimation -----------------------------------------------------------
    def observe(self, local_sq, total_sq, *, sharded: bool = False, scale: float | torch.Tensor = 1.0) -> None:
        """Record one step from squared norms computed elsewhere (every rank calls it: the
        averaging all-reduce runs once per batch of calls, see ``sync_every``).

        ``local_sq``: this rank's ``|g_i|^2`` before averaging (batch ``plan.rank_batch``).
        ``total_sq``: ``|mean_i g_i|^2``; with ``sharded=True``, the squared norm
        of this rank's shard of it, summed across ranks here.
        ``scale``: the loss scale the gradients carry. Call it once per
        ``every`` optimizer steps.
        """
        if self.plan.world_size < 2:
            raise UsageError("NoiseScale.observe needs 2+ ranks (rank gradients are the small batch); "
                             "on one process use attach(model) with accumulation micro-batches")
        if self._kind is not None:
            raise UsageError("NoiseScale.observe is for models attach() cannot read; this one is attached "
                             "and measures by itself: drop the observe call")
        # Norm parts, as norm_parts gives them (norms whose squares sum to the squared norm); float64
        # here: the caller's numbers may be exact, and shard sums must match replicated totals.
        local = torch.as_tensor(local_sq, dtype=torch.float64).reshape(()).sqrt()
        total = torch.as_tensor(total_sq, dtype=torch.float64, device=local.device).reshape(()).sqrt()
        scale = torch.as_tensor(scale, dtype=torch.float64, device=local.device).reshape(())
        self._queue_step([local], [total], scale, 1.0 if sharded else 1.0 / self.plan.world_size)

    def _queue_step(self, local: list[torch.Tensor], total: list[torch.Tensor], scale, share: float) -> None:
        """One measured step's norm parts (sum of squares = squared norm); processed ``sync_every`` at a time.

        ``share``: the factor on the total's squared norm before the sum over ranks (layout.py)."""
        self._steps.append((local, total, scale, share))
        # Batches of 1, 2, 4, ... up to sync_every: the first estimates appear within a few steps.
        if len(self._steps) >= min(self.sync_every, 2 ** self._syncs):
            self._sync()

    def _sync(self) -> None:
        """Squared norms of the queued steps; on several ranks, averaged in one all-reduce.

        The all-reduce is asynchronous, waited for at the next sync or by
        ``metrics()``: waiting at once would stall every rank until the
        slowest arrives, a step's skew each time (measured: ~1 ms on gloo).
        """
        self._land()
        self._syncs += 1
        steps, self._steps = self._steps, []
        local_sq = norms.sum_sq([s[0] for s in steps])
        total_sq = norms.sum_sq([s[1] for s in steps]).to(local_sq.device)
        scales = [s[2] for s in steps]
        if self._kind == "micro" and self._layout.tp == 1:
            self._add(local_sq, total_sq, scales)  # one process: nothing to sum
            return
        # Summed over ranks, each part by its share (layout.py): the sum of the data-parallel
        # ranks' squared norms (divided here into their mean) and the averaged gradient's.
        shares = torch.tensor([s[3] for s in steps], dtype=torch.float64)
        vec = torch.cat([local_sq / self.plan.world_size, total_sq * shares.to(total_sq.device)])
        work = tdist.all_reduce(vec, group=self.group, async_op=True)
        self._inflight = (work, vec, scales)

    def _land(self) -> None:
        """Wait for the in-flight all-reduce (every rank launched it: no rank waits alone)."""
        if self._inflight is None:
            return
        (work, vec, scales), self._inflight = self._inflight, None
        work.wait()
        n = len(scales)
        self._add(vec[:n], vec[n:], scales)

    def _add(self, local_sq: torch.Tensor, total_sq: torch.Tensor, scales: list) -> None:
        if self._kind == "micro":
            # The loss carries 1/accum_steps: each micro-batch's mean gradient is accum x what it added.
            self.estimates.add(local_sq * self.plan.accum_steps, total_sq, scales, self.plan.micro_batch)
        else:
            self.estimates.add(local_sq, total_sq, scales, self.plan.rank_batch)

    def flush(self) -> None:
        """Average the measured steps still waiting for their batch (collective: every rank calls it).

        Call it at the end of training, before the last ``metrics()`` or
        ``summary()``, so they include the final steps.

        >>> noise.flush(); mg.print0(noise.summary())
        """
        if self._steps:
            self._sync()
        self._land()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The estimates, for ``mg.Checkpointer(noise=noise)``: they hold for any world size at the same
        global batch, so an elastic restart keeps them. Flushes first (collective: every rank saves)."""
        self.flush()
        return self.estimates.state_dict(self._rounds)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._rounds = self.estimates.load_state_dict(state)

    # ---- reporting ------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Current estimates for the step logger (empty before the first measured step).

        ``noise/b_simple`` is absent while the |G|^2 estimate is <= 0
        (noise-dominated); ``noise/noise_dominated`` is then 1.
        Measured steps count in batches of ``sync_every`` (on several ranks,
        once averaged across ranks): no collective here.
        """
        if self._kind == "micro" and self._layout.tp == 1 and self._steps:
            self._sync()  # one process: nothing to wait for (over tensor parallelism the sum is collective)
        self._land()
        return self.estimates.metrics()

    def summary(self, global_batch: int | None = None, world_size: int | None = None) -> str:
        """Plain-language reading of the measurement for the end of a run.

        >>> mg.print0(noise.summary())
        """
        self.metrics()
        return self.estimates.summary(global_batch or self.plan.global_batch, world_size or self.plan.world_size)

    # The estimates' counters, read by callers and tests.
    @property
    def measured(self) -> int:
        return self.estimates.measured

    @property
    def skipped(self) -> int:
        return self.estimates.skipped

    @property
    def last(self) -> dict[str, float]:
        return self.estimates.last
