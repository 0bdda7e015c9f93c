"""`multigpu verify` on a correct script (the same training on 1 and 2 ranks) and on planted bugs of each kind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multigpu.verify import STEP0, _read_run, compare
from multigpu.verify_floor import LATER_FACTOR, MIN_LOSS, MIN_UPDATE, STEP0_FACTOR

from _cli import run_cli

SCRIPT = str(Path(__file__).with_name("_verify_script.py"))
CONVNET = str(Path(__file__).parents[1] / "examples" / "verify_convnet.py")


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


def _launch(tmp_path, name, n, args, floor=False):
    """One `multigpu run` of _verify_script.py under verify's probe (``floor``: as verify's floor run)."""
    env = dict(os.environ, MULTIGPU_VERIFY="1", **({"MULTIGPU_VERIFY_FLOOR": "1"} if floor else {}))
    return subprocess.Popen([sys.executable, "-m", "multigpu", "run", "-n", str(n), "--cpu", "--log-dir",
                             str(tmp_path / name), SCRIPT, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_correct_script_passes_and_each_planted_bug_is_caught_and_named(tmp_path, capsys, precision):
    from multigpu.verify import floor_of

    # End to end through the CLI: the correct script computes the same on 1 and 2 ranks, exit 0.
    code, _ = run_cli(["verify", "--cpu", "--steps", "4", "--out", str(tmp_path / "cli"), SCRIPT, "--precision",
                       precision], capsys)
    report = json.loads((tmp_path / "cli" / "verify.json").read_text())
    same = report["comparisons"]["2"]
    assert code == 0 and report["same"] and report["floor"]["why_not"] is None and same["steps"] == 4, same
    # Every kind, with the reference and its floor run: one launch each, training every kind in turn.
    args = ["--bug", "all", "--steps", "4", "--precision", precision]
    procs = {"w1": _launch(tmp_path, "w1", 1, args), "floor": _launch(tmp_path, "floor", 1, args, floor=True),
             "w2": _launch(tmp_path, "w2", 2, args)}
    for name, proc in procs.items():
        assert proc.wait(timeout=300) == 0, (name, proc.stderr.read())
    run = {name: next(p for p in (tmp_path / name).iterdir() if p.is_dir()) for name in procs}
    kinds = ("none", "seed", "sampler", "bn", "loss", "handavg")
    runs = {(name, kind): _read_run(run[name] / kind) for name in procs for kind in kinds}
    floors = {kind: floor_of(runs["w1", kind], runs["floor", kind], STEP0.tolerance) for kind in kinds}
    assert all(f.measured for f in floors.values()), floors
    ok = compare(runs["w1", "none"], runs["w2", "none"], None, floors["none"])
    assert ok["same"] and ok["steps"] == 4 and ok["causes"] == [] and ok["final_x_floor"] < LATER_FACTOR, ok
    expected = {"seed": "the initial parameters differ", "sampler": "the samples of step 0 differ",
                "bn": "BatchNorm without sync", "loss": "the loss of step 0 differs with the same model and samples",
                # rank 0's start equals the reference's, rank 1's does not: only every rank's digest shows it
                "handavg": "the initial parameters differ between the ranks (rank 1 vs rank 0)"}
    for kind, cause in expected.items():
        c = compare(runs["w1", kind], runs["w2", kind], None, floors[kind])
        assert not c["same"] and c["first_diverging_step"] == 0 and c["loss_x_floor"] > STEP0_FACTOR, (kind, c)
        assert len(c["causes"]) == 1 and c["causes"][0].startswith(cause), (kind, c["causes"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batchnorm_without_sync_stands_far_above_its_floor_and_synced_is_the_same(tmp_path, precision):
    """The filed case: a conv net whose BatchNorm DDP does not sync (SGD, 2 workers vs 1, 5 steps, global batch
    64) read SAME under fp32's fixed tolerance (6.7e-3 of the update under 1.4e-2); the same script with
    SyncBatchNorm ends within rounding of one process. Judged against the script's own floor: DIFFERENT from
    step 0 with BatchNorm named, and SAME synced, in fp32 and in bf16."""
    from multigpu.launch.once import run_once
    from multigpu.verify import floor_of, verify

    args = ["--optimizer", "sgd", "--precision", precision]
    said: list[str] = []
    report = verify(CONVNET, [*args, "--batchnorm"], steps=5, global_batch=64, cpu=True, out=str(tmp_path / "bn"),
                    say=said.append)
    c = report["comparisons"]["2"]
    assert not report["same"] and c["first_diverging_step"] == 0 and c["loss_x_floor"] > STEP0_FACTOR, (c, said)
    # fp32 also in the parameters (7e4 x); bf16's rounding of each rank's share moves them as far as the bug does
    assert precision == "bf16" or c["final_x_floor"] > LATER_FACTOR, c
    assert c["causes"] == ["BatchNorm without sync (1): each rank normalizes with its share's statistics; use "
                           "mg.wrap(model, 'ddp', sync_batchnorm=True)"], c["causes"]
    assert said[3].startswith(f"multigpu verify: the floor, 1 worker again with each step's samples in another order "
                              f"and each gradient rounded once more in {precision}: losses "), said
    assert said[4].startswith("  2 workers vs 1: DIFFERENT from step 0 (loss ") and " x the floor" in said[4], said
    # SyncBatchNorm on 2 ranks against the same reference: on one process both scripts build the same BatchNorm
    done = run_once(CONVNET, [*args, "--sync-batchnorm", "--global-batch", "64", "--steps", "5"], module=False,
                    log_dir=tmp_path / "sync", nproc=2, cpu=True, env={"MULTIGPU_VERIFY": "1"})
    assert done.exit_code == 0, done.failure()
    ref, floor_run = (_read_run(next(p for p in (tmp_path / "bn" / d).iterdir() if p.is_dir()))
                      for d in ("w1", "w1-floor"))
    synced = compare(ref, _read_run(done.run_dir), None, floor_of(ref, floor_run, STEP0.tolerance))
    assert synced["same"] and synced["causes"] == [] and synced["loss_x_floor"] < STEP0_FACTOR, synced


def _run(losses, final, precision, initial=0.0):
    """A run as _read_run gives it: one scalar parameter starting at ``initial`` and ending at ``final``."""
    import torch

    return {"losses": losses, "digests": [1.0] * len(losses), "batchnorm": [], "rank_starts": [], "thin": None,
            "precision": precision, "initial": {"w": torch.tensor([initial], dtype=torch.float64)},
            "final": {"w": torch.tensor([final], dtype=torch.float64)}}


def test_the_floor_run_puts_each_steps_samples_in_another_order_and_keeps_them_paired():
    from collections import namedtuple

    from multigpu.meter.probe import digest, reorder

    x, y, w = torch.arange(16.0).reshape(8, 2), torch.arange(8), torch.rand(8)
    Pair = namedtuple("Pair", "x y")
    batch = [(x, y, w), {"x": x[:2], "y": y[:2]}, Pair(x, y), torch.tensor(3.0), "text", x[:1]]
    out, moved = reorder(batch)
    assert moved == 7 and type(out) is list and type(out[1]) is dict and type(out[2]) is Pair
    (rx, ry, rw), pair = out[0], out[2]
    order = ry.tolist()
    assert sorted(order) == list(range(8)) and order != list(range(8))  # another order, the same samples
    assert torch.equal(rx, x[order]) and torch.equal(rw, w[order]) and torch.equal(pair.x, x[order])  # paired
    assert out[1]["y"].tolist() == [1, 0] and torch.equal(out[1]["x"], x[[1, 0]])  # two samples: swapped
    assert out[3] is batch[3] and out[4] == "text" and out[5] is batch[5]  # nothing to reorder
    assert digest(out) == pytest.approx(digest(batch), rel=1e-12)
    # a random order, not a reversal: a pairwise sum of a reversed row adds the same pairs and rounds alike
    assert order != list(range(7, -1, -1))
    assert reorder([])[1] == 0 and reorder({"ids": ["a", "b"]})[1] == 0


def test_the_floor_run_rounds_each_gradient_once_more_in_the_dtype(tmp_path, monkeypatch):
    from torch import nn

    from multigpu.meter.probe import ROUNDOFF, Probe

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        model(x).square().sum().backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        monkeypatch.setenv("MULTIGPU_VERIFY", "1")
        monkeypatch.setenv("MULTIGPU_VERIFY_FLOOR", "1")
        probe = Probe(model, str(tmp_path / dtype), 0, 1, None, dtype)
        model(x).square().sum().backward()
        rel = max(float(((p.grad - g).abs() / g.abs()).max()) for p, g in zip(model.parameters(), plain))
        # one more rounding: a relative error of up to one unit roundoff (and the fp32 product's own rounding)
        assert ROUNDOFF[dtype] / 4 < rel <= 2 * ROUNDOFF[dtype] and probe.rounded == 2, (dtype, rel)
        monkeypatch.setenv("MULTIGPU_VERIFY_FLOOR", "0")  # outside the floor run: the gradients untouched
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        Probe(model, str(tmp_path / f"{dtype}-plain"), 0, 1, None, dtype)
        model(x).square().sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def _floor_run(ref, losses=None, final=None, reordered=None, rounded=1, digests=None):
    """``ref``'s floor run as _read_run gives it."""
    return ref | {"losses": losses or ref["losses"], "final": {"w": torch.tensor([final], dtype=torch.float64)} if final is not None
                  else ref["final"], "digests": digests or ref["digests"],
                  "floor": {"reordered": len(ref["losses"]) if reordered is None else reordered, "rounded": rounded}}


