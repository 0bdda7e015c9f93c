"""The public surface is deliberate: __all__ is exactly this list, and every name resolves."""

import subprocess
import sys

import pytest

import multigpu as mg

PUBLIC = [
    "BatchPlan", "Checkpointer", "Dist", "MicroBatchSearch", "NoiseScale", "Precision", "ScaledRecipe",
    "SequenceSearch", "StepMeter", "TokenShards", "UsageError", "accumulate", "all_reduce_sum", "clip_grad_norm_", "context_share", "eval_loader", "fault_tolerant",
    "find_batch_requested", "find_micro_batch", "find_sequence_length", "fingerprint", "from_pretrained", "full_state_dict", "init", "layout_from_args", "loader", "optimizer", "parallelize", "print0", "profile",
    "save_pretrained", "scale_lr", "scale_recipe", "stream_eval_loader", "stream_loader", "token_divisor", "unwrap", "warmup", "wrap",
]


def test_all_is_the_deliberate_list_and_every_name_resolves():
    assert sorted(mg.__all__) == sorted(PUBLIC)
    for name in mg.__all__:
        assert getattr(mg, name) is not None, name


def test_import_has_no_side_effects():
    # Also: `multigpu run`'s parser imports only its own verb (ckpt's torch.distributed.checkpoint costs 1.8 s).
    code = ("import os, sys; env = dict(os.environ); import multigpu, torch.distributed as d; "
            "assert not d.is_initialized(); assert dict(os.environ) == env; "
            "from multigpu.cli import build_parser; build_parser(['run', '-n', '2', 'x.py']).parse_args(['run', 'x.py']); "
            "heavy = sorted(m for m in ('torch.distributed.checkpoint', 'multigpu.checkpoint', 'multigpu.tune') if m in sys.modules); "
            "print(heavy or 'ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_console_script_exits_with_the_verbs_code_and_flushed_output(capsys):
    # `multigpu` ends with os._exit (no interpreter teardown): its output must still arrive whole.
    # (Exit code 2 and stderr through the same path: test_launch's test_bad_input_from_the_command_line.)
    from multigpu import cli

    argv = ["plan", "--lr", "0.1", "--batch", "128", "--steps", "100", "--optimizer", "sgd", "--gpus", "2"]
    assert cli.main(argv) == 0
    in_process = capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "multigpu", *argv], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, in_process), proc.stderr


def test_a_public_name_that_went_says_what_to_write_instead_in_one_line():
    import multigpu.parallel as parallel

    for name, instead in parallel.MOVED.items():
        with pytest.raises(AttributeError) as e:
            getattr(parallel, name)
        assert str(e.value) == f"mg.parallel.{name} is gone; use {instead}"
        assert "\n" not in str(e.value)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        parallel.no_such_name  # noqa: B018
