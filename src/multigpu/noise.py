"""Gradient noise scale during training, from gradients data parallelism already has.

McCandlish et al. 2018 (arXiv:1812.06162): with true gradient G and
per-example covariance Sigma, ``B_simple = tr(Sigma) / |G|^2`` estimates the
critical batch size, beyond which a bigger batch buys little. Since
``E|G_B|^2 = |G|^2 + tr(Sigma)/B``, two batch sizes give unbiased estimates of
both terms; data parallelism has both for free: each rank's gradient (batch b,
before the all-reduce) and the averaged one (batch K*b, after). With one
process the accumulation micro-batches play the small batch.

The two estimates are averaged separately (debiased EMAs, time constant in
examples) and only then divided: the mean of per-step ratios is biased
(tests/test_noise.py shows by how much). Nothing here calls ``.item()`` during
training: estimates stay on the device until ``metrics()`` asks.

The loss must be a mean over the examples of the optimizer step (divide by
``plan.accum_steps`` when accumulating), as in every multigpu example.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as tdist

from .batch import BatchPlan
from .errors import UsageError

__all__ = ["NoiseScale", "estimate", "efficiency", "gain", "steps_factor"]


def estimate(small_sq, big_sq, b_small: float, b_big: float):
    """Unbiased ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes.

    ``small_sq`` is the mean of ``|g|^2`` over gradients of ``b_small`` examples,
    ``big_sq`` the ``|g|^2`` of one gradient of ``b_big`` examples. Works on
    floats, numpy arrays and tensors alike.

    >>> estimate(small_sq=2.0, big_sq=1.25, b_small=32, b_big=128)
    (1.0, 32.0)
    """
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace_cov = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace_cov


def efficiency(batch: float, noise_scale: float, base_batch: float = 0.0) -> float:
    """Per-example efficiency of ``batch`` relative to ``base_batch`` (Pollux): (phi+B0)/(phi+B).

    With ``base_batch=0`` it is ``E_min/E = 1/(1 + B/phi)`` (McCandlish et al.).

    >>> efficiency(1000, noise_scale=1000)
    0.5
    """
    return (noise_scale + base_batch) / (noise_scale + batch)


def gain(batch: float, base_batch: float, noise_scale: float) -> float:
    """Per-step progress of ``batch`` over ``base_batch`` (AdaScale): S(phi+B0)/(phi+S*B0), S=B/B0.

    Between 1 and S; it is also the LR multiplier AdaScale uses.

    >>> round(gain(1024, 128, noise_scale=1e9), 3)   # pure noise: linear
    8.0
    """
    s = batch / base_batch
    return s * (noise_scale + base_batch) / (noise_scale + s * base_batch)


def steps_factor(batch: float, noise_scale: float) -> float:
    """Steps to a target loss relative to the minimum: S/S_min = 1 + B_crit/B."""
    return 1.0 + noise_scale / batch


class _DebiasedEMA:
    """Exponential moving average with Adam-style bias correction (host floats)."""

    def __init__(self) -> None:
        self.sum = 0.0
        self.weight = 0.0

    def update(self, value: float, beta: float) -> None:
        self.sum = beta * self.sum + (1 - beta) * value
        self.weight = beta * self.weight + (1 - beta)

    def value(self) -> float:
        return self.sum / self.weight if self.weight > 0 else math.nan


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm: one ``dot`` for fp32/fp64 (every tensor op costs host time);
    fp16/bf16 through an fp32 norm squared in fp64 (their squares overflow)."""
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t.reshape(-1), t.reshape(-1))
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


