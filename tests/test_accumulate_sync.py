"""mg.accumulate(sync="each"): FSDP reduce-scatters every micro-batch, so between micro-batches a rank holds its
shard of the gradients, not every block's unsharded one; the sums are the same as one process's, in float64.

One spawn of 4 gloo ranks trains FSDP 4 (mg.wrap) and HSDP 2 x 2 (mg.parallelize) with 2 micro-batches a rank
under sync "each" and "last", and DDP under "each"; each is compared with one process on the whole batch."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.data import global_order
from multigpu.testing import spawn
from test_fsdp import Block  # test_fsdp.py's residual block, here in float64

GLOBAL_BATCH, STEPS, N, LR = 16, 3, 64, 0.01


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), Block(32), Block(32), nn.Linear(32, 4)).double()


def _data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 12, generator=g, dtype=torch.float64)
    return TensorDataset(x, x[:, :4].argmax(1))


def _reference():
    ds, model = _data(), _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    order = global_order(N, seed=0, epoch=0)
    for s in range(STEPS):
        x, y = ds[order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reduced(model) -> int:
    """How many of the model's gradients a reduction has reached: FSDP's sharded .grad (set once a reduce-scatter
    has run; DDP's whole ones are set either way) or, under HSDP waiting for its all-reduce, the shard of the sum
    FSDP2 keeps per unit until it (its own field: the only place it is)."""
    from multigpu.parallel.fsdp import fsdp_modules

    waiting = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_modules(model)]
    return (sum(p.grad is not None for p in model.parameters())
            + sum(len(g.fsdp_params) for g in waiting if g is not None and g._partial_reduce_output is not None))


def _train(dist, how: str, sync: str):
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size if how != "hsdp" else 4, micro_batch=2)
    if how == "hsdp":
        model = mg.parallelize(_net(), mg.parallel.Layout(dp_replicate=2, dp_shard=2, micro_batch=2))
    else:
        model = mg.wrap(_net(), how, **({"block_classes": [Block]} if how == "fsdp" else {}))
    opt = mg.optimizer(model, torch.optim.AdamW, lr=LR)
    between = []  # gradients set after the first micro-batch's backward of each step
    for step, micro_batches in enumerate(mg.loader(_data(), plan, dist, seed=0)):
        if step == STEPS:
            break
        for i, (x, y) in enumerate(mg.accumulate(model, micro_batches, sync=sync)):
            (nn.functional.cross_entropy(model(x), y) / plan.accum_steps).backward()
            if i == 0:
                between.append(_reduced(model))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in mg.full_state_dict(model, cpu=False).items()}, plan.accum_steps, between


def _every_way(dist):
    out = {(how, sync): _train(dist, how, sync) for how, sync in
           (("fsdp", "each"), ("fsdp", "last"), ("hsdp", "each"), ("hsdp", "last"), ("ddp", "each"))}
    model = mg.wrap(_net(), "ddp")
    mg.NoiseScale(mg.BatchPlan(GLOBAL_BATCH, dist.world_size, micro_batch=2)).attach(model)
    try:
        list(mg.accumulate(model, [1, 2], sync="each"))
    except mg.UsageError as err:
        out["noise"] = str(err)
    return out


def test_sync_each_reduces_every_micro_batch_and_equals_one_process_in_float64():
    want = _reference()
    params = len(want)
    for rank, res in enumerate(spawn(_every_way, 4)):
        # The noise scale reads a rank's gradient accumulated over its micro-batches: "each" would feed it others.
        assert "NoiseScale reads each rank's gradient accumulated" in res.pop("noise")
        for (how, sync), (got, accum, between) in res.items():
            assert accum == 2, (how, accum)
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-9, f"{how} sync={sync} rank {rank}: max |param diff| {worst:.2e}"
            # Between micro-batches "each" has reduced every gradient already (FSDP: a rank holds shards, HSDP the
            # shard of the sum before its all-reduce); "last" none (FSDP holds the unsharded gradients aside).
            assert between == [params if sync == "each" else 0] * STEPS, (how, sync, between)


def test_sync_is_last_or_each():
    with pytest.raises(mg.UsageError, match="sync= is 'last' .* or 'each' .*, got 'every'"):
        list(mg.accumulate(nn.Linear(2, 2), [1, 2], sync="every"))
