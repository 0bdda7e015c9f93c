"""DDP gradient-compression hooks on a real task: the digits recipe's data and MLP, 2 gloo ranks.

One spawn trains the same MLP four times (plain all-reduce, fp16 hook, bf16
hook, PowerSGD) from the same seed and data order and returns held-out
accuracy; compressed runs must stay within 1 point of the plain one.
"""

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.parallel.comm_hooks import compression
from multigpu.recipes.digits import digits_datasets, make_model
from multigpu.testing import spawn

EPOCHS, GLOBAL_BATCH = 20, 64  # the digits recipe's defaults


def _run(dist, **options):
    train, test = digits_datasets(seed=0)
    xt, yt = test.tensors
    torch.manual_seed(0)
    net = make_model()  # the digits recipe's data split and MLP (64-256-256-10)
    model = mg.wrap(net.to(dist.device), "ddp", **options)
    opt = mg.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)  # the recipe's lr at its base batch 64
    plan = mg.BatchPlan(GLOBAL_BATCH, dist.world_size)
    data = mg.loader(train, plan, dist, seed=0)
    for _ in range(EPOCHS):
        for micro_batches in data:
            for x, y in mg.accumulate(model, micro_batches):
                (nn.functional.cross_entropy(model(x), y) / plan.accum_steps).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        accuracy = (mg.unwrap(model)(xt).argmax(1) == yt).float().mean().item()
    return accuracy, compression(model), plan.steps_per_epoch(len(train)) * EPOCHS


def _all_hooks(dist):
    return {
        "fp32": _run(dist),
        "fp16": _run(dist, comm_hook="fp16"),
        "bf16": _run(dist, comm_hook="bf16"),
        # Small buckets: several PowerSGD buckets per step, whose all-reduces
        # must stay in the same order on every rank (see multigpu/parallel/comm_hooks.py).
        "powersgd": _run(dist, comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=10, bucket_cap_mb=0.01),
    }


def test_compress_hooks_converge_within_one_point_and_report_compression():
    results = spawn(_all_hooks, 2)
    ranks = [{k: v[0] for k, v in r.items()} for r in results]
    assert ranks[0] == ranks[1]  # replicas stay identical under every hook
    acc = ranks[0]
    print(f"\ndigits, 2 ranks, {EPOCHS} epochs: accuracy {acc}; powersgd {results[0]['powersgd'][1]}")
    assert acc["fp32"] > 0.95  # the baseline has converged, so a 1-point gap means something
    for hook in ("fp16", "bf16"):
        assert abs(acc[hook] - acc["fp32"]) <= 0.01, (hook, acc)
        assert results[0][hook][1].ratio == 2.0  # fp32 gradients sent as 16 bits
    assert results[0]["fp32"][1] is None
    psgd = results[0]["powersgd"][1]
    steps = results[0]["powersgd"][2]
    # Rank-2 factors of the 256x64, 256x256 and 10x256 weights; biases (n x 1) uncompressed.
    per_step_before = 256 * 64 + 256 + 256 * 256 + 256 + 10 * 256 + 10
    per_step_after = (256 + 64) * 2 + 256 + (256 + 256) * 2 + 256 + (10 + 256) * 2 + 10
    assert psgd.before == per_step_before * (steps - 10)  # plain all-reduce for the first 10 steps
    assert psgd.after == per_step_after * (steps - 10)
    assert psgd.ratio == pytest.approx(per_step_before / per_step_after)
    assert acc["powersgd"] > 0.9, acc  # low-rank gradients still train (gap to fp32 reported above)


def test_hook_options_are_checked():
    net = nn.Linear(2, 2)
    with pytest.raises(mg.UsageError, match="unknown comm_hook 'int8'; expected one of fp16, bf16, powersgd"):
        mg.wrap(net, "ddp", comm_hook="int8")
    with pytest.raises(mg.UsageError, match="apply to comm_hook='powersgd' but comm_hook is 'fp16'"):
        mg.wrap(net, "ddp", comm_hook="fp16", powersgd_rank=2)
    with pytest.raises(mg.UsageError, match="powersgd_start_iter must be an int >= 2, got 1"):
        mg.wrap(net, "ddp", comm_hook="powersgd", powersgd_start_iter=1)
    with pytest.raises(mg.UsageError, match="strategy 'zero1' has no option comm_hook: comm hooks are registered"):
        mg.wrap(net, "zero1", comm_hook="fp16")
