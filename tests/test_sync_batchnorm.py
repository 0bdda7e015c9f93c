"""SyncBatchNorm on gloo ranks equals BatchNorm in one process on the global batch."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.parallel.batchnorm import GlooSyncBatchNorm
from multigpu.data import global_order
from multigpu.testing import spawn

GLOBAL_BATCH, STEPS, N = 16, 3, 64


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(7)
    # Per-sample offsets make rank-local statistics visibly differ from global ones.
    x = torch.randn(N, 2, 5, 5, generator=g) + torch.linspace(-2, 2, N).view(N, 1, 1, 1)
    return TensorDataset(x, torch.randint(0, 3, (N,), generator=g))


def _state(model):
    return {k: v.detach().clone() for k, v in mg.full_state_dict(model, cpu=False).items()}


def _reference():
    ds, model = _data(), _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = global_order(N, seed=0, epoch=0)
    for s in range(STEPS):
        x, y = ds[order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(dist, strategy, **options):
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mg.wrap(_net(), strategy, **options)
        opt = mg.optimizer(model, torch.optim.SGD, lr=0.1)
        for step, micro_batches in enumerate(mg.loader(_data(), plan, dist, seed=0)):
            if step == STEPS:
                break
            for x, y in mg.accumulate(model, micro_batches):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    kinds = sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})
    return _state(model), [str(w.message) for w in caught if "BatchNorm" in str(w.message)], kinds


def _variants(dist):
    return {
        "ddp-sync": _train(dist, "ddp", sync_batchnorm=True),
        "fsdp-sync": _train(dist, "fsdp", sync_batchnorm=True, min_block_params=50),
        "ddp-local": _train(dist, "ddp"),
    }


# 4 ranks only: 2 ranks is the same code with an even split (suite time; 4 covers uneven shards too).
@pytest.mark.parametrize("world", [4])
def test_sync_batchnorm_statistics_equal_one_process_on_the_global_batch(world):
    ref = _reference()
    for rank, res in enumerate(spawn(_variants, world)):
        for name in ("ddp-sync", "fsdp-sync"):
            state, warned, kinds = res[name]
            assert kinds == [GlooSyncBatchNorm.__name__] and warned == []
            assert list(state) == list(ref)
            for key in ref:  # running_mean/var, num_batches_tracked, and the weights they trained
                torch.testing.assert_close(state[key], ref[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} world {world} rank {rank} {key}: {m}")
        # Without sync, each rank normalises by its own statistics: the running
        # statistics differ from the global ones, and the user is told why.
        state, warned, kinds = res["ddp-local"]
        assert kinds == ["BatchNorm1d", "BatchNorm2d"]
        assert not torch.allclose(state["1.running_mean"], ref["1.running_mean"], atol=1e-3)
        per_rank = GLOBAL_BATCH // world
        assert len(warned) == 1 and f"per-rank micro-batch of {per_rank} (< 16)" in warned[0]
        assert "mg.wrap(model, 'ddp', sync_batchnorm=True)" in warned[0]


def test_gloo_sync_batchnorm_in_one_process_is_plain_batchnorm():
    """Eval mode and single-process training fall back to BatchNorm exactly."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    sync = GlooSyncBatchNorm(3)
    x = torch.randn(6, 3, 4, 4)
    for train in (True, False):
        bn.train(train), sync.train(train)
        torch.testing.assert_close(sync(x), bn(x))
    torch.testing.assert_close(sync.running_var, bn.running_var)


def _bf16_shares(dist):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4) * 3 + 1
    sync = GlooSyncBatchNorm(3)
    with torch.autocast("cpu", torch.bfloat16):
        out = sync(x.bfloat16().chunk(dist.world_size)[dist.rank])
    return out, sync.running_mean.clone(), sync.running_var.clone()


def test_gloo_sync_batchnorm_under_bf16_autocast_keeps_fp32_statistics():
    """A bf16 input (autocast's conv output): statistics in fp32 as nn.BatchNorm's, the output in bf16; it
    raised in lerp_ (a bf16 mean into the fp32 running buffers), and its bf16 count rounded to 8 bits."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4) * 3 + 1
    bn = nn.BatchNorm2d(3)
    with torch.autocast("cpu", torch.bfloat16):
        ref = bn(x.bfloat16())
    for rank, (out, mean, var) in enumerate(spawn(_bf16_shares, 2)):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.chunk(2)[rank].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(mean, bn.running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(var, bn.running_var, rtol=1e-6, atol=1e-7)
