"""What the replica groups' quorum did, as the meter reports it (``StepMeter(..., replicas=replicas)``).

Under ``multigpu run --fault-tolerant G`` a step is committed by the groups in that step's quorum, or not
committed at all and retried (``mg.fault_tolerant``). The meter counts from the replicas' own record,
not from its guesses: per log interval the steps committed and retried, those without every group and the
samples their missing shares skipped, the fewest groups in a quorum, heals from a live group and the time
spent forming quorums (taken out of the data wait, where the loader's ``next()`` would have put it). A
*quorum change* is a committed step whose groups differ from the previous committed step's.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError


def _fresh() -> dict[str, Any]:
    return {"committed": 0, "retried": 0, "without_all": 0, "skipped": 0, "fewest": None, "heals": 0,
            "heal_s": 0.0, "quorum_s": 0.0, "changes": []}


class Quorum:
    """Counts one group's view of the quorums, per interval (``take``) and over the run (``total``)."""

    def __init__(self, replicas: Any) -> None:
        if not all(hasattr(replicas, name) for name in ("groups", "record", "quorum_s", "skipped")):
            raise UsageError(f"StepMeter(replicas=...) takes the replicas mg.fault_tolerant returns, got a "
                             f"{type(replicas).__name__}; pass replicas=mg.fault_tolerant(model, optimizer, dist)")
        self.replicas = replicas
        self.groups = replicas.groups
        self._seen = len(replicas.record)
        self._last: tuple[int, ...] | None = None  # the groups of the previous committed step
        self.interval, self.total = _fresh(), _fresh()

    def begin(self, item: tuple[int, Any], waited: float) -> tuple[int, Any, float]:
        """(committed step, micro-batches, data wait) of a ``replicas.steps`` item that took ``waited`` seconds:
        the quorum's own time (a heal included, measured by the replicas) is not data wait."""
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)):
            raise UsageError(f"StepMeter(replicas=...) meters the steps replicas.steps gives, got items of type "
                             f"{type(item).__name__}; iterate meter.steps(replicas.steps(train, steps))")
        step, batch = item
        quorum_s = self.replicas.quorum_s
        for acc in (self.interval, self.total):
            acc["quorum_s"] += quorum_s
        return step, batch, max(0.0, waited - quorum_s)

    def step_end(self) -> bool:
        """Count the step that just ended; True when the quorum committed it (False: it is retried)."""
        new = self.replicas.record[self._seen:]
        self._seen = len(self.replicas.record)
        for acc in (self.interval, self.total):
            if not new:
                acc["retried"] += 1
            for rec in new:
                acc["committed"] += 1
                acc["without_all"] += len(rec.groups) < self.groups
                acc["skipped"] += rec.skipped
                acc["fewest"] = min(len(rec.groups), acc["fewest"] or self.groups)
                acc["heals"] += rec.healed
                acc["heal_s"] += rec.heal_s
        for rec in new:
            if rec.groups != self._last:
                change = {"step": rec.step, "groups": list(rec.groups)}
                self.interval["changes"].append(change)
                self.total["changes"].append(change)
                self._last = rec.groups
        return bool(new)

    def take(self) -> dict[str, Any]:
        """The interval's counts (for its ``step`` record), and a new interval."""
        out, self.interval = dict(self.interval, groups=self.groups), _fresh()
        return out

    def summary(self) -> dict[str, Any]:
        return dict(self.total, groups=self.groups)


def text(block: dict[str, Any]) -> str:
    """A summary's ``replicas`` in words: '3 groups: 2 steps without every group (40 samples skipped), ...'."""
    parts = [f"{block['committed']} steps committed"]
    if block["without_all"]:
        parts.append(f"{block['without_all']} without every group ({block['skipped']:,} samples skipped, "
                     f"fewest {block['fewest']} of {block['groups']})")
    if block["retried"]:
        parts.append(f"{block['retried']} retried (not committed)")
    if block["heals"]:
        parts.append(f"{block['heals']} heal{'s' if block['heals'] > 1 else ''} from a live group "
                     f"({block['heal_s']:.2f} s)")
    parts.append(f"quorums {block['quorum_s']:.2f} s")
    return f"{block['groups']} replica groups: " + ", ".join(parts)


def change_line(change: dict[str, Any], groups: int) -> str:
    """A quorum change as the console says it."""
    missing = sorted(set(range(groups)) - set(change["groups"]))
    who = f"group{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} missing" if missing else "every group"
    return f"multigpu: step {change['step']}: quorum of {len(change['groups'])} of {groups} replica groups ({who})"
