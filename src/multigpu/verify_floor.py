"""What verify holds a comparison to: the script's own floor, how far rounding alone moves its training,
measured by one more run; where that run is no evidence of rounding alone, the precision's tolerances.

The floor run is the reference again (its world size, its flags) with two changes that move a correct script
by rounding only (``meter/probe.py``, under ``MULTIGPU_VERIFY_FLOOR=1``):

- each step's samples in another order, within every tensor of the batch: each micro-batch holds the same
  samples (BatchNorm's statistics too), only the order of the float sums over them differs;
- each gradient rounded once more in the dtype the script reports (a relative error of up to one unit
  roundoff): what N ranks add, each rounding its own share of a gradient before the ranks sum them.
  Reordering alone moves bf16 runs 1e3-1e4 x less than another world size does.

A comparison is DIFFERENT where step 0's loss stands more than ``STEP0_FACTOR`` x above step 0's floor, or a
later loss or the final parameters more than ``LATER_FACTOR`` x above theirs (and never where the precision's
tolerance would not have said so: the floor only tightens). One tolerance per precision cannot be both:
fp32's 1.4e-2 of the update, above the noisiest correct script measured, let through a BatchNorm without
sync 7e4 x above its own script's floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Spread:
    """One quantity measured (benchmarks/verify_precision.py: an MLP, a conv net and a GPT, 3 seeds each, 2 and 4
    CPU processes against one, 5 and 30 steps; the 5 planted bugs of tests/_verify_script.py likewise): the
    largest difference between correct runs and the smallest a planted bug made. The tolerance is their
    geometric middle, as far (as a factor) from one as from the other."""

    correct: float
    bug: float

    @property
    def tolerance(self) -> float:
        return math.sqrt(self.correct * self.bug)


# Step 0's loss: the same model on the same samples. Whatever the autocast dtype, every run rounds the same
# values the same way and only the order of fp32 sums differs, so step 0 is sharp in every precision.
STEP0 = Spread(correct=1.7e-7, bug=1.8e-2)  # 5.5e-5


@dataclass(frozen=True)
class Tolerance:
    """What a correct script's runs may differ by in the precision its StepMeter reports (``dtype=``), from
    step 1 on, when rounding has moved their parameters apart.

    Final parameters are judged by |theta_N - theta_1| / |theta_1 - theta_initial| over the whole model: the
    share of the training's update that differs. Element-wise they cannot be: AdamW divides by the root of
    each gradient's second moment, so where a gradient cancels to ~1e-9 (a conv bias before BatchNorm)
    rounding decides an update of up to lr."""

    loss: Spread  # relative loss difference, any step after step 0
    update: Spread  # share of the update
    measured: bool = True  # False: no runs of this precision measured; a coarser precision's, as a bound
    # Step 0's loss where the precision itself makes it differ with the same model and samples: float8 scales
    # each tensor by its own amax, and a rank's amax is its share's, so 2 ranks round otherwise than 1. None:
    # step 0 is sharp (STEP0).
    step0: Spread | None = None

    @property
    def separates(self) -> bool:
        """Whether every quantity's planted bugs stand beyond its correct runs: else no tolerance tells them apart."""
        return all(s.correct < s.bug for s in (self.step0 or STEP0, self.loss, self.update))

    def basis(self, precision: str) -> str:
        if not self.measured:
            return f"{precision} not measured: bf16's, which rounds coarser, as a bound"
        return (f"{precision}'s correct runs measured up to {self.loss.correct:.1e} and {self.update.correct:.1e} "
                f"in 5 and 30 steps on 1, 2 and 4 processes, planted bugs from {self.loss.bug:.1e} and "
                f"{self.update.bug:.1e}: each tolerance their geometric middle")


