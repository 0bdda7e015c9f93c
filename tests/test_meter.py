"""StepMeter: values in JSONL/TensorBoard/CSV, all-reduced loss, stragglers, MFU inputs, GPU monitor."""

from __future__ import annotations

import json
import os
import threading
import time
import types

import pytest
import torch

import multigpu as mg
from multigpu.meter import StepMeter, count_flops, find_stragglers, peak_flops
from multigpu.meter import gpumon
from multigpu.testing import spawn


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# -- pure parts ------------------------------------------------------------------------

def test_straggler_rule_names_the_slow_rank_and_the_cause():
    hosts = ["a", "a", "b", "b"]
    found = find_stragglers([0.001, 0.001, 0.001, 0.060], [0.050, 0.051, 0.049, 0.050], hosts)
    assert [(s.rank, s.host, s.cause) for s in found] == [(3, "b", "data wait")]
    found = find_stragglers([0.001] * 4, [0.050, 0.090, 0.049, 0.051], hosts)
    assert [(s.rank, s.cause) for s in found] == [(1, "compute")]
    assert "rank 1 (host a)" in found[0].line()
    # Ordinary spread (within 3 MAD or under 5 %) is not a straggler; two ranks still work.
    assert find_stragglers([0.001] * 4, [0.050, 0.052, 0.049, 0.051], hosts) == []
    assert [s.rank for s in find_stragglers([0.0, 0.0], [0.050, 0.080], ["a", "a"])] == [1]
    assert find_stragglers([0.0, 0.0], [0.050, 0.051], ["a", "a"]) == []


def test_peak_table_picks_the_specific_model():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA L40S", "fp16") == 362e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert peak_flops("NVIDIA H200", "tf32") == 494e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_flops("Some Future GPU", "bf16") is None
    with pytest.raises(mg.UsageError, match="bf16, fp16"):
        peak_flops("NVIDIA H100", "int8")
    # mg.Precision("fp8").name, as a loop passes dtype=amp.name: MFU against the bf16 peak (torchtitan's and
    # forecast's convention), so float8's gain shows as a higher MFU
    assert peak_flops("NVIDIA H100 80GB HBM3", mg.Precision("fp32").name) == 67e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == peak_flops("NVIDIA H100 80GB HBM3", "bf16")


def test_full_state_dict_of_a_float8_model_is_plain_tensors(tmp_path):
    """torchao keeps float8 weights in a tensor subclass; mg.full_state_dict hands out plain tensors, which load
    into the plain model and through torch.load(weights_only=True) (verify's probe saves them so)."""
    pytest.importorskip("torchao.float8")
    from torch import nn

    amp = mg.Precision("fp8")
    model = amp.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), include=[""], verbose=False)
    assert type(model[0].weight) is not nn.Parameter  # the subclass this is about
    state = mg.full_state_dict(model)
    assert all(type(v) is torch.Tensor for v in state.values()), {k: type(v) for k, v in state.items()}
    torch.save(state, tmp_path / "w.pt")
    back = torch.load(tmp_path / "w.pt", weights_only=True)
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    plain.load_state_dict(back)
    assert torch.equal(plain[0].weight, model[0].weight.detach().float())


