"""mg.find_micro_batch: doubling then bisection, one agreed verdict per trial, global batch kept."""

from __future__ import annotations

import json

import pytest
import torch

import multigpu as mg
from multigpu.testing import spawn

MIB = 1 << 20


def _alloc_step(per_sample_mib=4, oom_from=None):
    """A trial that touches ``per_sample_mib`` MiB per sample (and can raise the CUDA OOM type)."""

    def step(m):
        if oom_from is not None and m >= oom_from:
            raise torch.OutOfMemoryError(f"simulated: {m} samples")
        t = torch.empty(m, per_sample_mib * MIB // 4)
        t.fill_(1.0)  # touch every page: resident, not just reserved
        return float(t[-1, -1])

    return step


def test_cpu_budget_doubling_then_bisection_keeps_global_batch():
    found = mg.find_micro_batch(_alloc_step(), start=1, memory_budget=4 * 37 * MIB + 2 * MIB, plan=mg.BatchPlan(128, 1))
    assert found.micro_batch == 37
    assert [m for m, _, _ in found.trials] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [ok for _, ok, _ in found.trials] == [True] * 6 + [False, False, False, True, False, True]
    # Measured peaks are real: about 4 MiB per sample.
    peaks = {m: p for m, _, p in found.trials}
    assert abs(peaks[32] - 4 * 32 * MIB) < 2 * MIB, peaks
    assert found.plan == mg.BatchPlan(128, 1, micro_batch=32) and found.plan.accum_steps == 4
    assert "largest micro-batch that fits: 37" in found.summary()


def test_cap_and_usage_errors():
    found = mg.find_micro_batch(_alloc_step(1), max_micro_batch=20, memory_budget=1 << 40)
    assert found.micro_batch == 20 and [m for m, _, _ in found.trials] == [1, 2, 4, 8, 16, 20]
    with pytest.raises(mg.UsageError, match="memory_budget"):
        mg.find_micro_batch(_alloc_step())
    with pytest.raises(mg.UsageError, match="micro-batch 8 does not fit"):
        mg.find_micro_batch(_alloc_step(), start=8, memory_budget=4 * MIB)
    with pytest.raises(mg.UsageError, match="positive integer"):
        mg.find_micro_batch(_alloc_step(), start=0, memory_budget=4 * MIB)


def _mlp_step(dist, model, m):
    def step(micro):
        model.zero_grad(set_to_none=True)
        x = torch.randn(micro, 64)
        with mg.parallel.no_sync(model):  # no collectives inside a trial
            model(x).square().mean().backward()

    return step


def _ranks_worker(dist):
    out = {}
    # Ranks with different memory: the smallest decides, and both say so.
    budget = (4 * 37 + 2) * MIB if dist.rank == 0 else (4 * 24 + 2) * MIB
    found = mg.find_micro_batch(_alloc_step(), dist, memory_budget=budget, plan=mg.BatchPlan(96, dist.world_size))
    out["budget"] = (found.micro_batch, found.plan.micro_batch, found.plan.accum_steps, found.trials)
    # A CUDA-style OOM exception on one rank only.
    step = _alloc_step(1, oom_from=10 if dist.rank == 1 else None)
    out["oom"] = mg.find_micro_batch(step, dist, memory_budget=1 << 40).micro_batch
    # Any other error leaves the search on every rank instead of hanging the others.
    def broken(m):
        if dist.rank == 1 and m == 4:
            raise ValueError("user bug")
    try:
        mg.find_micro_batch(broken, dist, memory_budget=1 << 40)
    except Exception as err:  # noqa: BLE001
        out["error"] = f"{type(err).__name__}: {err}"
    # A real DDP model, trials under no_sync.
    model = mg.wrap(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)), "ddp")
    found = mg.find_micro_batch(_mlp_step(dist, model, 0), dist, memory_budget=24 * MIB, plan=mg.BatchPlan(4096, dist.world_size))
    out["mlp"] = (found.micro_batch, found.plan.accum_steps, found.plan.micro_batch)
    return out