TOLERANCES = {
    "fp32": Tolerance(loss=Spread(correct=9.1e-4, bug=3.8e-2), update=Spread(correct=2.2e-3, bug=9.2e-2)),  # 5.9e-3, 1.4e-2
    "bf16": Tolerance(loss=Spread(correct=1.1e-2, bug=4.0e-2), update=Spread(correct=3.5e-2, bug=9.3e-2)),  # 2.1e-2, 5.7e-2
}
# fp16 and TF32 (10-bit mantissas) round finer than bf16 (7 bits) and coarser than fp32; not measured.
TOLERANCES["fp16"] = TOLERANCES["tf32"] = replace(TOLERANCES["bf16"], measured=False)
# fp8 (torchao's tensorwise float8, emulated on CPU; the MLP and GPT targets, 5 and 30 steps, and the planted bugs,
# 2026-12-07): float8 scales each tensor by its rank's own amax, so a rank's share rounds otherwise than the whole
# batch does, from step 0. Correct runs reach what planted bugs reach at step 0 (3.5e-3 against 2.5e-3) and in
# the parameters (1.9e-1 of the update against 5.2e-2): no tolerance separates them, and verify refuses fp8.
TOLERANCES["fp8"] = Tolerance(loss=Spread(correct=1.7e-2, bug=1.9e-2), update=Spread(correct=1.9e-1, bug=5.2e-2),
                              step0=Spread(correct=3.5e-3, bug=2.5e-3))


def undecidable(precision: str) -> str | None:
    """Why verify cannot judge ``precision`` (its rounding moves correct runs as far as bugs), or None."""
    tol = TOLERANCES.get(precision)
    if tol is None or tol.separates:
        return None
    step0 = tol.step0 or STEP0
    return (f"verify cannot tell a bug from {precision}'s own rounding: correct runs measured up to {step0.correct:.1e} "
            f"at step 0, {tol.loss.correct:.1e} after and {tol.update.correct:.1e} of the update, planted bugs from "
            f"{step0.bug:.1e}, {tol.loss.bug:.1e} and {tol.update.bug:.1e} (float8 scales each tensor by the amax of "
            f"its rank's share); verify the script in bf16, where bugs stand apart (float8's layouts are checked against one "
            f"process in docs/float8.md)")


# How far above its floor a comparison may stand, each near the geometric middle of what correct runs and
# bugs measured (benchmarks/verify_precision.py, docs/study.md#the-floor). Step 0, the same model on the same
# samples before any update: correct runs at most 1.3 x, bugs at least 40 x (a BatchNorm without sync, fp32;
# the planted bugs 2,700 x). Later: correct runs up to 155 x, where rounding flips a discrete choice (a max
# pool's, a ReLU's) in one run and not in the other and the runs part (a conv net under AdamW, fp32, 30
# steps; 48 x in bf16), a BatchNorm without sync at least 7,800 x in fp32's later losses.
STEP0_FACTOR = 10.0
LATER_FACTOR = 1000.0
MIN_LOSS = 1e-7  # relative loss: a few roundings of an fp32 loss (a float64 script's floor is 1e-16)
MIN_UPDATE = 1e-7  # share of the update


@dataclass(frozen=True)
class Floor:
    """The floor run's distance from the reference: step 0's relative loss difference (the same model on the
    same samples: only the order of sums differs, in any precision), the largest of any later step's (one
    number, not one per step: how far rounding moves a loss swings from step to step, and a step that
    happens to round alike is no evidence that another world size should), and the final parameters' share
    of the update. ``why_not``: the floor run is no evidence of rounding alone, and the precision's
    tolerances judge instead."""

    step0: float = 0.0
    later: float = 0.0
    update: float | None = None
    precision: str = "fp32"
    why_not: str | None = None
    # The precision's tolerances (losses after step 0, share of the update): the most a comparison may stand
    # apart, whatever its floor, so a floor run that happened to round little never loosens verify.
    cap: tuple[float, float] = (math.inf, math.inf)

    @property
    def measured(self) -> bool:
        return self.why_not is None

    def loss_floor(self, step: int) -> float:
        return max(self.step0 if step == 0 else max(self.step0, self.later), MIN_LOSS)

    def update_floor(self) -> float:
        return max(self.update or 0.0, MIN_UPDATE)

    def loss_tol(self, step: int) -> float:
        """Step 0's loss: the same model on the same samples, held to its floor in any precision."""
        if step == 0:
            return STEP0_FACTOR * self.loss_floor(0)
        return min(LATER_FACTOR * self.loss_floor(step), self.cap[0])

    def update_tol(self) -> float:
        return min(LATER_FACTOR * self.update_floor(), self.cap[1])

    def times(self, rel: list[float], update: float | None) -> tuple[float, float | None]:
        """How many times the floor the largest loss difference and the final parameters stand."""
        loss = max((r / self.loss_floor(i) for i, r in enumerate(rel)), default=0.0)
        return loss, None if update is None else update / self.update_floor()

    def record(self) -> dict[str, Any]:
        return {"step0": self.step0, "later": self.later, "update": self.update, "why_not": self.why_not,
                "step0_factor": STEP0_FACTOR, "later_factor": LATER_FACTOR, "min_loss": MIN_LOSS,
                "min_update": MIN_UPDATE, "cap": list(self.cap)}


