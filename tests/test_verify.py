"""`multigpu verify` on a correct script (the same training on 1 and 2 ranks) and on planted bugs of each kind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multigpu.verify import _read_run, compare

from _cli import run_cli

SCRIPT = str(Path(__file__).with_name("_verify_script.py"))


def test_bad_verify_input_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, fragment in ((["--workers", "2", SCRIPT], "--workers needs two or more positive world sizes"),
                           (["--workers", "1,x", SCRIPT], "comma-separated list of integers"),
                           (["--steps", "0", SCRIPT], "--steps must be >= 1"),
                           (["--rtol", "-1", SCRIPT], "--rtol must be a positive number, got -1.0"),
                           (["--global-batch", "0", SCRIPT], "--global-batch must be a positive integer, got 0"),
                           (["--global-batch", "3", SCRIPT], "--global-batch 3 is not divisible by 2 workers")):
        code, err = run_cli(["verify", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_correct_script_passes_and_each_planted_bug_is_caught_and_named(tmp_path, capsys):
    # End to end through the CLI: the correct script computes the same on 1 and 2 ranks, exit 0.
    code, _ = run_cli(["verify", "--cpu", "--steps", "4", "--out", str(tmp_path / "cli"), SCRIPT], capsys)
    assert code == 0
    report = json.loads((tmp_path / "cli" / "verify.json").read_text())
    same = report["comparisons"]["2"]
    assert report["same"] and same["steps"] == 4 and same["largest_loss_rel"] < 1e-5 and same["final_rel"] < 1e-5
    # Every kind, with the reference: one launch per world size, each training every kind in turn.
    env = dict(os.environ, MULTIGPU_VERIFY="1")
    procs = {n: subprocess.Popen([sys.executable, "-m", "multigpu", "run", "-n", str(n), "--cpu", "--log-dir",
                                  str(tmp_path / f"w{n}"), SCRIPT, "--bug", "all", "--steps", "4"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for n in (1, 2)}
    for n, proc in procs.items():
        assert proc.wait(timeout=240) == 0, (n, proc.stderr.read())
    run = {n: next(p for p in (tmp_path / f"w{n}").iterdir() if p.is_dir()) for n in procs}
    runs = {(n, kind): _read_run(run[n] / kind) for n in procs for kind in ("none", "seed", "sampler", "bn", "loss", "handavg")}
    ok = compare(runs[1, "none"], runs[2, "none"], 1e-5)
    assert ok["same"] and ok["steps"] == 4 and ok["causes"] == [] and ok["final_rel"] < 1e-5, ok
    expected = {"seed": "the initial parameters differ", "sampler": "the samples of step 0 differ",
                "bn": "BatchNorm without sync", "loss": "the loss of step 0 differs with the same model and samples",
                # rank 0's start equals the reference's, rank 1's does not: only every rank's digest shows it
                "handavg": "the initial parameters differ between the ranks (rank 1 vs rank 0)"}
    for kind, cause in expected.items():
        c = compare(runs[1, kind], runs[2, kind], 1e-5)
        assert not c["same"] and c["first_diverging_step"] == 0, (kind, c)
        assert len(c["causes"]) == 1 and c["causes"][0].startswith(cause), (kind, c["causes"])
