"""`multigpu plan` and mg.scale_recipe: LR rules, schedule rescaling, noise-scale predictions, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import multigpu as mg
from multigpu import cli
from multigpu.noise import efficiency, gain

from _cli import run_cli


def test_scale_global_sgd_is_linear_and_keeps_samples():
    r = mg.scale_recipe(0.1, 128, 8, "sgd", steps=10000, warmup_steps=100, eval_every=500, checkpoint_every=1000)
    assert (r.global_batch, r.micro_batch, r.accum_steps) == (1024, 128, 1)
    assert r.lr == pytest.approx(0.8)
    assert (r.steps, r.warmup_steps, r.eval_every, r.checkpoint_every) == (1250, 13, 63, 125)
    assert r.steps * r.global_batch == 10000 * 128          # same samples
    assert r.batch_plan() == mg.BatchPlan(1024, 8, micro_batch=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.lr = 1.0


def test_adam_uses_square_root_and_per_gpu_batch_sets_global():
    r = mg.scale_recipe(3e-4, 64, 4, "adamw", per_gpu_batch=32, steps=1000)
    assert r.global_batch == 128 and r.lr_rule == "sqrt"
    assert r.lr == pytest.approx(3e-4 * math.sqrt(2))
    assert r.steps == 500


def test_keep_global_changes_nothing_but_the_split():
    r = mg.scale_recipe(0.1, 256, 8, "sgd", policy="keep-global", per_gpu_batch=16, steps=900, warmup_steps=10)
    assert (r.global_batch, r.micro_batch, r.accum_steps, r.lr, r.steps, r.warmup_steps) == (256, 16, 2, 0.1, 900, 10)
    assert r.batch_plan().accum_steps == 2


def test_noise_scale_predictions_and_warning():
    phi = 300.0
    r = mg.scale_recipe(0.1, 128, 8, "sgd", steps=10000, warmup_steps=100, noise_scale=phi)
    assert r.efficiency == pytest.approx((phi + 128) / (phi + 1024))
    assert r.gain == pytest.approx(8 * (phi + 128) / (phi + 8 * 128))
    assert r.gain == pytest.approx(r.efficiency * 8)        # Pollux: efficiency = gain / scale
    assert r.steps_to_target == math.ceil(10000 * (1 + phi / 1024) / (1 + phi / 128))
    assert any("far past the critical batch" in w for w in r.warnings)
    # Well below the noise scale: near-linear, no warning.
    quiet = mg.scale_recipe(0.1, 128, 8, "sgd", steps=10000, warmup_steps=100, noise_scale=50_000)
    assert quiet.efficiency > 0.97 and not quiet.warnings
    assert quiet.steps_to_target == pytest.approx(1250, rel=0.03)
    assert gain(128, 128, 5.0) == pytest.approx(1.0) and efficiency(128, 5.0, 128) == 1.0


def test_cli_prints_the_table(capsys):
    rc = cli.main(["plan", "--lr", "0.1", "--batch", "128", "--warmup-steps", "100", "--steps", "10000",
                   "--optimizer", "sgd", "--gpus", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "global batch                128        1024" in out
    assert "learning rate               0.1         0.8" in out
    assert "total steps               10000        1250" in out
    assert out.count("why:") >= 2


def test_cli_reads_noise_scale_from_a_metrics_log(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "noise/b_simple": 100.0}, {"step": 3, "noise/b_simple": 400.0}, {"step": 4}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc = cli.main(["plan", "--lr", "0.1", "--batch", "128", "--steps", "1000", "--optimizer", "sgd",
                   "--gpus", "4", "--noise-scale", str(log)])
    out = capsys.readouterr().out
    assert rc == 0 and "measured noise scale 400" in out
    assert f"efficiency {efficiency(512, 400.0, 128):.0%}" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lr", "-0.1"], "learning rate must be a positive number"),
        (["--gpus", "0"], "gpus must be a positive integer"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--policy", "double"], "unknown policy 'double'"),
        (["--policy", "keep-global", "--per-gpu-batch", "12"], "use --per-gpu-batch 8"),
        (["--policy", "keep-global", "--gpus", "3"], "does not split over 3 GPUs"),
        (["--noise-scale", "-5"], "noise scale must be a positive number"),
        (["--noise-scale", "missing.jsonl"], "no such file"),
        (["--warmup-steps", "20", "--steps", "10"], "exceed total steps"),
        (["--lr", "abc"], "invalid float value"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, needle, capsys):
    base = {"--lr": "0.1", "--batch": "128", "--optimizer": "sgd", "--gpus": "8"}
    args = dict(base)
    extra = []
    it = iter(argv)
    for k in it:
        v = next(it)
        if k in args:
            args[k] = v
        else:
            extra += [k, v]
    full = ["plan"] + [x for kv in args.items() for x in kv] + extra
    rc, err = run_cli(full, capsys)
    assert rc == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_log_without_noise_scale_is_a_usage_error(tmp_path):
    log = tmp_path / "m.jsonl"
    log.write_text('{"loss": 1}\n')
    from multigpu.planner import read_noise_scale

    with pytest.raises(mg.UsageError, match="no 'noise/b_simple'"):
        read_noise_scale(str(log))
    log.write_text("not json\n")
    with pytest.raises(mg.UsageError, match="is not JSON"):
        read_noise_scale(str(log))


def test_plan_reads_the_noise_scale_a_step_meter_logged(tmp_path, capsys):
    """End to end: NoiseScale -> StepMeter's metrics.jsonl -> `multigpu plan --noise-scale FILE`."""
    import torch

    from multigpu.planner import read_noise_scale

    torch.manual_seed(0)
    plan = mg.BatchPlan(global_batch=64, world_size=1, micro_batch=16)
    model = torch.nn.Linear(8, 1)
    noise = mg.NoiseScale(plan).attach(model)
    seen = set()
    with mg.StepMeter(None, plan, log_every=5, log_dir=str(tmp_path), gpu_monitor=False, progress=False,
                      watchdog=None, flops_per_sample=None) as meter:
        for _step, _ in meter.steps(range(20)):
            for _ in range(plan.accum_steps):
                x = torch.randn(plan.micro_batch, 8)
                loss = (model(x).squeeze(1) - x[:, 0]).square().mean() / plan.accum_steps
                loss.backward()
            model.zero_grad(set_to_none=True)
            m = noise.metrics()
            seen.add(m["noise/b_simple"])
            meter.log(m)
            meter.step_end(loss=loss.detach())
    logged = read_noise_scale(str(tmp_path / "metrics.jsonl"))
    assert logged in seen
    rc = cli.main(["plan", "--lr", "0.1", "--batch", "64", "--optimizer", "sgd", "--gpus", "4",
                   "--noise-scale", str(tmp_path / "metrics.jsonl")])
    assert rc == 0 and f"measured noise scale {logged:,.0f}" in capsys.readouterr().out


def test_library_errors_reach_the_terminal_in_the_verbs_flags(capsys):
    """scale_recipe names Python parameters; `multigpu plan` says the same fix with its flags."""
    with pytest.raises(mg.UsageError, match=r"use per_gpu_batch=8, or policy='scale-global'"):
        mg.scale_recipe(0.1, 128, 8, "sgd", policy="keep-global", per_gpu_batch=12)
    rc, err = run_cli(["plan", "--lr", "0.1", "--batch", "128", "--optimizer", "sgd", "--gpus", "8",
                       "--policy", "keep-global", "--per-gpu-batch", "12"], capsys)
    assert rc == 2 and "use --per-gpu-batch 8, or --policy scale-global" in err