def _sq_sum(squares: list[torch.Tensor], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    if len(squares) == 1:  # one bucket: no extra op
        q = squares[0]
        return q if q.dtype == dtype else q.to(dtype)
    return torch.stack(squares).to(dtype).sum()


# Measured steps kept on the device before one transfer folds them into the
# EMAs: a host sync every step would stall a CUDA pipeline.
_FOLD_EVERY_CUDA = 64


class NoiseScale:
    """Measure the gradient noise scale B_simple of a running training job.

    Several ranks (DDP): ``attach`` registers a communication hook that reads
    each bucket before and after PyTorch's all-reduce (or a hook it wraps,
    e.g. ``fp16_compress_hook``); the ranks' mean ``|g_i|^2`` rides along in
    the last bucket's all-reduce (a separate 1-element all-reduce with a
    wrapped hook). One rank: the accumulation micro-batches are the small
    batch, read by gradient hooks (needs ``plan.accum_steps >= 2``).
    Sharded gradients (FSDP): call ``observe(local_sq, shard_sq, sharded=True)``.

    ``tau``: EMA time constant in training examples (default 100 global
    batches). ``every``: measure one step in ``every``. ``scaler``: the
    ``mg.Precision`` or ``torch.amp.GradScaler`` (anything with ``get_scale()``)
    whose loss scale the gradients carry.

    >>> noise = mg.NoiseScale(plan, every=1)
    >>> noise.attach(model)                  # after mg.wrap(model, "ddp")
    >>> ...train...
    >>> log(noise.metrics()); mg.print0(noise.summary())
    """

    def __init__(self, plan: BatchPlan, *, tau: float | None = None, every: int = 1, scaler: Any = None, group=None):
        if not isinstance(plan, BatchPlan):
            raise UsageError(f"NoiseScale needs the run's mg.BatchPlan, got {type(plan).__name__}; pass plan=mg.BatchPlan(...)")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"NoiseScale every= must be a positive integer (measure one step in every), got {every!r}")
        self.plan = plan
        self.tau = float(tau) if tau is not None else 100.0 * plan.global_batch
        if not self.tau > 0:
            raise UsageError(f"NoiseScale tau= is a time constant in examples and must be positive, got {tau}")
        self.every = every
        self.scaler = scaler
        self.group = group
        self._ema_g, self._ema_t = _DebiasedEMA(), _DebiasedEMA()
        self.measured = 0       # steps folded into the EMAs
        self.skipped = 0        # measured steps dropped for inf/nan (fp16 overflow)
        self.last: dict[str, float] = {}  # raw values of the last measured step (tests, debugging)
        self._raw: list[tuple] = []  # measured steps not yet folded: (local, total, scale or None, b_small, b_big)
        self._rounds = 0        # optimizer steps seen, measured or not
        self._round_done = False
        self._pending: dict | None = None
        self._local_sq: list[torch.Tensor] = []
        self._total_sq: list[torch.Tensor] = []
        self._reduced: list[torch.futures.Future] = []  # this step's reduced buckets
        self._handles: list = []
        self._counts: dict[int, int] = {}
        self._prev: dict[int, torch.Tensor] = {}

    # ---- wiring ---------------------------------------------------------------
    def attach(self, model: torch.nn.Module, comm_hook: Callable | None = None, hook_state: Any = None) -> "NoiseScale":
        """Start measuring ``model``: a DDP model on several ranks, any model on one.

        ``comm_hook`` is a DDP hook to wrap (default: PyTorch's all-reduce;
        e.g. ``default_hooks.fp16_compress_hook``), called as
        ``comm_hook(hook_state, bucket)``. DDP accepts only one hook, so
        register compression through here, not on the model.
        """
        world = self.plan.world_size
        actual = tdist.get_world_size(self.group) if tdist.is_available() and tdist.is_initialized() else 1
        if actual != world:
            raise UsageError(f"NoiseScale's plan is for world_size {world} but this job has {actual} processes; "
                             "build the plan with mg.BatchPlan(..., world_size=dist.world_size)")
        if world > 1:
            if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                raise UsageError(
                    f"NoiseScale.attach on {world} ranks needs a DDP model, got {type(model).__name__}; "
                    "wrap it first (mg.wrap(model, 'ddp')) or, for sharded gradients, call noise.observe(..., sharded=True)"
                )
            if getattr(model, "gradient_as_bucket_view", False):
                # The reduced buckets are read at the next forward; as views they
                # would show the gradients after clipping or unscaling.
                raise UsageError("NoiseScale needs DDP's default gradient_as_bucket_view=False, got True; "
                                 "wrap without gradient_as_bucket_view=True")
            state = hook_state if hook_state is not None else self.group
            model.register_comm_hook(state, self._wrap_hook(comm_hook))
        else:
            if self.plan.accum_steps < 2:
                raise UsageError(
                    f"NoiseScale on one process measures with accumulation micro-batches and needs accum_steps >= 2, "
                    f"got global batch {self.plan.global_batch} in micro-batches of {self.plan.micro_batch}; "
                    f"use mg.BatchPlan(..., micro_batch={max(1, self.plan.global_batch // 2)}) or run on 2+ ranks"
                )
            for p in model.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook))
        # The next forward begins a new step: fold the finished one in there.
        self._handles.append(model.register_forward_pre_hook(lambda *_: self.update()))
        return self

    def detach(self) -> None:
        """Remove the gradient and forward hooks (a DDP comm hook stays: DDP cannot unregister it)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _measuring(self) -> bool:
        return self._rounds % self.every == 0

    def _scale(self, device: torch.device) -> torch.Tensor | None:
        """The loss scale of the backward pass in progress (None without a scaler)."""
        s = self.scaler
        if s is not None and not hasattr(s, "get_scale"):
            s = getattr(s, "scaler", None)  # an mg.Precision: its GradScaler, or None below fp16
        if s is None:
            return None
        # GradScaler keeps its scale in a device tensor: reading it avoids the
        # host sync of get_scale(); it must be read now, before scaler.update().
        t = getattr(s, "_scale", None)
        if isinstance(t, torch.Tensor):
            return t.detach().to(device=device, dtype=torch.float64).reshape(())
        return torch.tensor(float(s.get_scale()), device=device, dtype=torch.float64)

    def _wrap_hook(self, inner: Callable | None) -> Callable:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        world = self.plan.world_size

        def hook(state, bucket):
            if bucket.index() == 0:
                # A new synchronising backward: the previous one, if any, is complete.
                self.update()
            if not self._measuring():
                if bucket.is_last():
                    self._round_done = True
                return (inner or default_hooks.allreduce_hook)(state, bucket)
            buf = bucket.buffer()
            # Before the reduction: allreduce_hook divides the buffer in place.
            self._local_sq.append(_sq(buf))
            if not bucket.is_last():
                # No callback: its result is read in update(). Tensor work on the
                # communication thread made processes abort at exit (measured: 2
                # of 8 runs with several buckets, "terminate called without an
                # active exception"); PyTorch's own hooks do none either.
                fut = (inner or default_hooks.allreduce_hook)(state, bucket)
                self._reduced.append(fut)
                return fut
            squares, self._local_sq = self._local_sq, []
            self._round_done = True
            scale = self._scale(buf.device)
            group = state if state is not None else tdist.group.WORLD
            if inner is None and buf.dtype in (torch.float32, torch.float64):
                # PyTorch's allreduce_hook, with |g_i|^2 appended: no extra collective.
                packed = torch.cat([buf, _sq_sum(squares, buf.dtype).reshape(1)]).div_(world)
                # DDP copies the result into the gradients, and nobody writes to
                # ``packed`` afterwards: its norm can wait for update(), keeping
                # the callback (on the communication thread) as light as PyTorch's.
                self._pending = {"local": packed[-1:], "scale": scale, "reduced": packed[:-1]}
                return tdist.all_reduce(packed, group=group, async_op=True).get_future().then(lambda f: f.value()[0][:-1])
            fut = (inner or default_hooks.allreduce_hook)(state, bucket)
            self._reduced.append(fut)
            mean_local = (_sq_sum(squares) / world).reshape(1)
            work = tdist.all_reduce(mean_local, group=group, async_op=True)
            self._pending = {"local": mean_local, "scale": scale, "work": work}
            return fut

        return hook

    def _param_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        n = self._counts.get(key, 0) + 1
        accum = self.plan.accum_steps
        if self._measuring():
            g = p.grad.detach()
            prev = self._prev.get(key)
            # This micro-batch's share of the gradient is what the last backward added.
            self._local_sq.append(_sq(g if prev is None else g - prev))
            if n < accum:
                self._prev[key] = g.clone() if prev is None else prev.copy_(g)
            else:
                self._prev.pop(key, None)
                self._total_sq.append(_sq(g))
                self._pending = {"scale": self._scale(g.device)}
        if n == accum:
            n = 0
            self._round_done = True
        self._counts[key] = n

    # ---- estimation -----------------------------------------------------------
    def observe(self, local_sq, total_sq, *, sharded: bool = False, scale: float | torch.Tensor = 1.0) -> None:
        """Record one step from squared norms computed elsewhere (collective: every rank calls it).

        ``local_sq``: this rank's ``|g_i|^2`` before averaging (batch ``plan.rank_batch``).
        ``total_sq``: ``|mean_i g_i|^2``; with ``sharded=True``, the squared norm
        of this rank's shard of it (FSDP/ZeRO), summed across ranks here.
        ``scale``: the loss scale the gradients carry. Call it once per
        ``every`` optimizer steps.
        """
        if self.plan.world_size < 2:
            raise UsageError("NoiseScale.observe needs 2+ ranks (rank gradients are the small batch); "
                             "on one process use attach(model) with accumulation micro-batches")
        local = torch.as_tensor(local_sq, dtype=torch.float64).reshape(1)
        total = torch.as_tensor(total_sq, dtype=torch.float64, device=local.device).reshape(1)
        vec = torch.cat([local / self.plan.world_size, total if sharded else torch.zeros_like(total)])
        tdist.all_reduce(vec, group=self.group)
        total = vec[1] if sharded else total[0]
        scale = torch.as_tensor(scale, dtype=torch.float64, device=local.device)
        self._record(vec[0], total, scale, self.plan.rank_batch, self.plan.global_batch)

    def update(self) -> None:
        """Fold a completed step in (called for you at the next forward and by ``metrics()``)."""
        if not self._round_done:
            return
        pending, self._pending = self._pending, None
        self._round_done = False
        self._rounds += 1
        if pending is None:
            return
        for fut in self._reduced:
            value = fut.value()
            self._total_sq.append(_sq(value[0] if isinstance(value, (list, tuple)) else value))
        self._reduced = []
        if "reduced" in pending:
            self._total_sq.append(_sq(pending["reduced"]))
        total = _sq_sum(self._total_sq)
        if "local" in pending:  # ranks are the small batches
            if "work" in pending:
                pending["work"].wait()
            local = pending["local"]
            b_small = self.plan.rank_batch
        else:  # one rank: micro-batches are; the loss carries 1/accum_steps
            local = _sq_sum(self._local_sq) * self.plan.accum_steps
            b_small = self.plan.micro_batch
        self._local_sq, self._total_sq = [], []
        self._record(local, total, pending["scale"], b_small, self.plan.global_batch)

    def _record(self, local, total, scale, b_small, b_big) -> None:
        """Queue one step's (device) values; fold them in now on CPU, in batches on CUDA."""
        self._raw.append((local, total, scale, b_small, b_big))
        if local.device.type != "cuda" or len(self._raw) >= _FOLD_EVERY_CUDA:
            self._fold()

    def _fold(self) -> None:
        if not self._raw:
            return
        if self._raw[0][0].device.type == "cuda":  # one transfer for the whole queue
            flat = torch.stack([t.reshape(()).double() for r in self._raw for t in r[:3] if t is not None]).tolist()
        else:
            flat = [float(t) for r in self._raw for t in r[:3] if t is not None]
        values, i = [], 0
        for local, total, scale, b_small, b_big in self._raw:
            n = 2 if scale is None else 3
            values.append((*flat[i:i + 2], flat[i + 2] if scale is not None else 1.0, b_small, b_big))
            i += n
        beta = math.exp(-self.every * self.plan.global_batch / self.tau)  # a measurement stands for ``every`` steps
        for local, total, scale, b_small, b_big in values:
            local, total = local / scale**2, total / scale**2
            grad_sq, trace_cov = estimate(local, total, b_small, b_big)
            self.last = {"local_sq": local, "total_sq": total, "grad_sq": grad_sq, "trace_cov": trace_cov}
            if not (math.isfinite(grad_sq) and math.isfinite(trace_cov)):
                self.skipped += 1  # an fp16 overflow step: the scaler skips it too
                continue
            self._ema_g.update(grad_sq, beta)
            self._ema_t.update(trace_cov, beta)
            self.measured += 1
        self._raw = []

    # ---- reporting ------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Current estimates for the step logger (empty before the first measured step).

        ``noise/b_simple`` is absent while the |G|^2 estimate is <= 0
        (noise-dominated); ``noise/noise_dominated`` is then 1.
        """
        self.update()
        self._fold()
        if self.measured + self.skipped == 0:
            return {}
        out = {"noise/measured_steps": float(self.measured), "noise/skipped_steps": float(self.skipped)}
        if self.measured == 0:
            return out
        g, t = self._ema_g.value(), self._ema_t.value()
        out |= {"noise/grad_sq": g, "noise/trace_cov": t}
        if g > 0:
            out["noise/b_simple"] = t / g
            out["noise/efficiency"] = efficiency(self.plan.global_batch, t / g)
        out["noise/noise_dominated"] = float(g <= 0)
        return out

    def summary(self, global_batch: int | None = None, world_size: int | None = None) -> str:
        """Plain-language reading of the measurement for the end of a run.

        >>> mg.print0(noise.summary())
        """
        m = self.metrics()
        batch = global_batch or self.plan.global_batch
        world = world_size or self.plan.world_size
        if "noise/grad_sq" not in m:
            return "gradient noise scale: no step measured yet (it needs one synchronised optimizer step)."
        steps = int(m["noise/measured_steps"])
        head = f"gradient noise scale over {steps} measured steps (EMA time constant {self.tau:,.0f} examples):"
        if "noise/b_simple" not in m:
            return (
                f"{head} noise-dominated (estimated |G|^2 = {m['noise/grad_sq']:.3g} <= 0): the gradient signal is "
                f"below the noise at batch {batch}, so larger batches still help almost linearly; measure longer to resolve it."
            )
        phi = m["noise/b_simple"]
        eff = efficiency(batch, phi)
        per_gpu = batch / world
        doubled = 2 * batch
        speedup = steps_factor(batch, phi) / steps_factor(doubled, phi)
        verdict = (
            "still pays (near-linear)" if speedup >= 1.6 else
            "pays partly" if speedup >= 1.25 else "would mostly waste the extra GPUs"
        )
        return "\n".join([
            head,
            f"  B_simple ~ {phi:,.0f} examples; global batch {batch} is {batch / phi:.2g}x of it.",
            f"  per-example efficiency ~ {eff:.0%} of a small-batch run (steps to target ~ {steps_factor(batch, phi):.2f}x the minimum).",
            f"  twice the GPUs at {per_gpu:g} per GPU (global {doubled}): steps to target /{speedup:.2f} "
            f"(ideal /2) -> {verdict}.",
        ])
