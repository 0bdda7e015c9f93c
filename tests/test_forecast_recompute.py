"""Recompute of the first k blocks of each stage (``Layout.checkpoint_blocks``, Megatron's ``--recompute-method
block``) as forecast: the recomputed blocks run their forward again and keep only their input, the others keep what
they save; k as large as a stage is full recompute to the bit, and k between lies strictly between none and full."""

from __future__ import annotations

import dataclasses

import pytest

from multigpu.forecast.cost import Assumptions, Run, predict
from multigpu.forecast.counts import count
from multigpu.forecast.hardware import cluster
from multigpu.forecast.inputs import Rank
from multigpu.forecast.memory import activation_phases
from multigpu.forecast.models import config_builder
from multigpu.forecast.plan import plan
from multigpu.parallel.flags import parse_layouts
from multigpu.parallel.layout import Layout
from multigpu.parallel.pp import stage_ids
from multigpu.parallel.stages import stage_ranges

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 300, "tie_word_embeddings": False}
H100 = cluster("h100", 8, 8)


@pytest.fixture(scope="module")
def counts():
    pytest.importorskip("transformers")
    return count(config_builder(TINY, "tiny-4"), 64)


def _ac(layout: Layout, k: int | None) -> Layout:
    return dataclasses.replace(layout, activation_checkpointing=True, checkpoint_blocks=k)


@pytest.mark.parametrize("layout", [Layout(dp_shard=8, micro_batch=1), Layout(dp_shard=2, tp=4, micro_batch=1,
                                    sequence_parallel=True), Layout(dp_shard=4, pp=2, micro_batch=1)])
def test_as_many_blocks_as_a_stage_holds_is_full_recompute_to_the_bit(counts, layout):
    run = Run(64, 64, "full", logits_held=True)
    full = predict(counts, H100, _ac(layout, None), run, Assumptions())
    for k in (counts.layers, 9):  # a stage of fewer blocks than k checkpoints them all
        assert predict(counts, H100, _ac(layout, k), run, Assumptions()) == full


def test_some_blocks_lie_strictly_between_none_and_full(counts):
    """2 of 4 equal blocks: their recomputed forwards are half of full recompute's; memory and time strictly between."""
    base, a = Layout(dp_shard=8, micro_batch=1), Assumptions()
    none = predict(counts, H100, base, Run(64, 64, "none"), a)
    full, half = (predict(counts, H100, _ac(base, k), Run(64, 64, "full"), a) for k in (None, 2))
    assert none["memory_bytes"] > half["memory_bytes"] > full["memory_bytes"]
    assert none["step_s"] < half["step_s"] < full["step_s"]
    extra = full["time"]["compute"] - none["time"]["compute"]
    assert half["time"]["compute"] - none["time"]["compute"] == pytest.approx(extra / 2, rel=1e-12)


def test_a_checkpointed_block_keeps_its_input_and_a_kept_block_what_it_saves(counts):
    """Per micro-batch in flight: the first k blocks their input, the others all they saved (one tp rank, so no
    cut); a recomputed block's backward holds its activations again, the kept blocks after it freed by then."""
    layout, run = Layout(dp_shard=8, micro_batch=1), Run(64, 64, "full")
    c, L = counts, counts.layers
    for k in range(1, L + 1):
        r = Rank(c, _ac(layout, k), run)
        assert r.recomputed == list(range(k))
        stage_bytes, _, transient, _, _ = activation_phases(r)
        kept = sum(c.block_input for _ in range(k)) + sum(c.block_saved[i] for i in range(k, L))
        assert stage_bytes == pytest.approx(kept * r.tokens, rel=1e-12)
        freed = sum(c.block_saved[i] for i in range(k, L))
        top = max([c.block_saved[i] + c.block_backward[i] - freed for i in range(k)]
                  + [c.block_backward[i] for i in range(k, L)])
        assert transient == pytest.approx(top * r.tokens, rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_each_stage_recomputes_its_own_first_blocks(counts, schedule):
    layout = _ac(Layout(dp_shard=4, pp=2, micro_batch=1, schedule=schedule), 1)
    ranges = stage_ranges(counts.layers, layout.stages)
    for k in range(2):
        r = Rank(counts, layout, Run(64, 64, "full"), pp_rank=k)
        assert r.recomputed == [ranges[s][0] for s in stage_ids(schedule, k, 2, layout.stages // 2)]


def test_a_named_layout_with_checkpoint_blocks_is_forecast_so(counts):
    named = parse_layouts("dp_shard=8,activation_checkpointing=true,checkpoint_blocks=2", "--layout")
    ranked, _ = plan(counts, H100, Run(64, 64), Assumptions(), micro_batches=(1,), named=named)
    assert [(f["name"], f["recompute"], f["layout"].checkpoint_blocks) for f in ranked] == \
        [("FSDP 8, micro-batch 1, AC of 2 blocks a stage", "full", 2)]
    assert "--checkpoint-blocks" in ranked[0]["layout"].flags
