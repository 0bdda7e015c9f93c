"""A StepMeter with its own log_dir under ``multigpu run --max-restarts``: a restart appends, another run is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import multigpu as mg
from multigpu.meter import StepMeter
from multigpu.meter.sinks import JsonlSink, continues_launch, last_header

# Fails in step 1 of the first attempt (after step 0's record), finishes 3 steps in the next.
SCRIPT = r'''
import os, sys
import multigpu as mg

with mg.init(seed=0) as dist:
    plan = mg.BatchPlan(global_batch=4, world_size=dist.world_size)
    meter = mg.StepMeter(dist, plan, log_every=1, log_dir=sys.argv[1], progress=False, flops_per_sample=None, watchdog=None)
    with meter:
        for step, _ in meter.steps(range(3)):
            if step == 1 and os.environ["MULTIGPU_ATTEMPT"] == "0":
                raise RuntimeError("the first attempt fails in step 1")
            meter.step_end(loss=float(step))
'''


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _launch(tmp_path: Path, log_dir: Path, name: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "multigpu", "run", "-n", "1", "--cpu", "--max-restarts", "1",
         "--log-dir", str(tmp_path / f"logs-{name}"), str(tmp_path / "train.py"), str(log_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    return proc, time.perf_counter() - t0


@pytest.mark.slow
def test_a_restart_appends_to_its_own_log_dir_and_another_run_into_it_is_refused(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    log_dir = tmp_path / "meter"
    proc, _ = _launch(tmp_path, log_dir, "first")
    assert proc.returncode == 0, proc.stderr
    assert "restart 1 of 1" in proc.stderr
    records = _read(log_dir / "metrics.jsonl")
    assert [r["type"] for r in records] == ["header", "step", "header", "step", "step", "step", "summary"]
    [lid] = records[0]["launch"]  # one launcher
    assert records[0]["launch"] == {lid: 0} and records[2]["launch"] == {lid: 1}
    assert [r["step"] for r in records if r["type"] == "step"] == [0, 0, 1, 2]

    # A second launch into the same directory: refused on its first attempt and on its restart too.
    before = (log_dir / "metrics.jsonl").read_bytes()
    proc, _ = _launch(tmp_path, log_dir, "second")
    assert proc.returncode == 2, proc.stderr
    refusals = [ln for ln in proc.stderr.splitlines() if ln.startswith("multigpu: error: ")]
    assert refusals == [f"multigpu: error: {log_dir / 'metrics.jsonl'} already exists; give the run a fresh log_dir, "
                        "or pass resume=True to append to it"] * 2
    assert "Traceback" not in proc.stderr
    assert (log_dir / "metrics.jsonl").read_bytes() == before


# -- the decision, without a launcher ---------------------------------------------------------
def _meter(monkeypatch, log_dir, launch: str | None, attempt: int, **kw) -> StepMeter:
    for name, value in (("MULTIGPU_LAUNCH_ID", launch), ("MULTIGPU_ATTEMPT", str(attempt))):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return StepMeter(None, samples_per_step=4, log_dir=log_dir and str(log_dir), progress=False, watchdog=None,
                     gpu_monitor=False, flops_per_sample=None, **kw)


def test_only_a_later_attempt_of_the_same_launch_appends(tmp_path, monkeypatch):
    monkeypatch.delenv("MULTIGPU_RUN_DIR", raising=False)
    path = tmp_path / "metrics.jsonl"
    _meter(monkeypatch, tmp_path, "a1", 0).close()
    for launch, attempt in (("a1", 0), ("b2", 0), ("b2", 1), (None, 0), (None, 3)):  # same attempt, other launches, no launcher
        with pytest.raises(mg.UsageError, match="already exists; give the run a fresh log_dir, or pass resume=True"):
            _meter(monkeypatch, tmp_path, launch, attempt)
    _meter(monkeypatch, tmp_path, "a1", 2).close()  # attempt 1 never got as far as its meter
    with pytest.raises(mg.UsageError, match="already exists"):
        _meter(monkeypatch, tmp_path, "a1", 1)  # not after the attempt that wrote last
    _meter(monkeypatch, tmp_path, None, 0, resume=True).close()  # resume=True still appends, launcher or not
    headers = [r for r in _read(path) if r["type"] == "header"]
    assert [h["launch"] for h in headers] == [{"a1": 0}, {"a1": 2}, None]


def test_without_log_dir_a_restart_appends_to_the_run_directory_as_before(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIGPU_RUN_DIR", str(tmp_path))
    for attempt in (0, 1):
        _meter(monkeypatch, None, "a1", attempt).close()
    assert [h["launch"] for h in _read(tmp_path / "metrics.jsonl")] == [{"a1": 0}, {"a1": 1}]


def test_a_restart_of_any_launcher_in_the_world_continues_the_file():
    # Two nodes (two launchers): rank 0 may be on either after an elastic restart.
    previous = {"type": "header", "launch": {"n0": 3, "n1": 0}}
    assert continues_launch(previous, {"n1": 1})
    assert continues_launch(previous, {"n0": 4, "n2": 0})
    assert not continues_launch(previous, {"n0": 3, "n2": 0})
    assert not continues_launch(previous, {"n2": 5})
    assert not continues_launch({"type": "header"}, {"n0": 1}) and not continues_launch(None, {"n0": 1})
    assert not continues_launch(previous, None)


def test_the_last_header_is_found_from_the_end_past_long_lines_and_a_cut_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = {"type": "header", "launch": {"x": 0}, "pad": "h" * 5000}
    second = {"type": "header", "launch": {"x": 1}, "pad": "g" * 5000}
    lines = [first, {"type": "step", "step": 0}, second] + [{"type": "step", "step": i, "pad": "s" * 300} for i in range(50)]
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines) + '{"type":"step","st')
    for block in (7, 4096, 1 << 16):
        assert last_header(str(path), block=block) == second
    path.write_text('{"type":"step"}\n')
    assert last_header(str(path)) is None

    # Appending after a record a crash cut short: the new header gets a line of its own.
    path.write_text(json.dumps(first, separators=(",", ":")) + '\n{"type":"step","st')
    sink = JsonlSink(str(path), {"type": "header", "launch": {"x": 1}})
    sink.close()
    tail = path.read_text().splitlines()
    assert tail[-2:] == ['{"type":"step","st', '{"type":"header","launch":{"x":1}}']
