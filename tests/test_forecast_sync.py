"""The forecast of mg.accumulate's sync="each" (``Run.grad_sync``): FSDP reduce-scatters every micro-batch and so
holds its shard of the gradients between them, not every block's unsharded float32 one; DDP all-reduces every
micro-batch; a pipeline's schedule reduces in its last either way. tests/test_accumulate_sync.py runs the library."""

from __future__ import annotations

import dataclasses

import pytest

from multigpu.forecast import sync_note
from multigpu.forecast.cost import GiB, Assumptions, Run, predict
from multigpu.forecast.counts import count
from multigpu.forecast.hardware import cluster
from multigpu.forecast.models import config_builder
from multigpu.parallel.layout import Layout

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def counts():
    pytest.importorskip("transformers")
    return count(config_builder(TINY, "tiny"), 64)


def _both(counts, layout: Layout, machine=None, a=Assumptions()):
    machine = machine or cluster("h100", 8)
    return [predict(counts, machine, layout.resolve(8), Run(16, 64, grad_sync=s), a) for s in ("last", "each")]


def test_each_frees_the_unsharded_gradients_and_reduce_scatters_every_micro_batch(counts):
    last, each = _both(counts, Layout(dp_shard=8, micro_batch=1))  # 2 micro-batches a step
    # "each" holds what one micro-batch a step holds (a block's gradient in flight beside the float32 reduce-scatter
    # input), to the byte; "last" every parameter's unsharded float32 gradient besides, which tops that.
    one_step = predict(counts, cluster("h100", 8), Layout(dp_shard=8, micro_batch=1).resolve(8), Run(8, 64),
                       Assumptions())
    assert each["memory"] == one_step["memory"]
    freed = last["memory_bytes"] - each["memory_bytes"]
    assert 4.0 * counts.params - (2 + 4) * max(counts.block_params) < freed <= 4.0 * counts.params
    # The reduce-scatters: every block's and the root's, once more for the second micro-batch; the gathers as before.
    units = counts.layers + 1
    assert each["collectives"][8] - last["collectives"][8] == units
    assert each["time"]["data-parallel collectives (exposed)"] > last["time"]["data-parallel collectives (exposed)"]
    assert each["time"]["compute"] == last["time"]["compute"]


def test_hsdp_all_reduces_over_the_replicas_once_and_ddp_every_micro_batch(counts):
    last, each = _both(counts, Layout(dp_replicate=2, dp_shard=4, micro_batch=1))  # 2 micro-batches
    assert each["collectives"][2] == last["collectives"][2]  # the replicas' all-reduce: in the last micro-batch
    assert each["collectives"][4] - last["collectives"][4] == counts.layers + 1
    last, each = _both(counts, Layout(dp_replicate=8, micro_batch=1))
    assert each["collectives"][8] == 2 * last["collectives"][8] - 1  # the buckets twice; the norm's all-reduce once
    assert each["memory_bytes"] == last["memory_bytes"]  # DDP's gradients are whole either way
    last, each = _both(counts, Layout(dp_shard=4, pp=2, micro_batch=1))  # the schedule reduces in its last
    assert each == last


def test_the_forecast_says_what_reducing_each_micro_batch_would_free(counts):
    a = Assumptions(runtime_gib=0.0)  # the tiny model's own bytes, not the CUDA context's, decide what fits
    layout = Layout(dp_shard=8, micro_batch=1).resolve(8)
    last, each = _both(counts, layout, a=a)
    run = Run(16, 64)

    def ranked(hbm_gib: float) -> tuple:
        machine = cluster("h100", 8, hbm_gib=hbm_gib)
        return machine, [{"name": layout.label, "layout": layout, "recompute": "none",
                          **predict(counts, machine, layout, run, a)}]

    machine, only = ranked((last["memory_bytes"] + each["memory_bytes"]) / 2 / GiB)  # fits reducing each only
    assert not only[0]["fits"]
    note, = sync_note(counts, machine, run, a, only)
    assert note.startswith("1 more layout(s) fit reducing the gradients on each micro-batch, mg.accumulate(model, "
                           "micro_batches, sync='each')")
    assert note.endswith(f"the fastest: {layout.label}, {each['memory_bytes'] / GiB:.1f} GiB, "
                         f"{each['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
    assert sync_note(counts, machine, dataclasses.replace(run, grad_sync="each"), a, only) == []
    machine, only = ranked(last["memory_bytes"] * 1.01 / GiB)  # fits either way: "each" frees > 10 % of the GPU
    note, = sync_note(counts, machine, run, a, only)
    assert note.startswith(f"{layout.label} needs {each['memory_bytes'] / GiB:.1f} GiB instead of "
                           f"{last['memory_bytes'] / GiB:.1f} reducing the gradients on each micro-batch")
    machine, only = ranked(last["memory_bytes"] * 20 / GiB)  # what it frees is under 10 % of this GPU: nothing said
    assert sync_note(counts, machine, run, a, only) == []
