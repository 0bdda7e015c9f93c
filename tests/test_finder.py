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
    # Rank 1's data holds 40 samples, rank 0's 300: every rank leaves the search with rank 1's line.
    x = torch.randn(300 if dist.rank == 0 else 40, 64)

    def sliced(m):
        model.zero_grad(set_to_none=True)
        with mg.parallel.no_sync(model):
            model(x[:m]).square().mean().backward()
    try:
        mg.find_micro_batch(sliced, dist, memory_budget=1 << 40, max_micro_batch=256)
    except mg.UsageError as err:
        out["short"] = str(err)
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
    assert r0["short"] == r1["short"] == (
        "find_micro_batch: step_fn(64) ran 40 samples, not the 64 asked (the data it reads holds 40), so every "
        "larger micro-batch would be measured on 40; pass max_micro_batch=40, or give step_fn more samples")


class _TinyLM(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, width), torch.nn.Linear(width, 64)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _lm_step(model, tokens):
    def step(n):
        model.zero_grad(set_to_none=True)
        x = tokens[:, :n]
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()

    return step


def test_a_step_that_ran_fewer_than_asked_is_refused_not_counted_as_fitting():
    """A step slicing data shorter than the size asked runs what the data holds, and any size would "fit"
    (65,536 tokens were reported for a step that ran 2,048): the search stops at the first such trial with
    one line naming what ran and the cap to pass, whether the slice shows it, or only the model's inputs."""
    torch.manual_seed(0)
    model, tokens = _TinyLM(), torch.randint(0, 64, (1, 2048))
    with pytest.raises(mg.UsageError) as err:
        mg.find_sequence_length(_lm_step(model, tokens), multiple=128, start=1024, max_length=65536,
                                memory_budget=1 << 40)
    assert str(err.value) == (
        "find_sequence_length: step_fn(4096) ran 2048 tokens, not the 4096 asked (the data it reads holds 2048), so "
        "every longer sequence would be measured on 2048; pass max_length=2048, or give step_fn longer sequences")
    # The data shorter than start: caught on the first (unmeasured) trial; the fix moves start too.
    with pytest.raises(mg.UsageError, match=r"step_fn\(1024\) ran 640 tokens, .* pass max_length=640 and start=640,"):
        mg.find_sequence_length(_lm_step(model, tokens[:, :640]), multiple=128, start=1024, max_length=65536,
                                memory_budget=1 << 40)
    # Measured trials are watched through the model's inputs alone (slices in the first trial only): data
    # between the first and the second size, and data of exactly the first size, are caught at the second.
    with pytest.raises(mg.UsageError, match=r"^find_sequence_length: step_fn\(2048\) ran 1536 tokens, .* "
                                            r"pass max_length=1536, or"):
        mg.find_sequence_length(_lm_step(model, tokens[:, :1536]), multiple=128, start=1024, max_length=65536,
                                memory_budget=1 << 40)
    with pytest.raises(mg.UsageError) as err:
        mg.find_sequence_length(_lm_step(model, tokens[:, :1024]), multiple=128, start=1024, max_length=65536,
                                memory_budget=1 << 40)
    assert str(err.value) == (
        "find_sequence_length: step_fn(2048) ran the same inputs as step_fn(1024) (the data it reads holds at most "
        "1024 tokens), so every longer sequence would be measured on them; pass max_length=1024 or less, or give "
        "step_fn longer sequences")
    # With the cap it names, the search runs and every trial ran what it asked.
    found = mg.find_sequence_length(_lm_step(model, tokens), multiple=128, start=1024, max_length=2048,
                                    memory_budget=1 << 40)
    assert found.length == 2048 and [n for n, _, _ in found.trials] == [1024, 2048]
    # Samples from a loader, no slice to see: the model's input carried the size (1, 2, 4, ...) until it did not.
    data = torch.utils.data.TensorDataset(torch.randn(100, 8))
    net = torch.nn.Linear(8, 4)

    def loaded(m):
        (x,) = next(iter(torch.utils.data.DataLoader(data, batch_size=m)))
        net(x).square().mean().backward()

    with pytest.raises(mg.UsageError, match=r"^find_micro_batch: step_fn\(128\) ran 100 samples, not the 128 asked "
                                            r".* pass max_micro_batch=100, or give step_fn more samples$"):
        mg.find_micro_batch(loaded, memory_budget=1 << 40, max_micro_batch=1024)
    assert mg.find_micro_batch(loaded, memory_budget=1 << 40, max_micro_batch=100).micro_batch == 100


def test_a_model_whose_width_is_the_first_size_asked_is_not_taken_for_a_short_run():
    """The model's inputs name the step's axis only where they followed two sizes: a step whose model sees the
    tokens in another shape (2 rows of n / 2 here, as context parallelism's share is cut) and whose width is the
    first size asked (64) shows no position that held both 64 and 128, so no axis and no verdict: the width
    staying 64 when 128 is asked is no evidence that the step ran 64."""
    torch.manual_seed(0)
    model, tokens = _TinyLM(width=64), torch.randint(0, 64, (1, 512))

    def step(n):
        model.zero_grad(set_to_none=True)
        x = tokens[:, :n].reshape(2, n // 2)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()

    found = mg.find_sequence_length(step, multiple=64, start=64, max_length=512, memory_budget=1 << 40)
    assert found.length == 512 and [n for n, _, _ in found.trials] == [64, 128, 256, 512]


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


def test_multigpu_run_find_batch_over_a_step_that_ran_fewer_is_one_line_and_exit_2(tmp_path):
    """`multigpu run --find-batch` of a script whose step slices 2,048 tokens when more is asked: no
    "fits" line and no find_batch.json, the workers' one line (the same on both ranks) and exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_find_batch_worker.py")
    proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", "2", "--cpu", "--find-batch", "--memory-budget",
                           "75MiB", "--log-dir", str(tmp_path), str(script), "short"],
                          capture_output=True, text=True, timeout=240)
    line = ("find_sequence_length: step_fn(4096) ran 2048 tokens, not the 4096 asked (the data it reads holds 2048), "
            "so every longer sequence would be measured on 2048; pass max_length=2048, or give step_fn longer sequences")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"multigpu: error: {line}\n" in proc.stderr and "fits on all" not in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.rglob("find_batch.json"))
    run_dir = next(tmp_path.iterdir())
    for rank in (0, 1):
        assert (run_dir / "attempt_0" / f"rank{rank}.stderr.log").read_text().strip().splitlines()[-1] == \
            f"multigpu: error: {line}"
