import math

import pytest
import torch

import multigpu as mg


def test_plan_derives_accumulation():
    plan = mg.BatchPlan(global_batch=512, world_size=4, micro_batch=64)
    assert (plan.micro_batch, plan.accum_steps, plan.rank_batch) == (64, 2, 128)
    assert plan.world_size * plan.micro_batch * plan.accum_steps == plan.global_batch


def test_plan_takes_whole_share_or_largest_divisor_under_cap():
    assert mg.BatchPlan(512, 4).micro_batch == 128
    plan = mg.BatchPlan(512, 4, max_micro_batch=50)
    assert (plan.micro_batch, plan.accum_steps) == (32, 4)
    plan = mg.BatchPlan(96, 4, max_micro_batch=7)  # share 24: divisors <= 7 -> 6
    assert (plan.micro_batch, plan.accum_steps) == (6, 4)


@pytest.mark.parametrize(
    "args, fragments",
    [
        ((96, 8, 8), ["96", "world_size 8 x micro_batch 8 = 64", "global_batch=64 or 128", "micro_batch=6"]),
        ((100, 3), ["does not split over world_size 3 (data-parallel ranks)", "99 or 102", "or 2 or 4 data-parallel ranks"]),
        ((0, 2), ["global_batch must be a positive integer"]),
        ((8, 2, 0), ["micro_batch must be a positive integer"]),
    ],
)
def test_impossible_plans_explain_the_equation_and_alternatives(args, fragments):
    with pytest.raises(mg.UsageError) as err:
        mg.BatchPlan(*args)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_scale_lr_rules():
    assert mg.scale_lr(0.1, base_batch=256, batch=8192) == pytest.approx(3.2)
    assert mg.scale_lr(1e-3, 128, 512, rule="sqrt") == pytest.approx(2e-3)
    assert mg.scale_lr(0.1, 128, 512, rule="none") == 0.1
    with pytest.raises(mg.UsageError, match="unknown LR scaling rule"):
        mg.scale_lr(0.1, 128, 512, rule="cubic")


def test_warmup_rises_linearly_from_start_lr_to_target():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.4)
    sched = mg.warmup(opt, steps=4, start_lr=0.1)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4])
    assert not math.isnan(lrs[0])


def test_summary_box_lists_plan_and_extras():
    box = mg.BatchPlan(128, 2, 32).summary(lr=0.2, strategy="ddp", precision=None)
    assert "global batch       : 128" in box and "accumulation       : 2" in box and "lr" in box
    assert "precision" not in box


def test_plan_shares_fitting_and_policies():
    plan = mg.BatchPlan(96, 2, dp_rank=1)
    assert plan.rank_slice(1) == slice(48, 96) and plan.rank_slice(0) == slice(0, 48)
    fitted = plan.fitting(20)  # share 48: the largest divisor <= 20 is 16, 3 accumulation steps
    assert (fitted.global_batch, fitted.micro_batch, fitted.accum_steps, fitted.dp_rank) == (96, 16, 3, 1)
    assert plan.fitting(1000).micro_batch == 48
    from multigpu.batch import policy_batch, same_samples_steps

    assert policy_batch("keep-global", 128, 8) == 128 and policy_batch("scale-global", 128, 8) == 1024
    assert policy_batch("scale-global", 128, 8, per_worker=32) == 256
    assert [same_samples_steps(s, 128, 1024) for s in (None, 0, 1, 10000, 10001)] == [None, 0, 1, 1250, 1251]
    with pytest.raises(mg.UsageError, match="unknown policy 'double'"):
        policy_batch("double", 128, 8)