class FakeNvml:
    """pynvml's API over a scripted list of readings, to test the monitor without a GPU."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, readings):
        self.readings = list(readings)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _now(self):
        return self.readings[0] if len(self.readings) == 1 else self.readings.pop(0)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._cur = self._now()
        return types.SimpleNamespace(gpu=self._cur[0])

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self._cur[1] * 1e9)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._cur[2] * 1000

    def nvmlDeviceGetTemperature(self, h, kind):
        return self._cur[3]


def test_gpu_monitor_summarises_samples_and_names_the_rank():
    mon = gpumon.GpuMonitor(0, interval=0.01, nvml=FakeNvml([(10, 1.0, 100, 40), (90, 3.0, 300, 60), (50, 2.0, 200, 50)]))
    for _ in range(3):
        mon._samples.append(mon.sample())
    s = mon.take()
    assert s["util_pct"] == {"min": 10, "max": 90, "mean": 50}
    assert s["power_w"]["max"] == 300 and s["mem_used_gb"]["min"] == 1.0
    assert mon.take() is None  # reset after take
    other = {k: {"min": v["min"] + 5, "max": v["max"] + 5, "mean": v["mean"]} for k, v in s.items()}
    g = gpumon.across_ranks([gpumon.as_vector(s), gpumon.as_vector(other), gpumon.as_vector(None)])
    assert g["util_pct"]["min"] == 10 and g["util_pct"]["min_rank"] == 0
    assert g["util_pct"]["max"] == 95 and g["util_pct"]["max_rank"] == 1
    # The thread really samples: wait for a reading from a thread other than this one
    # (start() reads once itself); stop() joins, so that sample is in the summary.
    sampled, test_thread = threading.Event(), threading.current_thread()
    read = mon._nvml.nvmlDeviceGetUtilizationRates

    def read_and_tell(h):
        if threading.current_thread() is not test_thread:
            sampled.set()
        return read(h)

    mon._nvml.nvmlDeviceGetUtilizationRates = read_and_tell
    mon.start()
    assert sampled.wait(timeout=30), "the monitor thread never sampled"
    mon.stop()
    assert mon.take()["util_pct"]["min"] == 50
    off = gpumon.GpuMonitor(0, nvml=types.SimpleNamespace())  # no API at all -> off, with a reason
    assert not off.enabled and "NVML unavailable" in off.reason


# -- one process: sinks hold the logged values -------------------------------------------

def test_sinks_hold_the_logged_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [torch.randn(8, 16) for _ in range(7)]
    plan = mg.BatchPlan(global_batch=8, world_size=1)
    losses = []
    with StepMeter(None, plan, log_every=3, log_dir=str(tmp_path), model=model, progress=False, tokens_per_sample=10,
                   sinks=("jsonl", "tensorboard", "csv"), fingerprint_extra={"strategy": "none"}) as meter:
        for step, x in meter.steps(data):
            loss = model(x).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
            meter.step_end(loss=loss, lr=opt, twice=2 * loss.detach())
            if step == 4:
                meter.log(noise_scale=123.0)
        meter.log_eval(accuracy=0.5)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    header, steps, summary = recs[0], [r for r in recs if r["type"] == "step"], recs[-1]
    ev = next(r for r in recs if r["type"] == "eval")
    assert header["type"] == "header" and header["fingerprint"]["strategy"] == "none"
    assert header["fingerprint"]["world_size"] == 1 and header["plan"]["global_batch"] == 8
    # 7 steps, log_every 3: records after steps 2, 5 and the partial last one (6).
    assert [r["step"] for r in steps] == [2, 5, 6] and [r["steps"] for r in steps] == [3, 3, 1]
    for r, chunk in zip(steps, (losses[0:3], losses[3:6], losses[6:7])):
        assert r["loss"] == pytest.approx(sum(chunk) / len(chunk), rel=1e-6)
        assert r["twice"] == pytest.approx(2 * sum(chunk) / len(chunk), rel=1e-6)
    assert steps[1]["noise_scale"] == 123.0 and "noise_scale" not in steps[2]
    assert steps[-1]["samples_seen"] == 7 * 8 and steps[0]["lr"] == 0.05
    assert steps[0]["tokens_per_s"] == pytest.approx(10 * steps[0]["samples_per_s"])
    assert steps[0]["samples_per_s"] == pytest.approx(8 / steps[0]["step_time"])
    assert steps[0]["step_time"] >= steps[0]["compute"] > 0 and steps[0]["peak_mem_gb"] > 0
    # FLOPs counted on the first step: Linear 16->4 on 8 samples, forward 2*16*4 and backward 2x that.
    assert header["meter"]["flops_per_sample"] == "auto"
    fps = steps[0]["flops_per_s"] / steps[0]["samples_per_s"]
    assert fps == pytest.approx(count_flops(lambda: model(data[0]).pow(2).mean().backward()) / 8, rel=1e-6)
    assert steps[0]["mfu"] is None  # CPU: achieved FLOP/s only
    assert ev["type"] == "eval" and ev["accuracy"] == 0.5 and ev["step"] == 6
    assert summary["type"] == "summary" and summary["steps"] == 7
    assert summary["measured"]["intervals"] == 2  # the first interval (FLOP counting) left out
    # The throughput is the records' own clock: samples / time from the end of the first interval.
    clock = (steps[-1]["samples_seen"] - steps[0]["samples_seen"]) / (steps[-1]["time"] - steps[0]["time"])
    assert summary["samples_per_s"] == pytest.approx(clock, rel=1e-9)
    assert summary["measured"] == dict(summary["measured"], steps=4, samples=32, from_step=3, to_step=6)
    assert sum(summary["fractions"].values()) == pytest.approx(1.0)

    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb_loss] == [2, 5, 6]
    assert [v for _, v in tb_loss] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert acc.Scalars("eval/accuracy")[0].value == 0.5
    with open(tmp_path / "metrics.csv") as f:
        rows = f.read().splitlines()
    assert rows[0].split(",")[:2] == ["step", "steps"] and len(rows) == 4
    # A second run into the same directory would mix two runs in one file: refused.
    with pytest.raises(mg.UsageError, match="fresh log_dir"):
        StepMeter(None, plan, log_dir=str(tmp_path), progress=False, watchdog=None)


def test_console_plain_lines_when_not_a_terminal(tmp_path, capsys):
    plan = mg.BatchPlan(global_batch=4, world_size=1)
    with StepMeter(None, plan, log_every=2, log_dir=str(tmp_path), total_steps=4, watchdog=None, gpu_monitor=False) as m:
        for _, x in m.steps(range(4)):
            m.step_end(loss=float(x))
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("step ")]
    assert lines[0].startswith("step 2/4") and "loss 0.5" in lines[0] and "\r" not in err
    assert "samples/s" in lines[1] and "ETA" in lines[1]


def test_console_rewrites_one_line_on_a_terminal():
    import io

    from multigpu.meter.sinks import ConsoleSink

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    con = ConsoleSink(total_steps=100, stream=out)
    rec = {"type": "step", "step": 9, "loss": 1.5, "samples_per_s": 1234.0, "data_wait_frac": 0.25, "stragglers": []}
    con.write(rec)
    con.write(dict(rec, step=19))
    con.note("straggler ...")
    con.close()
    text = out.getvalue()
    assert text.startswith("\rstep 10/100  10% | ETA") and "\rstep 20/100  20%" in text
    assert "loss 1.5 | 1,234 samples/s | data 25%" in text and "\nstraggler ...\n" in text


def test_bad_arguments_are_one_line_usage_errors(tmp_path):
    with pytest.raises(mg.UsageError, match="samples per step"):
        StepMeter(None, None, log_dir=str(tmp_path))
    with pytest.raises(mg.UsageError, match="unknown sink"):
        StepMeter(None, samples_per_step=4, log_dir=str(tmp_path), sinks=("jsonl", "tensorbored"))
    with pytest.raises(mg.UsageError, match="START:STOP"):
        mg.profile(None, "10-15")


# -- real ranks: all-reduced loss, stragglers named -------------------------------------

SLOW = 0.08  # seconds added on the slow rank, per step


class SleepyNet(torch.nn.Module):
    def __init__(self, slow: bool):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.slow = slow

    def forward(self, x):
        if self.slow:
            time.sleep(SLOW)
        return self.lin(x)


def _slow_loader(n, slow):
    for i in range(n):
        if slow:
            time.sleep(SLOW)
        yield torch.full((4, 32), float(i))


def run_stragglers(dist, log_dir):
    slow_rank = dist.world_size - 1
    plan = mg.BatchPlan(global_batch=4 * dist.world_size, world_size=dist.world_size)
    out = {}
    # Phase 1: the last rank is slow in its loader. Phase 2: slow in forward (compute).
    for phase, (slow_data, slow_fwd) in enumerate(((True, False), (False, True))):
        net = SleepyNet(slow=slow_fwd and dist.rank == slow_rank)
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with StepMeter(dist, plan, log_every=4, log_dir=os.path.join(log_dir, str(phase)), model=model,
                       progress=False, watchdog=None) as meter:
            for step, x in meter.steps(_slow_loader(8, slow_data and dist.rank == slow_rank)):
                loss = model(x).mean()
                loss.backward(); opt.step(); opt.zero_grad()
                meter.step_end(loss=float(dist.rank * 100 + step), rank_metric=float(dist.rank))
    return out


def test_slow_rank_is_named_as_straggler_with_its_cause(tmp_path):
    spawn(run_stragglers, 3, str(tmp_path), timeout=180)
    for phase, cause in enumerate(("data wait", "compute")):
        recs = [r for r in read_jsonl(tmp_path / str(phase) / "metrics.jsonl") if r["type"] == "step"]
        assert len(recs) == 2
        # Loss is averaged over ranks and steps: ranks 0,1,2 -> mean(rank*100) = 100, plus the mean step.
        assert recs[0]["loss"] == pytest.approx(100 + 1.5) and recs[1]["loss"] == pytest.approx(100 + 5.5)
        assert recs[0]["rank_metric"] == pytest.approx(1.0)
        for r in recs:
            named = [s for s in r["stragglers"] if (s["rank"], s["cause"]) == (2, cause)]
            assert len(named) == 1 and named[0]["excess"] > SLOW / 2, (phase, r["stragglers"])
            # On this shared machine another rank may be a few ms slow for a while (and is then
            # reported); never by anything like the injected delay.
            assert all(s["excess"] < SLOW / 2 for s in r["stragglers"] if s is not named[0]), r["stragglers"]
            assert named[0]["intervals"] == recs.index(r) + 1
        # Only rank 0 writes files.
        assert sorted(os.listdir(tmp_path / str(phase))) == ["metrics.jsonl"]


# -- GPU paths ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_monitor_reads_nvml():
    pytest.importorskip("pynvml")
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    mon = gpumon.GpuMonitor(0, interval=0.1, uuid=f"GPU-{uuid}" if uuid else None)
    assert mon.enabled, mon.reason
    mon.start()
    time.sleep(0.5)
    mon.stop()
    s = mon.take()
    assert 0 <= s["util_pct"]["min"] <= s["util_pct"]["max"] <= 100
    assert s["mem_used_gb"]["max"] > 0 and 0 < s["temp_c"]["max"] < 120


@pytest.mark.gpu
def test_gpu_meter_times_with_events_and_reports_mfu(tmp_path):
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dist = types.SimpleNamespace(rank=0, world_size=1, device=dev)
    with StepMeter(dist, samples_per_step=256, log_every=5, log_dir=str(tmp_path), model=model, progress=False) as m:
        for _, x in m.steps(torch.randn(256, 1024, device=dev) for _ in range(10)):
            loss = model(x).float().pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            m.step_end(loss=loss)
    recs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "step"]
    name = torch.cuda.get_device_name(dev)
    assert recs[-1]["compute"] > 0 and recs[-1]["peak_mem_gb"] > 0.004  # 1024x1024 fp32 weights + grads
    assert 0 < recs[-1]["ready"] <= recs[-1]["compute"]  # the gradient-hook event came before the step's end
    if peak_flops(name, "fp32" if not torch.backends.cuda.matmul.allow_tf32 else "tf32"):
        assert 0 < recs[-1]["mfu"] < 1
    if m.monitor is not None and m.monitor.enabled:
        assert 0 <= recs[-1]["gpu"]["util_pct"]["max"] <= 100


def test_wandb_offline_run_holds_the_logged_loss(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import glob
    import re

    monkeypatch.setenv("WANDB_SILENT", "true")
    with StepMeter(None, samples_per_step=4, log_every=2, log_dir=str(tmp_path), sinks=("jsonl", "wandb"),
                   watchdog=None, progress=False, sink_options={"wandb": {"mode": "offline", "project": "mg-test"}}) as m:
        for _, x in m.steps(range(4)):
            m.step_end(loss=float(x))
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file after finish() returns: give it a moment.
    deadline = time.monotonic() + 20
    while True:
        data = open(run, "rb").read()
        # History items are protobuf records with the value as JSON text: loss 0.5 (steps 0,1) and 2.5 (steps 2,3).
        if (re.search(rb"loss.{1,4}0\.5", data) and re.search(rb"loss.{1,4}2\.5", data)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert re.search(rb"loss.{1,4}0\.5", data) and re.search(rb"loss.{1,4}2\.5", data), data[:200]


def test_missing_optional_sink_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(mg.UsageError, match=r"pip install 'multigpu\[mlflow\]'"):
        StepMeter(None, samples_per_step=4, log_dir=str(tmp_path / "run"), sinks=("jsonl", "mlflow"), watchdog=None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_mlflow_local_run_holds_the_logged_loss(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's local store is SQLite
    import mlflow

    with StepMeter(None, samples_per_step=4, log_every=2, log_dir=str(tmp_path), sinks=("jsonl", "mlflow"),
                   watchdog=None, progress=False, fingerprint_extra={"strategy": "none"}) as m:
        for _, x in m.steps(range(4)):
            m.step_end(loss=float(x))
    client = mlflow.tracking.MlflowClient(tracking_uri="sqlite:///" + str(tmp_path / "mlflow.db"))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(h.step, h.value) for h in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.5), (3, 2.5)]
    assert run.data.params["fingerprint/strategy"] == "none"


def test_throughput_is_total_samples_over_total_time_not_the_mean_of_interval_rates():
    from multigpu.meter.records import run_summary

    def rec(step, time, steps=10, **kw):
        return dict(type="step", step=step, steps=steps, samples_seen=(step + 1) * 100, time=time, step_time=0.0,
                    samples_per_s=0.0, data_wait=0.01, compute=0.05, peak_mem_gb=0.1, stragglers=[], **kw)

    # Warm-up, then intervals of 1 s, 10 s (a loaded machine) and 1 s (+0.5 s of eval, paused), 1000 samples each.
    records = [rec(9, 1.0), rec(19, 2.0), rec(29, 12.0), rec(39, 13.5, paused_s=0.5)]
    s = run_summary(records, steps=40, samples_per_step=100, wall_time=14.0, flops_per_sample=2.0, peak_flops=None,
                    world_size=2, paused={"eval": 0.5})
    assert s["samples_per_s"] == pytest.approx(3000 / 12)  # not (1000 + 100 + 1000) / 3 = 700
    assert s["intervals"]["samples_per_s"]["mean"] == pytest.approx(700)  # kept, as the spread
    assert s["intervals"]["samples_per_s"]["min"] == pytest.approx(100)
    assert s["step_time"] == pytest.approx(12 / 30) and s["measured"]["time_s"] == pytest.approx(12)
    assert (s["measured"]["from_step"], s["measured"]["to_step"], s["measured"]["steps"]) == (10, 39, 30)
    assert s["flops_per_s"] == pytest.approx(500) and s["mfu"] is None and s["paused_s"] == {"eval": 0.5}
    assert s["fractions"]["compute"] == pytest.approx(0.05 * 30 / 12)
    # A profiled interval is left out with its time and samples; a single record counts from the start.
    s = run_summary(records[:2] + [dict(records[2], profiled=True)], steps=30, samples_per_step=100, wall_time=12,
                    flops_per_sample=None, peak_flops=None)
    assert s["samples_per_s"] == pytest.approx(1000) and "mfu" not in s
    s = run_summary(records[:1], steps=10, samples_per_step=100, wall_time=1, flops_per_sample=None, peak_flops=None)
    assert s["samples_per_s"] == pytest.approx(1000)


def test_pipeline_stage_times_stay_per_rank_into_the_summary():
    from multigpu.meter.records import FIELDS, interval_record, run_summary, summary_line

    def row(compute, p2p, stage):  # 10 steps of 0.1 s; the stage's compute and p2p seconds over them
        base = dict.fromkeys(FIELDS, 0.0) | {"n": 10, "wall": 1.0, "compute": 1.0}
        return [base[f] for f in FIELDS] + [compute, 10.0 * stage, p2p, 5.0]   # sums over the interval's steps

    keys = ["stage/compute", "stage/id", "stage/p2p", "tokens"]
    kw = dict(n_steps=10, samples_per_step=8, lr=None, world_size=2, tokens_per_sample=None, flops_per_sample=None,
              peak_flops=None, hosts=["h", "h"], gpu=False, straggler_threshold=0.1, streak={})
    records = []
    for i in range(3):   # every interval: 1 s; rank 0 computes 0.6 s and waits 0.3 s, rank 1 0.8 s and 0.1 s
        rec, _ = interval_record([row(0.6, 0.3, 0), row(0.8, 0.1, 1)], keys, step=10 * i + 9, elapsed=1.0 + i, **kw)
        records.append(rec)
    ranks = records[0]["ranks"]   # per rank, per step
    assert ranks["compute"] == pytest.approx([0.06, 0.08]) and ranks["p2p"] == pytest.approx([0.03, 0.01])
    assert ranks["id"] == [0.0, 1.0]
    assert records[0]["tokens"] == pytest.approx(0.5) and "stage/compute" not in records[0]  # others averaged
    s = run_summary(records, steps=30, samples_per_step=8, wall_time=3.0, flops_per_sample=None, peak_flops=None)
    (r0, r1) = s["stages"]
    assert (r0["compute"], r0["p2p"], r0["other"]) == pytest.approx((0.6, 0.3, 0.1))
    assert (r1["compute"], r1["p2p"], r1["other"]) == pytest.approx((0.8, 0.1, 0.1))
    assert "rank 0 (stage 0) 60/30/10, rank 1" in summary_line(s)


def test_paused_time_is_not_step_time(tmp_path):
    import time as _time

    plan = mg.BatchPlan(global_batch=4, world_size=1)
    with StepMeter(None, plan, log_every=2, log_dir=str(tmp_path), progress=False, watchdog=None, gpu_monitor=False) as m:
        for step, _ in m.steps(range(6)):
            m.step_end(loss=1.0)
            if step == 2:  # inside the interval of steps 2-3
                with m.pause("eval"):
                    _time.sleep(0.3)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    steps, summary = [r for r in recs if r["type"] == "step"], recs[-1]
    assert steps[1]["paused_s"] >= 0.3 and steps[1]["step_time"] < 0.05
    assert summary["paused_s"]["eval"] >= 0.3 and summary["measured"]["time_s"] < 0.1


def test_step_peak_is_the_highest_the_window_held_on_top_of_the_state():
    """mg.meter.StepPeak on CPU: the profiler's running total at its highest (not at the end), on the base."""
    import torch
    from torch import nn

    from multigpu.meter import StepPeak, ddp_buckets

    mib = 2**20
    with StepPeak(torch.device("cpu"), base=1000) as peak:
        big = torch.empty(10 * mib, dtype=torch.uint8)
        del big
        kept = torch.empty(4 * mib, dtype=torch.uint8)
    assert 1000 + 10 * mib <= peak.total < 1000 + 10 * mib + 64 * 1024, peak.total
    assert kept.numel() == 4 * mib
    with StepPeak(torch.device("cpu"), base=0) as second:  # what the first window left allocated is not this one's
        torch.empty(mib)  # 4 MiB of float32, freed at once
    assert 4 * mib <= second.total < 4 * mib + 64 * 1024, second.total
    assert ddp_buckets(nn.Linear(4, 4)) == 0  # not DDP: no buckets


