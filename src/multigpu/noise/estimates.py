"""The estimates of a ``NoiseScale``: batches of averaged squared norms folded into debiased EMAs.

``NoiseScale`` (scale.py) reads the norms and averages them across ranks;
this keeps what follows on the host: one transfer per batch of steps, the
unbiased |G|^2 and tr(Sigma) of each step (formulas.py), their EMAs, the
metrics and the plain-language summary.
"""

from __future__ import annotations

import math

import torch

from .formulas import DebiasedEMA, efficiency, estimate, steps_factor

# Averaged steps kept on the device before one transfer folds them into the
# EMAs: a host sync every step would stall a CUDA pipeline.
_FOLD_EVERY_CUDA = 64


class Estimates:
    """EMAs of |G|^2 and tr(Sigma) at ``global_batch``; ``tau`` in examples, one measurement per ``every`` steps."""

    def __init__(self, global_batch: int, tau: float, every: int) -> None:
        self.global_batch, self.tau, self.every = global_batch, tau, every
        self._ema_g, self._ema_t = DebiasedEMA(), DebiasedEMA()
        self.measured = 0       # steps folded into the EMAs
        self.skipped = 0        # measured steps dropped for inf/nan (fp16 overflow)
        self.last: dict[str, float] = {}  # raw values of the last folded step (tests, debugging)
        self.pending: list[tuple] = []    # squared norms, not yet folded: (local vec, total vec, scales, b_small)

    def add(self, local_sq: torch.Tensor, total_sq: torch.Tensor, scales: list, b_small: int) -> None:
        """One batch of steps: squared norms of the small (``b_small``) and the global batch, loss scales."""
        self.pending.append((local_sq, total_sq, scales, b_small))
        if local_sq.device.type != "cuda" or sum(len(r[2]) for r in self.pending) >= _FOLD_EVERY_CUDA:
            self.fold()

    def fold(self) -> None:
        if not self.pending:
            return
        device = self.pending[0][0].device
        scales = [s for r in self.pending for s in r[2]]
        scale_vec = torch.stack([torch.ones((), dtype=torch.float64, device=device) if s is None
                                 else s.reshape(()).double().to(device) for s in scales])
        # One transfer for the whole queue (one host sync on CUDA).
        flat = torch.cat([torch.cat([r[0] for r in self.pending]), torch.cat([r[1] for r in self.pending]),
                          scale_vec]).tolist()
        n = len(scales)
        b_small = [r[3] for r in self.pending for _ in r[2]]
        b_big = self.global_batch
        beta = math.exp(-self.every * b_big / self.tau)  # a measurement stands for ``every`` steps
        for i in range(n):
            local, total = flat[i] / flat[2 * n + i] ** 2, flat[n + i] / flat[2 * n + i] ** 2
            grad_sq, trace_cov = estimate(local, total, b_small[i], b_big)
            self.last = {"local_sq": local, "total_sq": total, "grad_sq": grad_sq, "trace_cov": trace_cov}
            if not (math.isfinite(grad_sq) and math.isfinite(trace_cov)):
                self.skipped += 1  # an fp16 overflow step: the scaler skips it too
                continue
            self._ema_g.update(grad_sq, beta)
            self._ema_t.update(trace_cov, beta)
            self.measured += 1
        self.pending = []

    def metrics(self) -> dict[str, float]:
        """See ``NoiseScale.metrics``."""
        self.fold()
        if self.measured + self.skipped == 0:
            return {}
        out = {"noise/measured_steps": float(self.measured), "noise/skipped_steps": float(self.skipped)}
        if self.measured == 0:
            return out
        g, t = self._ema_g.value(), self._ema_t.value()
        out |= {"noise/grad_sq": g, "noise/trace_cov": t}
        if g > 0:
            out["noise/b_simple"] = t / g
            out["noise/efficiency"] = efficiency(self.global_batch, t / g)
        out["noise/noise_dominated"] = float(g <= 0)
        return out

    def state_dict(self, rounds: int) -> dict[str, torch.Tensor]:
        """The EMAs and counters as one float64 tensor (DCP stores tensors, no pickles); fold first."""
        self.fold()
        g, t = self._ema_g, self._ema_t
        return {"estimates": torch.tensor([g.sum, g.weight, t.sum, t.weight, self.measured, self.skipped, rounds],
                                          dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> int:
        """Restore ``state_dict``'s values; returns the optimizer steps seen (NoiseScale's ``every`` count)."""
        v = [float(x) for x in state["estimates"].tolist()]
        self._ema_g.sum, self._ema_g.weight, self._ema_t.sum, self._ema_t.weight = v[:4]
        self.measured, self.skipped, self.pending = int(v[4]), int(v[5]), []
        return int(v[6])

    def summary(self, batch: int, world: int) -> str:
        """See ``NoiseScale.summary``."""
        m = self.metrics()
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
