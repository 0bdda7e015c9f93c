"""The forecast's pipeline ranks hold the stages ``mg.parallel.pipeline`` builds: the library's own split
(``stages.stage_ranges``, the embeddings and the head a block each) and placement (``pp.stage_ids``); the step
waits for the busiest rank (the head's FLOPs on the rank of the last stage only) and memory is the fullest rank's."""

from __future__ import annotations

import pytest

from multigpu.forecast.cost import Assumptions, Run, compute_parts, predict, rank_forecast
from multigpu.forecast.counts import count
from multigpu.forecast.hardware import cluster
from multigpu.forecast.inputs import Rank
from multigpu.forecast.memory import memory_parts
from multigpu.forecast.models import config_builder
from multigpu.parallel.layout import Layout
from multigpu.parallel.pp import stage_ids
from multigpu.parallel.stages import stage_ranges

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 300, "tie_word_embeddings": False}


def _counts(layers: int, vocab: int = 300):
    pytest.importorskip("transformers")
    config = TINY | {"num_hidden_layers": layers, "vocab_size": vocab}
    return count(config_builder(config, f"tiny-{layers}-{vocab}"), 64)


@pytest.mark.parametrize("layers, pp, schedule", [(4, 3, "1f1b"), (8, 2, "1f1b"), (8, 2, "interleaved_1f1b"),
                                                  (9, 2, "interleaved_1f1b"), (8, 2, "zbv"), (6, 3, "gpipe")])
def test_each_rank_holds_the_stages_the_library_builds(layers, pp, schedule):
    """A Layout gives every rank the library's stages, the table with stage 0, the head with the last: 4 blocks on
    3 stages are 1, 2, 1 (the ends take a block less), not 2 a stage."""
    c = _counts(layers)
    run = Run(8, 64)
    layout = Layout(dp_shard=1, pp=pp, micro_batch=1, schedule=schedule)
    ranges = stage_ranges(layers, layout.stages)
    held = []
    for k in range(pp):
        r = Rank(c, layout, run, pp_rank=k)
        ids = stage_ids(schedule, k, pp, layout.stages // pp)
        assert r.blocks == [i for s in ids for i in ranges[s]]
        assert (r.holds_first, r.holds_last) == (0 in ids, layout.stages - 1 in ids)
        assert (r.first > 0, r.last > 0) == (r.holds_first, r.holds_last)
        assert r.root == r.first + r.last
        held += r.blocks
    assert sorted(held) == list(range(layers))  # every block on one rank
    if (layers, pp) == (4, 3):
        assert [len(Rank(c, layout, run, k).blocks) for k in range(pp)] == [1, 2, 1]
    if schedule == "zbv":  # V placement: rank 0 holds the first and the last stage, both ends
        r = Rank(c, layout, run, 0)
        assert r.holds_first and r.holds_last
    one = Rank(c, Layout(dp_shard=1, micro_batch=1), run)  # no pipeline: one rank, everything
    assert one.blocks == list(range(layers)) and one.holds_first and one.holds_last


def test_the_head_runs_on_the_last_stage_only_and_a_large_vocabulary_makes_it_the_slowest():
    """4 blocks on 2 ranks (2 each): the ranks differ by the head's FLOPs alone, on the rank of the last stage; with a
    vocabulary of 64k the step waits for that rank, its bubble at its micro-batch time."""
    c = _counts(4, vocab=65536)
    machine, a, run = cluster("h100", 2), Assumptions(), Run(8, 64)
    layout = Layout(dp_shard=1, pp=2, micro_batch=1)
    first, last = (Rank(c, layout, run, k) for k in range(2))
    assert len(first.blocks) == len(last.blocks) == 2 and not first.holds_last and last.holds_last
    (t0, micro0, _, rate), (t1, micro1, _, _) = (compute_parts(r, machine, a) for r in (first, last))
    m, head = first.m, 3 * c.other_flops * first.tokens  # the head's training FLOPs a micro-batch (tp 1)
    assert c.other_flops > sum(c.block_flops)  # the head costs more than the blocks
    assert t1["compute"] - t0["compute"] == pytest.approx(m * head / rate, rel=1e-9)
    assert t1["pipeline bubble"] == pytest.approx(micro1, rel=1e-12) and micro1 > micro0  # (p - 1) / v = 1
    got = predict(c, machine, layout, run, a)
    ranks = [rank_forecast(r, machine, a, None) for r in (first, last)]
    assert got["slowest_rank"] == 1 and got["step_s"] == ranks[1]["step_s"] > ranks[0]["step_s"]
    assert got["time"] == ranks[1]["time"]


def test_interleaving_places_two_stages_a_rank_and_shortens_the_bubble():
    """8 blocks, 2 ranks: 1F1B gives each rank a stage (4 blocks each); interleaved, 4 stages of 1, 3, 3, 1
    blocks placed in a loop (rank 0: stages 0 and 2, the table; rank 1: 1 and 3, the head), 4 blocks a rank
    still, and a bubble of (p - 1) / v micro-batches of the slowest rank's."""
    c = _counts(8)
    machine, a, run = cluster("h100", 2), Assumptions(), Run(8, 64)
    one_f = Layout(dp_shard=1, pp=2, micro_batch=1)
    inter = Layout(dp_shard=1, pp=2, micro_batch=1, schedule="interleaved_1f1b")
    assert [Rank(c, one_f, run, k).blocks for k in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [Rank(c, inter, run, k).blocks for k in range(2)] == [[0, 4, 5, 6], [1, 2, 3, 7]]
    for layout, v in ((one_f, 1), (inter, 2)):
        got = predict(c, machine, layout, run, a)
        assert got["slowest_rank"] == 1  # the head's
        micro = got["time"]["compute"] / Rank(c, layout, run, 1).m
        assert got["time"]["pipeline bubble"] == pytest.approx(micro / v, rel=1e-12)


def test_memory_is_the_fullest_ranks():
    """Memory is the largest of the ranks' totals, each its own blocks and ends: with a 64k vocabulary the rank of
    the head (its weights, the logits and the loss's bytes) is the fullest; with a small one and 8 micro-batches
    rank 0 is (1F1B: 2 micro-batches in flight there, 1 on the last). No rank holds the table and the head."""
    machine, a = cluster("h100", 2), Assumptions()
    layout, run = Layout(dp_shard=1, pp=2, micro_batch=1), Run(8, 64)
    for vocab, fullest in ((65536, 1), (300, 0)):
        c = _counts(4, vocab)
        ranks = [Rank(c, layout, run, k) for k in range(2)]
        totals = [sum(memory_parts(r, a).values()) for r in ranks]
        got = predict(c, machine, layout, run, a)
        assert got["fullest_rank"] == fullest and got["memory_bytes"] == max(totals) == totals[fullest]
        assert got["memory"] == memory_parts(ranks[fullest], a)
        for r in ranks:  # the states of its own parameters: the table or the head, never both
            ends = (c.embed_params if r.holds_first else 0) + (c.head_params + c.other_params if r.holds_last else 0)
            assert r.held == pytest.approx(sum(r.dense_of(i) for i in r.blocks) + ends)
    c = _counts(4, 300)
    acts = [memory_parts(Rank(c, layout, run, k), Assumptions(allocator_overhead=0.0))["activations"] for k in range(2)]
    assert acts[0] > acts[1]  # rank 0 holds p = 2 micro-batches in flight, the last 1 (and the loss)
