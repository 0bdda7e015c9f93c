"""One way to spread a model: ``mg.parallelize`` takes the data-parallel step's options (DDP's, ZeRO-1, FSDP's)
and refuses the other strategy's in one line; what it returns trains as one process does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.testing import spawn

Layout = mg.parallel.Layout


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _train(model, opt, x, y, steps=3):
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in mg.full_state_dict(model).items()}


def _spread(dist) -> dict:
    """Each option set on 2 ranks: the strategy it gave, and the largest weight difference from one process
    trained on the whole batch (each rank takes its half)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)
    one = _net()
    ref = _train(one, torch.optim.SGD(one.parameters(), lr=0.1), x, y)
    mine = slice(4 * dist.rank, 4 * dist.rank + 4)
    out = {}
    for name, layout, options in [("ddp", Layout(dp_replicate=2), {"bucket_cap_mb": 1, "static_graph": True}),
                                  ("zero1", Layout(dp_replicate=2), {"zero1": True}),
                                  ("fsdp", Layout(dp_shard=2), {"min_block_params": 100, "reshard_after_forward": False})]:
        model = mg.parallelize(copy.deepcopy(_net()), layout, verbose=False, **options)
        opt = mg.optimizer(model, torch.optim.SGD, lr=0.1)
        got = _train(model, opt, x[mine], y[mine])
        units = len(mg.parallel.fsdp.fsdp_modules(model)) if name == "fsdp" else None
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref) if dist.rank == 0 else 0.0
        out[name] = {"strategy": mg.parallel.strategy_of(model, opt), "diff": diff, "units": units}
    return out


def test_ddp_zero1_and_fsdp_options_through_parallelize_train_as_one_process():
    out = spawn(_spread, 2, timeout=240)[0]
    assert {k: v["strategy"] for k, v in out.items()} == {"ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp"}
    assert out["fsdp"]["units"] == 3  # the two Linears of >= 100 parameters, then the root (min_block_params)
    for name, r in out.items():
        assert r["diff"] < 1e-12, (name, r["diff"])


@pytest.mark.parametrize("layout, options, line", [
    (Layout(dp_replicate=2), {"cpu_offload": True},
     "layout dp_replicate=2 (DDP) has no option cpu_offload: cpu_offload is FSDP's; shard (strategy 'fsdp', a "
     "Layout with dp_shard > 1) with cpu_offload=True"),
    (Layout(dp_shard=2), {"comm_hook": "bf16"},
     "layout dp_shard=2 (FSDP) has no option comm_hook: comm hooks are DDP's; FSDP already reduces in reduce_dtype"),
    (Layout(dp_shard=2), {"zero1": True}, "layout dp_shard=2 (FSDP) has no option zero1: ZeRO-1 shards the optimizer"),
    (Layout(dp_replicate=2), {"zero1": True, "comm_hook": "bf16"},
     "layout dp_replicate=2 (DDP with ZeRO-1) has no option comm_hook: comm hooks are registered on plain DDP"),
    (Layout(), {"bucket_size": 5}, "layout dp_shard=2 (FSDP) has no option bucket_size; its options are: block_classes"),
])
def test_the_other_strategys_option_is_refused_in_one_line_before_any_work(layout, options, line, monkeypatch):
    monkeypatch.setattr("multigpu.parallel.spread._world", lambda: (0, 2))
    net = _net()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(mg.UsageError) as err:
        mg.parallelize(net, layout, **options)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # the model is left as it was


def test_one_process_takes_any_option_and_has_nothing_to_do():
    net = _net()
    assert mg.parallelize(net, Layout(), comm_hook="bf16", cpu_offload=True, verbose=False) is net
    with pytest.raises(mg.UsageError, match="^mg.parallelize has no option bucket_size; the data-parallel options are"):
        mg.parallelize(net, Layout(), bucket_size=5)