def loss_gaps(pairs: list[tuple[float, float]]) -> list[float]:
    """Per step, the losses' difference relative to the larger of the reference's loss there and at step 0.
    Not to the step's loss alone: a net that fits its data trains its loss towards 0, where two correct runs'
    1e-8 and 1e-6 stand 100 x apart, and the floor run's as far (a conv net at 30 steps: 1e5 x)."""
    scale = abs(pairs[0][0]) if pairs else 0.0
    return [abs(a - b) / max(abs(a), scale, 1e-12) for a, b in pairs]


def measure(ref: dict[str, Any], run: dict[str, Any], step0_tol: float, update: float | None) -> Floor:
    """The floor from the reference and its floor run (``update``: the floor run's final parameters' share
    of the reference's update), or why the floor run is no evidence of rounding alone."""
    precision = ref.get("precision", "fp32")
    probe, steps = run.get("floor") or {}, len(ref["losses"])
    rel = loss_gaps([(a, b) for a, b in zip(ref["losses"], run["losses"]) if a is not None and b is not None])
    why = None
    if not probe:
        why = "the floor run recorded no floor (a StepMeter without the probe)"
    elif probe.get("reordered", 0) < steps:
        why = (f"the samples of {steps - probe.get('reordered', 0)} of {steps} steps could not be put in another "
               f"order (a batch with no tensor of 2 or more samples, or a loop that does not take its batches "
               f"from StepMeter.steps)")
    elif len(rel) < steps:
        why = "the floor run logged fewer losses than the reference"
    elif any(abs(a - b) > 1e-9 * max(abs(a), 1.0) for a, b in zip(ref["digests"], run["digests"])):
        why = "the floor run trained on other samples than the reference (a loader that is not deterministic)"
    elif rel and rel[0] > step0_tol:
        why = (f"the same samples in another order changed step 0's loss by {rel[0]:.1e}: the script's batches do "
               f"not hold one sample per row of their first dimension, or it does not treat samples apart")
    elif precision != "fp32" and not probe.get("rounded"):
        why = (f"no gradient could be rounded once more in {precision} (pass model= to the StepMeter; sharded or "
               f"pipelined parameters are not), and reordering alone misses most of {precision}'s rounding")
    if why is not None:
        return Floor(precision=precision, why_not=why)
    tol = TOLERANCES.get(precision, TOLERANCES["fp16"])
    return Floor(rel[0] if rel else 0.0, max(rel[1:], default=0.0), update, precision,
                 cap=(tol.loss.tolerance, tol.update.tolerance))


def describe(floor: Floor, reference: str) -> str:
    """The floor in one line: how it was measured, what it measured, what a comparison may stand above it."""
    if not floor.measured:
        return f"no floor: {floor.why_not}"
    final = (f", final parameters {floor.update:.1e} of the update" if floor.update is not None
             else " (parameters not compared: pass model= to the StepMeter)")
    return (f"the floor, {reference} again with each step's samples in another order and each gradient rounded once "
            f"more in {floor.precision}: losses {floor.step0:.1e} apart at step 0 and up to {floor.later:.1e} after{final}; "
            f"DIFFERENT above {STEP0_FACTOR:g} x it at step 0, {LATER_FACTOR:g} x after (a floor of at least "
            f"{MIN_LOSS:.0e}; never more than {floor.precision}'s tolerances, {floor.cap[0]:.1e} losses and "
            f"{floor.cap[1]:.1e} of the update)")
