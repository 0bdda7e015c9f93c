"""Which rank is slow, and is it slow in data loading or in compute.

In synchronous training every rank's step takes as long as the slowest one,
because the fast ranks wait inside the gradient all-reduce. So a rank is
compared on the time it spends *before* it can wait for anybody: its data
wait, and its "ready" time (step start until its own gradients are ready,
measured with gradient hooks when the meter knows the model; the whole
compute time otherwise).

A rank is a straggler on a quantity when its per-step median exceeds the
median of the *other* ranks by more than ``k_mad`` x a spread and by more than
``min_excess`` of that median. The spread is the larger of the MAD across the
other ranks and the typical step-to-step MAD within a rank (``jitter``): on
two or three ranks the first is 0 or meaningless, and on a busy machine a rank
can be a few ms slower for a while without being a straggler. Leaving the rank
out keeps the rule meaningful on two ranks, where the median of both would sit
halfway and the MAD could never be exceeded 3 times.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    cause: str  # "data wait" | "compute"
    seconds: float  # this rank's time per step on that quantity
    median: float  # the other ranks' median
    excess: float  # seconds - median

    def line(self) -> str:
        # A percentage of a near-zero median (no data wait elsewhere) says nothing.
        pct = f" (+{100 * self.excess / self.median:.0f}%)" if self.median >= 1e-3 else ""
        return (f"straggler: rank {self.rank} (host {self.host}) spends {self.seconds * 1e3:.1f} ms/step in {self.cause}, "
                f"{self.excess * 1e3:.1f} ms{pct} more than the other ranks' median {self.median * 1e3:.1f} ms")

    def to_dict(self) -> dict:
        return asdict(self)


def _outlier(values: list[float], rank: int, k_mad: float, min_excess: float, floor: float,
             jitter: list[float] | None) -> tuple[float, float] | None:
    others = [v for r, v in enumerate(values) if r != rank]
    if not others:
        return None
    med = statistics.median(others)
    mad = statistics.median([abs(v - med) for v in others])
    if jitter:
        mad = max(mad, statistics.median(jitter))
    excess = values[rank] - med
    # ``floor`` (seconds) ignores differences too small to matter (timer noise on sub-ms steps).
    if excess > k_mad * mad and excess > min_excess * med and excess > floor:
        return med, excess
    return None


def find_stragglers(
    data_wait: list[float],
    compute: list[float],
    hosts: list[str],
    k_mad: float = 3.0,
    min_excess: float = 0.05,
    floor: float = 1e-3,
    data_jitter: list[float] | None = None,
    compute_jitter: list[float] | None = None,
) -> list[Straggler]:
    """Ranks whose per-step data wait or compute ("ready") time stands out.

    Inputs are per-rank seconds per step (lists indexed by rank); the optional
    jitters are each rank's step-to-step MAD of the same quantity.

    >>> find_stragglers([0.001, 0.001, 0.200], [0.05, 0.05, 0.05], ["a", "a", "b"])[0].line()
    'straggler: rank 2 (host b) spends 200.0 ms/step in data wait, 199.0 ms more than the other ranks' median 1.0 ms'
    """
    found = []
    for cause, values, jitter in (("data wait", data_wait, data_jitter), ("compute", compute, compute_jitter)):
        for rank in range(len(values)):
            hit = _outlier(values, rank, k_mad, min_excess, floor, jitter)
            if hit:
                found.append(Straggler(rank, hosts[rank], cause, values[rank], hit[0], hit[1]))
    return found
