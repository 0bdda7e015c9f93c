"""The summary's samples/s names the steps it covers, and the step records alone give the same figure."""

from __future__ import annotations

import json
import time

import pytest
import torch

import multigpu as mg
from multigpu.meter import StepMeter
from multigpu.meter.records import summary_line


def _run(tmp_path, profile=None):
    """A real meter on one rank: 40 tiny steps, log_every 5, two evaluations in meter.pause()."""
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [torch.randn(8, 16) for _ in range(40)]
    plan = mg.BatchPlan(global_batch=8, world_size=1)
    with StepMeter(None, plan, log_every=5, log_dir=str(tmp_path), model=model, progress=False, watchdog=None,
                   gpu_monitor=False, profile=profile) as meter:
        for step, x in meter.steps(data):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            meter.step_end(loss=loss)
            if step in (12, 27):  # mid-interval, and in the intervals the summary counts
                with meter.pause("eval"):
                    time.sleep(0.05)
                meter.log_eval(accuracy=0.5)
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    return [r for r in recs if r["type"] == "step"], recs[-1]


def _recomputed(steps, summary):
    """Total samples / total time over the step records the summary names, from samples_seen, time, paused_s."""
    first, last = summary["rate_steps"]
    out = {s for o in summary["measured"]["left_out"] for s in range(o["steps"][0], o["steps"][1] + 1)}
    samples = seconds = 0.0
    for prev, r in zip(steps, steps[1:]):
        if first <= r["step"] - r["steps"] + 1 and r["step"] <= last and r["step"] not in out:
            samples += r["samples_seen"] - prev["samples_seen"]
            seconds += r["time"] - prev["time"] - r["paused_s"]
    return samples / seconds


def test_the_rate_covers_the_steps_it_names_and_the_records_mark_warm_up(tmp_path):
    steps, summary = _run(tmp_path)
    assert [r["step"] for r in steps] == [4, 9, 14, 19, 24, 29, 34, 39]
    # The warm-up interval is marked in the records and named in the summary; the rest is counted.
    assert [r.get("warmup", False) for r in steps] == [True] + [False] * 7
    m = summary["measured"]
    assert summary["rate_steps"] == [5, 39] and (m["from_step"], m["to_step"], m["steps"]) == (5, 39, 35)
    assert m["warmup_steps"] == [0, 4] and m["left_out"] == [{"steps": [0, 4], "why": "warm-up"}]
    # Evaluation time is in the records' `time` and their paused_s; the rate takes it out.
    assert m["paused_s"] == pytest.approx(sum(r["paused_s"] for r in steps[1:])) and m["paused_s"] >= 0.1
    # Over the steps it names, the records' own clock gives the summary's figure (well within 2 %): one
    # contiguous span here, so the last record less the warm-up's, less the pauses in between.
    span = (steps[-1]["samples_seen"] - steps[0]["samples_seen"]) / (steps[-1]["time"] - steps[0]["time"] - m["paused_s"])
    assert summary["samples_per_s"] == pytest.approx(span, rel=1e-9)
    assert summary["samples_per_s"] == pytest.approx(_recomputed(steps, summary), rel=1e-9)
    assert summary["samples_per_s"] == pytest.approx(m["samples"] / m["time_s"], rel=1e-9)
    # Leaving the pauses in reads low: the reason they are in the records.
    naive = (steps[-1]["samples_seen"] - steps[0]["samples_seen"]) / (steps[-1]["time"] - steps[0]["time"])
    assert naive < 0.98 * summary["samples_per_s"]
    line = summary_line(summary)
    assert "steps 5-39 (warm-up 0-4 left out)" in line


def test_profiled_intervals_inside_the_span_are_named_and_left_out_with_their_time(tmp_path):
    steps, summary = _run(tmp_path, profile=(17, 19))  # the profiler's warm-up step 16, profiled 17-18
    profiled = [r["step"] for r in steps if r.get("profiled")]
    assert profiled == [19] and steps[0].get("warmup") is True
    m = summary["measured"]
    assert summary["rate_steps"] == [5, 39] and m["steps"] == 30 and m["intervals"] == 6
    assert m["left_out"] == [{"steps": [0, 4], "why": "warm-up"}, {"steps": [15, 19], "why": "profiled"}]
    assert summary["samples_per_s"] == pytest.approx(_recomputed(steps, summary), rel=1e-9)
    assert "(warm-up 0-4, profiled 15-19 left out)" in summary_line(summary)


def test_the_time_shares_sum_to_one_when_the_ranks_compute_past_rank_0s_measured_time():
    """A rank that leaves an evaluation first waits for the other in its next step's collectives and counts
    that as compute: the ranks' mean wait and compute can pass rank 0's time less its pauses (seen: 1.012)."""
    from multigpu.meter.records import _fractions

    assert _fractions(0.1, 0.5, 1.0) == {"data_wait": 0.1, "compute": 0.5, "other": 0.4}
    over = _fractions(0.2, 0.85, 1.0)
    assert sum(over.values()) == pytest.approx(1.0, abs=1e-12) and over["other"] == 0.0
    assert over["compute"] / over["data_wait"] == pytest.approx(0.85 / 0.2)
