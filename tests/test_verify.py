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
                           (["--steps", "0", SCRIPT], "--steps must be >= 1")):
        code, err = run_cli(["verify", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err, err


@pytest.mark.slow
def test_a_correct_script_passes_and_each_planted_bug_is_caught_and_named(tmp_path, capsys):
    # End to end through the CLI: BatchNorm without sync, exit 1, the cause named.
    code, _ = run_cli(["verify", "--cpu", "--steps", "4", "--out", str(tmp_path / "bn"), SCRIPT, "--bug", "bn"], capsys)
    assert code == 1
    report = json.loads((tmp_path / "bn" / "verify.json").read_text())
    bn = report["comparisons"]["2"]
    assert not bn["same"] and bn["first_diverging_step"] == 0
    assert [c.split(" (")[0] for c in bn["causes"]] == ["BatchNorm without sync"] and "(1)" in bn["causes"][0]
    # The other kinds: the launches of both world sizes at once (verify itself runs them one after the other).
    env = dict(os.environ, MULTIGPU_VERIFY="1")
    cases = {"ref": (1, "none"), "none": (2, "none"), "seed": (2, "seed"), "sampler": (2, "sampler"), "loss": (2, "loss")}
    procs = {name: subprocess.Popen([sys.executable, "-m", "multigpu", "run", "-n", str(n), "--cpu", "--log-dir",
                                     str(tmp_path / name), SCRIPT, "--bug", bug, "--steps", "4"],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, (n, bug) in cases.items()}
    for name, proc in procs.items():
        assert proc.wait(timeout=240) == 0, (name, proc.stderr.read())
    runs = {name: _read_run(next(p for p in (tmp_path / name).iterdir() if p.is_dir())) for name in cases}
    ok = compare(runs["ref"], runs["none"], 1e-5)
    assert ok["same"] and ok["steps"] == 4 and ok["causes"] == [] and ok["final_rel"] < 1e-5, ok
    expected = {"seed": "the initial parameters differ", "sampler": "the samples of step 0 differ",
                "loss": "the loss of step 0 differs with the same model and samples"}
    for name, cause in expected.items():
        c = compare(runs["ref"], runs[name], 1e-5)
        assert not c["same"] and c["first_diverging_step"] == 0, (name, c)
        assert len(c["causes"]) == 1 and c["causes"][0].startswith(cause), (name, c["causes"])
