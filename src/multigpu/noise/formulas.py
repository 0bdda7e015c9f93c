"""The noise-scale formulas: unbiased estimates from two batch sizes, efficiency, gain, steps.

McCandlish et al. 2018 (arXiv:1812.06162): with true gradient G and
per-example covariance Sigma, ``B_simple = tr(Sigma) / |G|^2`` estimates the
critical batch size, beyond which a bigger batch buys little. Since
``E|G_B|^2 = |G|^2 + tr(Sigma)/B``, two batch sizes give unbiased estimates of
both terms (their appendix A.1).
"""

from __future__ import annotations

import math

__all__ = ["estimate", "efficiency", "gain", "steps_factor"]


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


class DebiasedEMA:
    """Exponential moving average with Adam-style bias correction (host floats)."""

    def __init__(self) -> None:
        self.sum = 0.0
        self.weight = 0.0

    def update(self, value: float, beta: float) -> None:
        self.sum = beta * self.sum + (1 - beta) * value
        self.weight = beta * self.weight + (1 - beta)

    def value(self) -> float:
        return self.sum / self.weight if self.weight > 0 else math.nan
