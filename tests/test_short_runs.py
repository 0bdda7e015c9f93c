"""A run that recorded fewer steps than asked, or none after the meter's warm-up, is no evidence: study, verify
and tune each say so in one line (what was asked, what was got, the fix) and draw no verdict from it.

The short run is real: tests/_layout_script.py (the layout contract) has 256 samples, so at --global-batch 32
its loader ends after 8 steps, whatever --steps asks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from multigpu.meter.records import run_summary
from multigpu.meter.evidence import steps_asked, thin_evidence

from _cli import run_cli

SCRIPT = str(Path(__file__).with_name("_layout_script.py"))
# logged every 2 steps: steps 0-1 are the warm-up interval, 2-7 measured
SHORT = ("30 steps asked, 8 recorded, 6 measured after warm-up (its data ran out or it stopped early); give the "
         "script more data or ask fewer --steps")


def _records(steps: int, log_every: int, profiled: tuple[int, ...] = ()) -> list[dict]:
    """A header, the step records a meter writes for ``steps`` steps logged every ``log_every`` (those ending at a
    step in ``profiled`` marked so), its summary."""
    recs, t = [{"type": "header", "meter": {"log_every": log_every}}], 0.0
    for last in [*range(log_every - 1, steps, log_every)] + ([steps - 1] if steps % log_every else []):
        n = last - (recs[-1]["step"] if len(recs) > 1 else -1)
        t += 0.1 * n
        recs.append({"type": "step", "step": last, "steps": n, "samples_seen": 16 * (last + 1), "time": t,
                     "data_wait": 0.0, "compute": 0.1, "peak_mem_gb": 0.0, "stragglers": []}
                    | ({"profiled": True} if last in profiled else {}))
    recs.append(run_summary(recs[1:], steps=steps, samples_per_step=16, wall_time=t, flops_per_sample=None,
                            peak_flops=None))
    return recs


def test_thin_evidence_says_what_was_asked_what_was_got_and_the_fix():
    assert thin_evidence(_records(30, 10), 30) is None and thin_evidence(_records(30, 10), None) is None
    assert thin_evidence(_records(8, 2), 30) == SHORT
    # One record: the meter measures from its start, so the rate would hold the warm-up (the case filed: 8 steps
    # logged every 10, "poor scaling" from a 0.5 s window).
    assert thin_evidence(_records(8, 10), 8) == ("a rate needs steps after the meter's warm-up interval, got 8 "
                                                 "recorded, 0 measured after warm-up (log_every 10); ask more --steps "
                                                 "(at least 20) or log more often")
    # Every interval after the warm-up profiled (the study's default --profile 20:25 on 30 steps logged every
    # 10): the meter falls back to the warm-up interval alone.
    assert thin_evidence(_records(30, 10, profiled=(19, 29)), 30) == (
        "a rate needs steps after the meter's warm-up interval, got 30 recorded, 0 measured after warm-up (log_every "
        "10, steps 10-29 profiled); ask more --steps, past the profiled ones, or profile other steps (--profile)")
    # verify compares every step, no rate: only the count matters
    assert thin_evidence(_records(8, 10), 8, rate=False) is None
    assert thin_evidence(_records(8, 2), 30, rate=False).startswith("30 steps asked, 8 recorded (its data ran out")
    assert steps_asked(["--lr", "1", "--steps", "60", "--global-batch", "8", "--steps=30"]) == 30
    assert steps_asked(["--global-batch", "8"]) is None


@pytest.mark.slow
def test_study_leaves_a_run_whose_data_ran_out_out_of_every_verdict(tmp_path):
    out = tmp_path / "study"
    proc = subprocess.run([sys.executable, "-m", "multigpu", "study", "--cpu", "--workers", "1,2", "--steps", "30",
                           "--global-batch", "32", "--profile", "off", "--out", str(out), SCRIPT],
                          capture_output=True, text=True, timeout=300)
    said = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing left to judge
    short = [line for line in said if "NO EVIDENCE" in line]
    assert len(short) == 2 and all(SHORT in line for line in short), said
    assert f"  2 workers keep-global: no verdict: {SHORT}" in said  # not "poor scaling: 5 % efficiency"
    assert "1 worker: no evidence (too short to judge)" in proc.stdout
    study = json.loads((out / "study.json").read_text())
    assert {r["status"] for r in study["runs"]} == {"short"}
    assert all(g["n_ok"] == 0 and g["speedup"] is None for g in study["groups"])
    md = (out / "report.md").read_text()
    assert "## Runs too short to judge (left out of every verdict)" in md and f"w2-gb32-r0: {SHORT}" in md
    assert "No throughput plot: no run gave a rate" in md


def test_verify_refuses_a_run_whose_data_ran_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["verify", "--cpu", "--workers", "1,2", "--steps", "30", "--global-batch", "32",
                         "--out", str(tmp_path / "v"), SCRIPT], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert ("the run on 1 worker is no evidence: 30 steps asked, 8 recorded (its data ran out or it stopped early); "
            "give the script more data or ask fewer --steps") in err
    assert not (tmp_path / "v" / "verify.json").exists()


def test_tune_leaves_out_a_layout_whose_run_ran_short(tmp_path):
    from multigpu.tune import TuneConfig, run_tune

    said: list[str] = []
    _, report = run_tune(TuneConfig(SCRIPT, ("--global-batch", "32"), nproc=1, cpu=True, steps=30, repeats=1,
                                    out=str(tmp_path / "tune")), say=said.append)
    assert report["winner"] is None and report["command"] is None  # not the fastest of runs nobody asked for
    assert report["left_out"] == [{"layout": report["left_out"][0]["layout"], "reason": f"too short to judge: {SHORT}"}]
    assert any(line.endswith(f"left out: too short to judge: {SHORT}") for line in said), said
    assert report["verdict"].startswith("multigpu tune: no layout was measured (") and SHORT in report["verdict"]