def test_a_comparison_is_judged_against_its_own_floor():
    from multigpu.verify import TOLERANCES, floor_of
    from multigpu.verify_floor import describe, loss_gaps

    fp32, bf16_tol = TOLERANCES["fp32"], TOLERANCES["bf16"]
    ref = _run([1.0, 0.8, 0.6], 1.0, "fp32")
    floor = floor_of(ref, _floor_run(ref, [1.0, 0.8 + 1e-6, 0.6], 1.0 + 1e-6), STEP0.tolerance)
    assert (floor.step0, floor.later, floor.measured) == (0.0, pytest.approx(1e-6), True)
    assert floor.update == pytest.approx(1e-6) and floor.update_tol() == pytest.approx(LATER_FACTOR * 1e-6)
    # within LATER_FACTOR x the floor: SAME; beyond it DIFFERENT, though under fp32's tolerance (1.4e-2)
    near = compare(ref, _run([1.0, 0.8 + 500e-6, 0.6], 1.0 + 500e-6, "fp32"), None, floor)
    assert near["same"] and near["loss_x_floor"] == pytest.approx(500) and near["final_x_floor"] == pytest.approx(500)
    later = compare(ref, _run([1.0, 0.8 + 2e-3, 0.6], 1.0, "fp32"), None, floor)
    assert not later["same"] and later["first_diverging_step"] == 1 and 2e-3 < fp32.loss.tolerance
    params = compare(ref, _run([1.0, 0.8, 0.6], 1.0 + 2e-3, "fp32"), None, floor)
    assert not params["same"] and 2e-3 < fp32.update.tolerance
    assert params["causes"][0].startswith("the same losses and samples, but the final parameters differ: the updates")
    # step 0 holds its own floor (the same model on the same samples), here below the minimum
    step0 = compare(ref, _run([1.0 + 4 * STEP0_FACTOR * MIN_LOSS, 0.8, 0.6], 1.0, "fp32"), None, floor)
    assert not step0["same"] and step0["first_diverging_step"] == 0 and step0["step0_tol"] == STEP0_FACTOR * MIN_LOSS
    # a float64 script's floor (1e-16) counts as the minimum: its own rounding is no bug
    fp64 = floor_of(ref, _floor_run(ref, [1.0, 0.8 + 1e-16, 0.6], 1.0 + 1e-16), STEP0.tolerance)
    assert compare(ref, _run([1.0, 0.8 + 1e-15, 0.6], 1.0 + 1e-15, "fp32"), None, fp64)["same"]
    assert fp64.loss_tol(1) == LATER_FACTOR * MIN_LOSS and fp64.update_tol() == LATER_FACTOR * MIN_UPDATE
    # a floor never loosens verify: past the precision's tolerances it is DIFFERENT whatever the floor
    loud = floor_of(ref, _floor_run(ref, [1.0, 0.8 + 1e-4, 0.6], 1.0 + 1e-4), STEP0.tolerance)
    assert loud.update_tol() == fp32.update.tolerance and loud.loss_tol(1) == fp32.loss.tolerance
    assert not compare(ref, _run([1.0, 0.8, 0.6], 1.0 + 2e-2, "fp32"), None, loud)["same"]
    assert describe(floor, "1 worker") == (
        "the floor, 1 worker again with each step's samples in another order and each gradient rounded once more in "
        "fp32: losses 0.0e+00 apart at step 0 and up to 1.0e-06 after, final parameters 1.0e-06 of the update; "
        "DIFFERENT above 10 x it at step 0, 1000 x after (a floor of at least 1e-07; never more than fp32's "
        "tolerances, 5.9e-03 losses and 1.4e-02 of the update)")
    # bf16: rounding each rank's share moves correct runs up to 48 x the floor after step 0 (bf16's tolerances
    # hold them); step 0 is held to its floor, where a BatchNorm without sync stands 210 x or more
    bf16 = _run([1.0, 0.8, 0.6], 1.0, "bf16")
    coarse = floor_of(bf16, _floor_run(bf16, [1.0, 0.8 + 1e-4, 0.6], 1.0 + 7e-4), STEP0.tolerance)
    assert coarse.cap == (bf16_tol.loss.tolerance, bf16_tol.update.tolerance)
    drift = compare(bf16, _run([1.0, 0.8 + 1e-2, 0.6], 1.0 + 48 * 7e-4, "bf16"), None, coarse)
    assert drift["same"] and drift["param_tol"] == bf16_tol.update.tolerance and drift["final_x_floor"] == pytest.approx(48)
    moved = compare(bf16, _run([1.0 + 2e-5, 0.8, 0.6], 1.0, "bf16"), None, coarse)
    assert not moved["same"] and moved["first_diverging_step"] == 0 and moved["step0_tol"] == STEP0_FACTOR * MIN_LOSS
    # a loss trained towards 0 is compared at the scale of step 0's: 1e-8 against 1e-6 is no 100 x gap
    assert loss_gaps([(2.0, 2.0), (1e-6, 1e-8), (-4.0, -3.0)]) == [0.0, pytest.approx(0.99e-6 / 2), 0.25]
    # a floor run that is no evidence of rounding alone: the precision's tolerances judge, and the line says why
    for run, why in ((_floor_run(ref, reordered=2), "the samples of 1 of 3 steps could not be put in another order"),
                     (_floor_run(ref, [1.01, 0.8, 0.6]), "the same samples in another order changed step 0's loss "
                                                          "by 1.0e-02"),
                     (_floor_run(ref, digests=[1.0, 2.0, 1.0]), "the floor run trained on other samples"),
                     (_floor_run(bf16, rounded=0), "no gradient could be rounded once more in bf16"),
                     (ref | {"floor": None}, "the floor run recorded no floor")):
        none = floor_of(ref if run["precision"] == "fp32" else bf16, run, STEP0.tolerance)
        assert not none.measured and none.why_not.startswith(why), (why, none.why_not)
        assert describe(none, "1 worker") == f"no floor: {none.why_not}"
        judged = compare(ref, _run([1.0, 0.8, 0.6], 1.0, "fp32"), None, none)
        assert judged["param_tol"] == fp32.update.tolerance and judged["step0_tol"] == STEP0.tolerance


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
def test_verify_reads_the_precision_from_the_meter_and_says_which_floor_it_used(tmp_path, capsys):
    from multigpu.cli import main
    from multigpu.verify import TOLERANCES

    for precision in ("fp32", "bf16"):  # 30 steps: where bf16 runs drift 1e-3 apart in loss (fp32's old 1e-5)
        code = main(["verify", "--cpu", "--steps", "30", "--global-batch", "8", "--out", str(tmp_path / precision), SCRIPT,
                     "--precision", precision])
        said = capsys.readouterr().out
        assert code == 0, said
        assert (f"multigpu verify: the floor, 1 worker again with each step's samples in another order and each "
                f"gradient rounded once more in {precision}: losses ") in said and "DIFFERENT above 10 x it" in said, said
        report = json.loads((tmp_path / precision / "verify.json").read_text())
        c, floor = report["comparisons"]["2"], report["floor"]
        assert c["precision"] == precision and c["same"] and c["steps"] == 30 and c["tolerance_basis"] == "the floor"
        tol = TOLERANCES[precision]
        assert c["param_tol"] == min(LATER_FACTOR * max(floor["update"], MIN_UPDATE), tol.update.tolerance), (c, floor)
        assert f"never more than {precision}'s tolerances, {tol.loss.tolerance:.1e} losses" in said, said


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


def test_fp8_is_refused_where_its_rounding_moves_correct_runs_as_far_as_bugs(tmp_path, capsys):
    """fp8's tolerances derived as bf16's (benchmarks/verify_precision.py, correct runs against the planted bugs)
    do not separate them: float8 scales each tensor by its rank's own amax. verify says so in one line (exit 2)
    after the first run, whose meter names the precision, and runs nothing more."""
    pytest.importorskip("torchao.float8")
    from multigpu.verify_floor import TOLERANCES

    assert TOLERANCES["fp32"].separates and TOLERANCES["bf16"].separates and not TOLERANCES["fp8"].separates
    code, err = run_cli(["verify", "--cpu", "--steps", "2", "--global-batch", "8", "--out", str(tmp_path), SCRIPT,
                         "--precision", "fp8"], capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert "verify cannot tell a bug from fp8's own rounding: correct runs measured up to 3.5e-03 at step 0" in lines[0]
    assert lines[0].endswith("verify the script in bf16, where bugs stand apart (float8's layouts are checked against "
                             "one process in docs/float8.md)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w1"]  # neither the floor run nor 2 workers ran
