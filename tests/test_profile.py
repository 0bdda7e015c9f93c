"""Profiler: per-rank Chrome traces and a summary whose parts add up to the step time."""

from __future__ import annotations

import json
import time

import pytest
import torch

import multigpu as mg
from multigpu.meter import StepMeter
from multigpu.meter.profile import PARTS, breakdown
from multigpu.testing import spawn

DATA_SLEEP, FWD_SLEEP = 0.02, 0.015


def test_breakdown_partitions_the_step_windows():
    # steps [0,100) and [100,200); compute [10,50) and [110,130); comm [40,70) and [120,180); data [0,10), [100,110)
    parts = breakdown([(0, 100), (100, 200)], [(10, 50), (110, 130)], [(40, 70), (120, 180)], [(0, 10), (100, 110)])
    assert parts == {"compute": 30 + 10, "overlapped_comm": 10 + 10, "exposed_comm": 20 + 50,
                     "data_wait": 10 + 10, "idle": 30 + 20, "step_total": 200}
    assert sum(parts[p] for p in PARTS) == parts["step_total"]


class Net(torch.nn.Module):
    def __init__(self, slow):
        super().__init__()
        self.a, self.b, self.slow = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), slow

    def forward(self, x):
        if self.slow:
            time.sleep(FWD_SLEEP)
        return self.b(torch.relu(self.a(x)))


def _loader(n):
    for _ in range(n):
        time.sleep(DATA_SLEEP)
        yield torch.randn(32, 64)


def run_profiled(dist, log_dir):
    model = torch.nn.parallel.DistributedDataParallel(Net(slow=dist.rank == 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ends = {}
    with StepMeter(dist, samples_per_step=32 * dist.world_size, log_dir=log_dir, progress=False, watchdog=None,
                   profile="3:6", flops_per_sample=None) as meter:
        for step, x in meter.steps(_loader(8)):
            model(x).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
            # Before step_end: the profiler's window for a step closes inside step_end, and the
            # trace export after the last profiled step must not count as step time.
            ends[step] = time.perf_counter()
            meter.step_end()
        summaries = meter.profiler.summaries
    return summaries, ends[5] - ends[2]


def test_profile_summary_adds_up_to_the_measured_step_time(tmp_path, capsys):
    results = spawn(run_profiled, 2, str(tmp_path), timeout=180)
    summaries = results[0][0]
    assert len(summaries) == 2 and results[1][0] == summaries
    for rank, (s, wall) in zip(range(2), ((summaries[0], results[0][1]), (summaries[1], results[1][1]))):
        total_ms = s["step_total"]
        assert s["steps"] == 3 and s["device"] == "cpu"
        assert sum(s[p] for p in PARTS) == pytest.approx(total_ms, rel=1e-9)
        # The profiled windows are the steps the wall clock measured, within 10 % (+5 ms for profiler start/stop).
        assert abs(total_ms - wall * 1e3) < 0.10 * wall * 1e3 + 5, (rank, total_ms, wall * 1e3)
        # Both ranks sleep in their loader: 3 x 20 ms of data wait.
        assert 0.7 * 3 * DATA_SLEEP * 1e3 < s["data_wait"] < 1.6 * 3 * DATA_SLEEP * 1e3, s
        assert s["compute"] > 0 and s["top_ops"]
        print(f"\nrank {rank}: wall {wall * 1e3:.1f} ms, profile {total_ms:.1f} ms = "
              + " + ".join(f"{p} {s[p]:.1f}" for p in PARTS))
    # Rank 1 sleeps in forward: rank 0 waits for its gradients, exposed communication on rank 0.
    assert summaries[0]["exposed_comm"] > 3 * FWD_SLEEP * 1e3 * 0.5, summaries[0]
    for r in range(2):
        with open(tmp_path / "profile" / f"trace_rank{r}.json") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert "gloo:all_reduce" in names and "multigpu:data_wait" in names
    assert json.loads((tmp_path / "profile" / "summary.json").read_text())[1]["rank"] == 1


def test_launcher_profile_variable_reaches_the_meter(tmp_path, monkeypatch, capsys):
    from multigpu.meter.profile import parse_steps
    from multigpu.runtime.contract import worker_env

    for k, v in worker_env(str(tmp_path), profile=parse_steps("2:4")).items():
        monkeypatch.setenv(k, v)
    with StepMeter(None, samples_per_step=4, log_every=2, watchdog=None, flops_per_sample=None) as meter:
        for _ in meter.steps(range(6)):
            torch.ones(64, 64).matmul(torch.ones(64, 64))
    assert meter.log_dir == str(tmp_path)  # the run directory came from the launcher
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # Steps 0-1 hold the profiler's warm-up step, 2-3 the profiled ones: both left out of the summary.
    assert [r.get("profiled", False) for r in recs if r["type"] == "step"] == [True, True, False]
    assert recs[-1]["measured"]["intervals"] == 1
    (s,) = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert s["steps"] == 2 and sum(s[p] for p in PARTS) == pytest.approx(s["step_total"])
    assert "profile of steps 2..3" in capsys.readouterr().out


@pytest.mark.gpu
def test_profile_on_cuda_splits_kernels(tmp_path):
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(2048, 2048).to(dev)

    class D:
        rank, world_size, device = 0, 1, dev

    with mg.profile(D(), "1:3", out_dir=str(tmp_path)) as prof:
        for _ in range(4):
            model(torch.randn(512, 2048, device=dev)).sum().backward()
            prof.step()
    s = prof.summaries[0]
    assert s["device"] == "cuda" and s["compute"] > 0 and s["exposed_comm"] == 0
    assert sum(s[p] for p in PARTS) == pytest.approx(s["step_total"])