def test_ranks_agree_on_every_trial():
    r0, r1 = spawn(_ranks_worker, 2, timeout=180)
    assert r0["budget"][:3] == r1["budget"][:3] == (24, 24, 2)
    # Rank 0 fitted 32 on its own budget yet records the agreed "does not fit".
    t0 = {m: (ok, p) for m, ok, p in r0["budget"][3]}
    assert t0[32][0] is False and t0[32][1] < (4 * 37 + 2) * MIB
    assert r0["oom"] == r1["oom"] == 9
    assert r1["error"] == "ValueError: user bug"
    assert r0["error"].startswith("RuntimeError: find_micro_batch: another rank failed in step_fn(4)")
    assert r0["mlp"] == r1["mlp"]
    m, accum, micro = r0["mlp"]
    assert micro * accum * 2 == 4096 and micro <= m


@pytest.mark.gpu
def test_cuda_real_out_of_memory():
    device = torch.device("cuda", 0)
    chunk = 1 << 30  # 1 GiB per "sample"

    def step(m):
        t = torch.empty(m * chunk, dtype=torch.uint8, device=device)
        t.fill_(1)

    before = torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    found = mg.find_micro_batch(step, type("D", (), {"device": device, "world_size": 1})(), plan=mg.BatchPlan(1024, 1))
    assert found.limit == "cuda-oom"
    # About all the free memory, in whole GiB (the allocator and the context keep a little).
    assert free // chunk - 2 <= found.micro_batch <= free // chunk
    assert not [ok for m, ok, _ in found.trials if m == found.micro_batch + 1][0]
    assert torch.cuda.memory_allocated(device) == before   # trials freed their memory
    step(found.micro_batch)   # the answer really fits


def test_digits_recipe_find_batch(monkeypatch, capfd, tmp_path):
    from multigpu.recipes import digits

    monkeypatch.delenv("RANK", raising=False)
    res = digits.main(["--epochs", "2", "--global-batch", "64", "--find-batch", "--memory-budget", "64MiB", "--log-dir", str(tmp_path / "a")])
    out = capfd.readouterr().out
    assert "largest micro-batch that fits: 64 per rank" in out       # capped at the rank's share
    assert res["count"] == 360
    with pytest.raises(SystemExit) as exc:
        digits.main(["--epochs", "1", "--find-batch", "--log-dir", str(tmp_path / "b")])
    err = capfd.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0 and "memory_budget" in err


def test_launcher_request_budget_and_result_file(monkeypatch, tmp_path, capfd):
    # What a worker of `multigpu run --find-batch --memory-budget 38MiB` sees (in process, one rank).
    assert not mg.find_batch_requested()
    monkeypatch.setenv("MULTIGPU_FIND_BATCH", "1")
    monkeypatch.setenv("MULTIGPU_MEMORY_BUDGET", str((4 * 9 + 2) * MIB))
    monkeypatch.setenv("MULTIGPU_RUN_DIR", str(tmp_path))
    assert mg.find_batch_requested()
    assert mg.find_micro_batch(_alloc_step(), plan=mg.BatchPlan(32, 1)).micro_batch == 9          # the launcher's budget
    found = mg.find_micro_batch(_alloc_step(), memory_budget=(4 * 5 + 2) * MIB, plan=mg.BatchPlan(32, 1))
    assert found.micro_batch == 5                                                       # an explicit budget wins
    result = json.loads((tmp_path / "find_batch.json").read_text())                     # the last search's
    assert (result["micro_batch"], result["memory_budget"], result["summary"]) == (5, (4 * 5 + 2) * MIB, found.summary())
    assert result["plan"] == {"global_batch": 32, "world_size": 1, "micro_batch": 4, "accum_steps": 8}
    monkeypatch.setenv("MULTIGPU_MEMORY_BUDGET", "lots")
    with pytest.raises(mg.UsageError, match="MULTIGPU_MEMORY_BUDGET must be a positive number of bytes"):
        mg.find_micro_batch(_alloc_step())

    # The digits recipe honours the request without its own --find-batch (budget from the launcher).
    from multigpu.recipes import digits

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MULTIGPU_MEMORY_BUDGET", str(64 * MIB))
    digits.main(["--steps", "1", "--global-batch", "64", "--log-dir", str(tmp_path / "m")])
    assert "largest micro-batch that fits: 64 per rank" in capfd.readouterr().out
    assert json.loads((tmp_path / "find_batch.json").read_text())["memory_budget"] == 64 * MIB
