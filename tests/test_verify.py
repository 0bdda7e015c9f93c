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
                           (["--global-batch", "3", SCRIPT], "global batch 3 does not split over 2 workers; use --global-batch 2 or 4 (a multiple of 2)")):
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


def _run(losses, final, precision, initial=0.0):
    """A run as _read_run gives it: one scalar parameter starting at ``initial`` and ending at ``final``."""
    import torch

    return {"losses": losses, "digests": [1.0] * len(losses), "batchnorm": [], "rank_starts": [], "thin": None,
            "precision": precision, "initial": {"w": torch.tensor([initial])}, "final": {"w": torch.tensor([final])}}


def test_the_tolerance_follows_the_precision_the_script_reports():
    from multigpu.verify import STEP0, TOLERANCES, tolerance_line

    fp32, bf16 = TOLERANCES["fp32"], TOLERANCES["bf16"]
    # each tolerance sits at the geometric middle of what correct runs and planted bugs measured
    for spread in (STEP0, fp32.loss, fp32.update, bf16.loss, bf16.update):
        assert spread.correct < spread.tolerance < spread.bug
        assert spread.tolerance / spread.correct == pytest.approx(spread.bug / spread.tolerance)
    # bf16 rounding as measured: a later loss 1e-2 apart, the update 3e-2 apart; step 0 equal
    drift = ([1.0, 0.8, 0.6], [1.0, 0.8 * (1 + 1e-2), 0.6]), (1.0, 1.03)
    same = {p: compare(_run(drift[0][0], drift[1][0], p), _run(drift[0][1], drift[1][1], p)) for p in ("fp32", "bf16")}
    assert same["bf16"]["same"] and same["bf16"]["param_tol"] == bf16.update.tolerance
    assert not same["fp32"]["same"] and same["fp32"]["first_diverging_step"] == 1
    # step 0 is the same model on the same samples in any precision: held to STEP0 in bf16 too
    step0 = compare(_run([1.0, 0.8], 1.0, "bf16"), _run([1.0 + 1e-3, 0.8], 1.0, "bf16"))
    assert not step0["same"] and step0["first_diverging_step"] == 0
    # --rtol replaces the loss tolerances; the parameters keep the precision's
    assert not compare(_run(*drift[0][:1], 1.0, "bf16"), _run(drift[0][1], 1.0, "bf16"), 1e-5)["same"]
    # only the parameters apart, in bf16: said to be ambiguous, with the way to decide
    apart = compare(_run([1.0, 0.8], 1.0, "bf16"), _run([1.0, 0.8], 1.2, "bf16"))
    assert not apart["same"] and apart["causes"][0].endswith("verify in fp32 or with fewer --steps to tell a bug from "
                                                              "rounding")
    # a precision that changes with the world size is not the same training
    mixed = compare(_run([1.0], 1.0, "fp32"), _run([1.0], 1.0, "bf16"))
    assert not mixed["same"] and mixed["causes"][0].startswith("the precision differs: the script gives its "
                                                               "StepMeter dtype fp32 on one run and bf16")
    assert tolerance_line("bf16", None).startswith(
        f"multigpu verify: bf16, the dtype the script gives its StepMeter: losses within {STEP0.tolerance:.1e} at "
        f"step 0 (the same model and samples) and {bf16.loss.tolerance:.1e} after, final parameters within "
        f"{bf16.update.tolerance:.1e} of the update (bf16's correct runs measured up to")
    assert "tf32 not measured: bf16's, which rounds coarser, as a bound" in tolerance_line("tf32", None)


@pytest.mark.slow
def test_verify_reads_the_precision_from_the_meter_and_says_which_tolerance_it_used(tmp_path, capsys):
    from multigpu.cli import main
    from multigpu.verify import STEP0, TOLERANCES

    for precision in ("fp32", "bf16"):  # 30 steps: where bf16 runs drift 1e-3 apart in loss (fp32's old 1e-5)
        code = main(["verify", "--cpu", "--steps", "30", "--global-batch", "8", "--out", str(tmp_path / precision), SCRIPT,
                     "--precision", precision])
        said = capsys.readouterr().out
        tol = TOLERANCES[precision]
        assert code == 0, said
        assert (f"multigpu verify: {precision}, the dtype the script gives its StepMeter: losses within "
                f"{STEP0.tolerance:.1e} at step 0 (the same model and samples) and {tol.loss.tolerance:.1e} after, "
                f"final parameters within {tol.update.tolerance:.1e} of the update") in said, said
        c = json.loads((tmp_path / precision / "verify.json").read_text())["comparisons"]["2"]
        assert c["precision"] == precision and c["same"] and c["steps"] == 30
        assert c["loss_tol"] == tol.loss.tolerance and c["param_tol"] == tol.update.tolerance


def test_steps_that_draw_random_numbers_are_named_as_the_cause(tmp_path):
    """The meter's probe notes whether a step advanced torch's generator (a dropout's draw in the loop), and a
    difference between such runs is put down to the draws, not to a bug of the loss or the gradients."""
    import torch

    from multigpu.meter.probe import Probe

    drew = {}
    for draws in (False, True):
        probe = Probe(None, str(tmp_path / str(draws)), 0, 1)
        for _ in range(2):
            probe.batch(torch.zeros(2, 3))
            if draws:
                torch.rand(1)  # a dropout mask drawn in the step
        probe.finish()
        drew[draws] = json.loads((tmp_path / str(draws) / "verify" / "probe.json").read_text())["draws"]
    assert drew == {False: False, True: True}
    ref, other = _run([1.0, 0.8], 1.0, "fp32"), _run([1.0, 0.9], 1.1, "fp32")
    random = compare(ref, dict(other, draws=True))
    assert not random["same"] and random["causes"][0].startswith("the steps draw random numbers (torch's generator")
    assert not any("draw random numbers" in c for c in compare(ref, other)["causes"])
