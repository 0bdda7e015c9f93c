"""Evaluation is exact on every layout: 101 held-out sequences give one process's figures under TP, SP, FSDP,
FSDP x TP, HSDP and pipelines, each data-parallel rank counted once (``tests/_eval_layouts.py``).

The README's pattern (``mg.eval_loader``, per-rank sums, ``mg.all_reduce_sum``) on tiny language models in
float64: the correct-token and row counts must equal one process's exactly, the summed loss within 1e-9
relative (another summation order moves it ~1e-15). Before the fix TP 2 counted every sample twice with
``mesh=`` (202 rows) and aborted without it; FSDP 2 in batches of 10 gave the ranks 5 and 6 batches (the
one with more waited forever in FSDP's all-gather).
"""

import functools

import pytest

import multigpu as mg
from multigpu.testing import spawn

import _eval_layouts as ev

TP = {"tp": 2}
# The model mg.parallelize returned (layout=model), the Layout, nothing (the layout this process spread a
# model by); FSDP in batches of 10 (101 rows: 50 and 51 per rank); the plan's summary under TP.
OWN_TWO = [("eval", TP, "model"), ("eval", TP, "layout"), ("eval", TP, "none"),
           ("eval", {"dp_shard": 2}, "none", ev.ROWS, 10), ("summary", TP)]
LLAMA_TWO = [("eval", {"tp": 2, "sequence_parallel": True}, "model"),
             ("pipeline", {"pp": 2, "schedule": "gpipe"}, 96), ("pipeline", {"pp": 2, "schedule": "interleaved_1f1b"}, 96),
             ("pipeline", {"pp": 2}, ev.ROWS)]
# FSDP 2 x TP 2, HSDP 2 x 2 in batches of 5 (25 or 26 rows per rank), HSDP 2 x TP 2, PP 2 x TP 2.
LLAMA_FOUR = [("eval", TP, "layout"), ("eval", {"dp_replicate": 2}, "none", ev.ROWS, 5),
              ("eval", {"tp": 2, "dp_replicate": 2, "dp_shard": 1}, "model"), ("pipeline", {"pp": 2, "tp": 2}, 96)]


@functools.lru_cache
def _reference(kind):
    """One process: the sums over 101 rows and over 96."""
    return spawn(ev.cases, 1, kind, [("eval", {}, "none"), ("eval", {}, "none", 96)])[0]


def _run(kind, world, todo, timeout=300):
    """Per case, every rank's result; each total checked against one process's."""
    full, rows96 = _reference(kind)
    assert full["count"] == ev.ROWS and rows96["count"] == 96
    out = spawn(ev.cases, world, kind, todo, timeout=timeout)
    results = [[rank[i] for rank in out] for i in range(len(todo))]
    for case, per_rank in zip(todo, results):
        if case[0] == "summary" or isinstance(per_rank[0], str):
            continue
        assert all(r == per_rank[0] for r in per_rank), f"{case}: the ranks got different totals {per_rank}"
        got, ref = per_rank[0], rows96 if case[0] == "pipeline" else full
        assert got["count"] == ref["count"], f"{case}: {got['count']} rows counted, one process {ref['count']}"
        if "correct" in got:
            assert got["correct"] == ref["correct"], f"{case}: {got['correct']} correct, one process {ref['correct']}"
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-9), case
    return results


def test_tensor_parallel_and_fsdp_evaluation_count_each_data_parallel_rank_once():
    results = _run("own", 2, OWN_TWO)
    summary = results[-1][0]
    assert "world size            : 2" in summary and "data-parallel size    : 1 (2 processes each)" in summary, summary


@pytest.mark.slow
def test_sequence_parallel_and_pipeline_evaluation_count_each_data_parallel_rank_once():
    results = _run("llama", 2, LLAMA_TWO)
    refusal = results[-1]
    assert len(set(refusal)) == 1, refusal  # every rank refuses alike
    assert refusal[0] == (
        "mg.eval_loader under layout pp=2,micro_batch=8: a pipeline's stages exchange batches of one shape, so every evaluation batch "
        "must hold batch_size=8 rows, but 101 rows over 1 data-parallel rank leave 5 over; evaluate the first 96 "
        "rows (torch.utils.data.Subset(dataset, range(96))), or batch_size=1")


@pytest.mark.slow
def test_four_rank_layouts_count_each_data_parallel_rank_once():
    _run("llama", 4, LLAMA_FOUR, timeout=400)


def test_who_counts_follows_the_layout_and_the_schedule_places_the_last_stage():
    def counting(layout, world):
        shares = [layout.data_share(r, world) for r in range(world)]
        return [s.dp_rank for s in shares], [r for r, s in enumerate(shares) if s.counts]

    Layout = mg.parallel.Layout
    assert counting(Layout(tp=2), 4) == ([0, 0, 1, 1], [0, 2])                    # FSDP 2 x TP 2
    assert counting(Layout(dp_replicate=2), 4) == ([0, 1, 2, 3], [0, 1, 2, 3])      # HSDP 2 x 2
    assert counting(Layout(pp=2, tp=2), 4) == ([0, 0, 0, 0], [2])                   # the last stage on pp rank 1
    assert counting(Layout(pp=2, schedule="zbv"), 2) == ([0, 0], [0])               # V placement: on pp rank 0
    assert counting(Layout(pp=2, dp_shard=2, schedule="interleaved_1f1b"), 4) == ([0, 1, 0, 1], [2, 3])
