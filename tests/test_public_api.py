"""The public surface is deliberate: __all__ is exactly this list, and every name resolves."""

import subprocess
import sys

import multigpu as mg

PUBLIC = [
    "BatchPlan", "Checkpointer", "Dist", "MicroBatchSearch", "NoiseScale", "Precision", "ScaledRecipe",
    "StepMeter", "UsageError", "accumulate", "all_reduce_sum", "clip_grad_norm_", "eval_loader",
    "find_batch_requested", "find_micro_batch", "fingerprint", "full_state_dict", "init", "loader", "optimizer", "print0", "profile",
    "scale_lr", "scale_recipe", "token_divisor", "unwrap", "warmup", "wrap",
]


def test_all_is_the_deliberate_list_and_every_name_resolves():
    assert sorted(mg.__all__) == sorted(PUBLIC)
    for name in mg.__all__:
        assert getattr(mg, name) is not None, name


def test_import_has_no_side_effects():
    code = ("import os, sys; env = dict(os.environ); import multigpu, torch.distributed as d; "
            "assert not d.is_initialized(); assert dict(os.environ) == env; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip() == "ok"
