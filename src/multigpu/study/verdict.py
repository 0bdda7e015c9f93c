"""Verdicts for a scaling study: what limits a world size, derived from measurements.

Each rule reads one group's measured figures (means over repeats) and returns a
``StudyFinding`` or nothing; the first finding in severity order is the headline.
Thresholds are module constants so the docs can quote them and tests can
fabricate measurements on either side of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: a rank waiting on its loader for at least this share of the step is data-loading bound
DATA_WAIT_BOUND = 0.20
#: exposed (not overlapped) communication at least this share of the step is communication bound
COMM_BOUND = 0.25
#: scaling efficiency at or above this is compute bound ("scales well")
GOOD_EFFICIENCY = 0.80
#: global batch at or above this multiple of the noise scale is beyond the critical batch
BEYOND_CRITICAL = 2.0
#: accuracy drop (absolute, 0-1) against the 1-worker run that counts as a regression, at least
ACCURACY_DROP = 0.01


@dataclass(frozen=True)
class StudyFinding:
    """One reason a scaling-study group scales or not, with the measurement behind it and what to try.

    (Not ``multigpu.doctor.Finding``, which is one line of the doctor's environment report.)
    """

    kind: str  # failed | short | accuracy | data | communication | critical-batch | inconclusive | compute | scaling
    text: str

    def __str__(self) -> str:
        return self.text


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _mean(value: Any) -> float | None:
    """A figure given as a number or as a {mean, std} spread."""
    return value.get("mean") if isinstance(value, Mapping) else value


def findings(group: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> list[StudyFinding]:
    """All findings for one (workers, policy) group, most important first.

    ``group`` holds: workers, global_batch, n_ok, n_failed, n_short (runs that
    finished too short to judge: ``meter.evidence.thin_evidence``), efficiency (or None
    for the baseline), breakdown {data_wait, compute, comm_exposed, idle} as
    fractions of step time (any may be None), accuracy {mean, std}, noise_scale,
    errors and short (the failed and the short runs' lines). ``baseline`` is the
    1-worker group of the same policy (or None).
    """
    out: list[StudyFinding] = []
    runs = group.get("n_ok", 0) + group.get("n_failed", 0) + group.get("n_short", 0)
    if group.get("n_ok", 0) == 0:
        if group.get("n_short") and not group.get("n_failed"):
            return [StudyFinding("short", f"no verdict: {group['short'][0]}")]
        err = (group.get("errors") or ["no run finished"])[0]
        return [StudyFinding("failed", f"failed: {err}")]
    if group.get("n_failed"):
        out.append(StudyFinding("failed", f"{group['n_failed']} of {runs} runs failed: {(group.get('errors') or ['?'])[0]}"))
    if group.get("n_short"):
        out.append(StudyFinding("short", f"{group['n_short']} of {runs} runs left out, too short to judge: "
                                         f"{group['short'][0]}"))
    acc, base_acc = (group.get("accuracy") or {}), (baseline or {}).get("accuracy") or {}
    if acc.get("mean") is not None and base_acc.get("mean") is not None and group.get("workers") != 1:
        spread = max(acc.get("std") or 0.0, base_acc.get("std") or 0.0)
        drop = base_acc["mean"] - acc["mean"]
        if drop > max(ACCURACY_DROP, 2 * spread):
            out.append(StudyFinding(
                "accuracy",
                f"accuracy drop: {100 * acc['mean']:.2f} % vs {100 * base_acc['mean']:.2f} % on 1 worker "
                f"at global batch {group.get('global_batch')}; lengthen warmup, lower the LR rule "
                f"(sqrt instead of linear) or keep the global batch",
            ))
    breakdown = group.get("breakdown") or {}
    wait, comm = breakdown.get("data_wait"), breakdown.get("comm_exposed")
    if wait is not None and wait >= DATA_WAIT_BOUND:
        out.append(StudyFinding("data", f"data-loading bound: rank wait {_pct(wait)} of step; raise num_workers, "
                                        f"pin memory, or move preprocessing off the training path"))
    if comm is not None and comm >= COMM_BOUND:
        out.append(StudyFinding("communication", f"communication bound: {_pct(comm)} exposed all-reduce; try bf16 "
                                                 f"compress, larger buckets, or a larger per-GPU batch"))
    phi, batch = group.get("noise_scale"), group.get("global_batch")
    if phi and batch and phi > 0 and batch >= BEYOND_CRITICAL * phi:
        out.append(StudyFinding("critical-batch", f"beyond the critical batch: global batch {batch} vs noise scale "
                                                  f"~{phi:.0f}; more GPUs will not cut steps"))
    efficiency = group.get("efficiency")
    eff = _mean(efficiency)
    if eff is not None and not any(f.kind in ("data", "communication") for f in out):
        low, high = (efficiency.get("low"), efficiency.get("high")) if isinstance(efficiency, Mapping) else (None, None)
        if low is None:
            sure = "; one round: no interval (--repeats 3 or --ci 0.1 gives one)"
        else:
            sure = f"; 95 % interval {_pct(low)}-{_pct(high)} over {efficiency.get('n')} rounds"
        if low is not None and low < GOOD_EFFICIENCY <= high:
            out.append(StudyFinding("inconclusive", f"inconclusive: {_pct(eff)} efficiency, but the 95 % interval "
                                                    f"{_pct(low)}-{_pct(high)} straddles the {_pct(GOOD_EFFICIENCY)} "
                                                    f"threshold; more rounds (--ci 0.05) would decide"))
        elif eff >= GOOD_EFFICIENCY:
            out.append(StudyFinding("compute", f"compute bound: {_pct(eff)} efficiency{sure}"))
        else:
            parts = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}" for k, v in breakdown.items() if v is not None)
            out.append(StudyFinding("scaling", f"poor scaling: {_pct(eff)} efficiency"
                                               + (f" ({parts})" if parts else "") + sure))
    elif group is not baseline and baseline is not None and baseline.get("n_ok", 0) == 0:
        # No efficiency without the 1-worker runs: say why rather than judge the scaling from nothing.
        short = bool(baseline.get("n_short")) and not baseline.get("n_failed")
        why = (f"was too short to judge: {baseline['short'][0]}" if short
               else f"failed: {(baseline.get('errors') or ['no run finished'])[0]}")
        out.append(StudyFinding("short" if short else "failed", f"no verdict on scaling: the 1-worker baseline {why}"))
    return out


def verdict(group: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> str:
    """The headline for one group: its most important finding, or the baseline's note."""
    found = findings(group, baseline)
    if found:
        return found[0].text
    if baseline is None and group.get("workers") != 1:  # e.g. --workers 2,4: nothing to scale against
        return "no verdict on scaling: no 1-worker run to compare with (add 1 to --workers)"
    return "baseline (1 worker)"