def test_live_tensors_leave_out_fake_ones():
    """A process that ran torch.compile keeps tensors with no memory alive in its caches (fake ones whose data
    pointer raises: the whole suite in one process tripped on them); the scan of live tensors counts real storage
    only."""
    import torch.nn.functional as F

    from multigpu.meter.footprint import live_tensor_bytes

    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))

    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(1, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(loss)(x, torch.randint(0, 50, (1, 16))).backward()
    with FakeTensorMode():
        fake = torch.empty(2**20)  # its data pointer reads 0 (with a warning), not a raise
    before = live_tensor_bytes(torch.device("cpu"))
    del fake
    assert live_tensor_bytes(torch.device("cpu")) == before
    real = torch.empty(2**20)
    assert live_tensor_bytes(torch.device("cpu")) - before == real.nbytes


def test_a_launch_that_asks_gets_a_warm_up_steps_real_peak_in_the_summary(tmp_path, monkeypatch):
    """MULTIGPU_MEMORY_STEP=1 (`multigpu tune`'s runs of a script): the StepMeter takes step min(2, log_every - 1)'s
    real peak (every live tensor at its start, plus the most it allocated at once) into its summary; unasked, none."""
    from torch import nn

    from multigpu.meter.footprint import live_tensor_bytes

    mib = 2**20
    model = nn.Linear(64, 64)
    kept = torch.empty(3 * mib, dtype=torch.uint8)  # live at every step's start: in the base

    def run(log_dir) -> dict:
        with StepMeter(samples_per_step=4, log_every=5, log_dir=str(log_dir), model=model, progress=False,
                       gpu_monitor=False, watchdog=None) as meter:
            for step, x in meter.steps(torch.randn(4, 64) for _ in range(7)):
                model(x).sum().backward()
                if step == 2:
                    spike = torch.empty(10 * mib, dtype=torch.uint8)  # allocated and freed inside the step
                    del spike
                meter.step_end()
        return read_jsonl(log_dir / "metrics.jsonl")[-1]

    assert "step_peak" not in run(tmp_path / "unasked")
    monkeypatch.setenv("MULTIGPU_MEMORY_STEP", "1")
    base = live_tensor_bytes(torch.device("cpu"))
    got = run(tmp_path / "asked")["step_peak"]
    assert got["step"] == 2 and 13 * mib <= got["bytes"] < base + 10 * mib + mib, (got, base)
    assert kept.numel() == 3 * mib
    # DDP's bucket copy of the gradients lives in C++ only: counted from every DDP module alive.
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        before = live_tensor_bytes(torch.device("cpu"))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert live_tensor_bytes(torch.device("cpu")) - before == 4 * (64 * 64 + 64)
        del ddp
    finally:
        tdist.destroy_process_group()


def test_one_flop_counter_counts_cpu_attention_as_cudas_flash_kernel():
    """mg.count_flops (the meter's MFU) and forecast count with one counter. PyTorch's own misses CPU's fused
    attention (0 FLOPs: a CPU run's MFU left attention out) and the experts' grouped matmuls; it counts them as
    CUDA's flash kernel is counted, forward and backward."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()  # noqa: E731
    with FlopCounterMode(display=False) as torchs:
        run()
    assert torchs.get_total_flops() == 0  # what this fixes (if PyTorch counts it one day, this says so)
    shape = q.shape
    assert count_flops(run) == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    if hasattr(torch, "_grouped_mm"):  # a mixture of experts' matmul: rows x in through each group's in x out
        a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 32, dtype=torch.bfloat16)
        offs = torch.tensor([3, 8], dtype=torch.int32)
        assert count_flops(lambda: torch._grouped_mm(a, b, offs=offs)) == 2 * 8 * 16 * 32


def test_a_resumed_meters_one_record_rates_its_own_samples_not_the_steps_before(tmp_path):
    import time as _time

    plan = mg.BatchPlan(global_batch=4, world_size=1)
    with StepMeter(None, plan, log_every=50, log_dir=str(tmp_path), progress=False, watchdog=None, gpu_monitor=False) as m:
        for _ in m.steps(range(5), start=100):  # resumed at step 100: one partial interval of 5 steps
            _time.sleep(0.01)
            m.step_end()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    (step,), summary = [r for r in recs if r["type"] == "step"], recs[-1]
    assert (step["samples"], step["samples_seen"], summary["measured"]["samples"]) == (20, 420, 20)
    assert summary["samples_per_s"] == pytest.approx(20 / summary["measured"]["time_s"])
    assert summary["samples_per_s"] < 20 / 0.05  # 5 steps of 10 ms at least, not 105 steps' samples


def test_with_replicas_the_meter_steps_as_they_commit(tmp_path):
    """One replica group (no launcher, so no torchft): the meter passes replicas.steps' committed steps through."""
    from torch import nn

    net = nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 2), torch.randn(32, 1))
    with mg.init(seed=0, device="cpu") as dist, StepMeter(None, (train := mg.loader(data, (replicas := mg.fault_tolerant(
            net, torch.optim.SGD(net.parameters(), lr=0.1), dist)).plan(global_batch=4), dist)).plan, log_every=3, log_dir=str(tmp_path), progress=False, watchdog=None,
                   gpu_monitor=False, replicas=replicas) as m:
        seen = []
        for step, micro_batches in m.steps(replicas.steps(train, 7)):
            seen.append(step)
            for x, y in micro_batches:
                nn.functional.mse_loss(net(x), y).backward()
            replicas.optimizer.step()
            m.step_end()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert seen == list(range(7)) and recs[-1]["replicas"] == {
        "groups": 1, "committed": 7, "retried": 0, "without_all": 0, "skipped": 0, "fewest": 1, "heals": 0,
        "heal_s": 0.0, "quorum_s": pytest.approx(0, abs=0.05), "changes": [{"step": 0, "groups": [0]}]}
    assert [r["samples"] for r in recs if r["type"] == "step"] == [12, 12, 4]
    from multigpu.meter.records import summary_line

    assert "1 replica groups: 7 steps committed" in summary_line(recs[-1])
    with StepMeter(None, train.plan, log_dir=str(tmp_path / "plain"), progress=False, watchdog=None,
                   gpu_monitor=False, replicas=replicas) as m:
        with pytest.raises(mg.UsageError, match=r"^StepMeter\(replicas=...\) meters the steps replicas.steps gives, "
                                                r"got items of type list; iterate meter.steps\(replicas.steps"):
            next(m.steps(train))  # the loader itself, not replicas.steps
    with pytest.raises(mg.UsageError, match=r"^StepMeter\(replicas=...\) takes the replicas mg.fault_tolerant returns, "
                                            r"got a DistributedLoader; pass replicas=mg.fault_tolerant\(model, optimizer, dist\)$"):
        StepMeter(None, train.plan, log_dir=str(tmp_path / "wrong"), progress=False, watchdog=None, gpu_monitor=False,
                  replicas=train)
