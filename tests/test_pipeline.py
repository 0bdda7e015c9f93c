"""Pipeline parallelism computes the same training as one process: schedules, and PP with FSDP and TP up to 3-D.

The GPT has 4 blocks and untied embeddings (the token table and the head sit
on different stages); 5 float64 AdamW steps of 4 micro-batches each, clipping
at 0.5 by the norm over every stage; weights within 1e-9 of one process's, the
tolerance of tests/test_model_parallel.py and for the same reason.
"""

import pytest

import multigpu as mg
from multigpu.parallel import pp
from multigpu.recipes.gpt.model import GPT, config
from multigpu.parallel.stages import split, stage_ranges
from multigpu.testing import spawn

import _gpt_layouts as layouts

MODEL = {"n_layer": 4, "tie_embeddings": False}
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]
TOL, NORM_RTOL = 1e-9, 1e-9  # float64 weights (absolute) and gradient norms (relative) after 5 steps


@pytest.fixture(scope="module")
def reference():
    return spawn(layouts.train, 1, {"model": MODEL}, accum=4)[0]


def _check(out, ref, names):
    for i, name in enumerate(names):
        for rank in out:
            got = rank[i]
            assert sorted(got["state"]) == sorted(ref["state"])  # every stage keeps the one-process names
            diff = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
            assert diff < TOL, (name, diff)
            assert got["norms"] == pytest.approx(ref["norms"], rel=NORM_RTOL), name


def test_pipeline_schedules_equal_one_process(reference):
    out = spawn(layouts.train_pipelines, 2, [{"pp": 2, "schedule": s, "model": MODEL} for s in SCHEDULES], timeout=240)
    _check(out, reference, SCHEDULES)
    assert [out[0][i]["stages"] for i in range(3)] == [[0], [0], [0, 2]]
    assert [out[1][i]["stages"] for i in range(3)] == [[1], [1], [1, 3]]
    # The mean micro-batch loss is on the last stage's rank only.
    assert all(x is None for x in out[0][0]["losses"]) and all(x is not None for x in out[1][0]["losses"])
    # Every function that takes "a model", given the pipeline, its pipe.model (one stage, or an interleaved rank's
    # two) or one stage, gives the whole model's figure or refuses in one line: mg.clip_grad_norm_ returned each
    # stage's own norm, silently.
    for rank in out:
        for run in rank:
            said = run["clip_refused"]
            names = ("pipe", "pipe.model", "stage") if "mg.accumulate(stage)" in said else ("pipe", "pipe.model")
            for name in names:
                assert "use pipe.clip_grad_norm_(max_norm)" in said[f"mg.clip_grad_norm_({name})"]
                assert "pipe.step(micro_batches)" in said[f"mg.accumulate({name})"]
                assert "NoiseScale.attach got this rank's pipeline stages (pp 2)" in said[f"NoiseScale.attach({name})"]
                assert "mg.wrap got this rank's pipeline stages" in said[f"mg.wrap({name})"]
            assert said["mg.full_state_dict(pipe)"] == said["mg.full_state_dict(pipe.model)"] == sorted(reference["state"])
            assert said["Checkpointer(pipe)"] == said["Checkpointer(pipe.model)"]  # this rank's stages, one process's names
            if "stage" in names:  # one of an interleaved rank's two stages
                assert "mg.full_state_dict(pipe)" in said["mg.full_state_dict(stage)"]
                assert "pass model=pipe.model" in said["Checkpointer(stage)"]
            assert all("\n" not in v for v in said.values() if isinstance(v, str))


def test_interleaved_pipeline_with_3_stages_per_rank_equals_one_process():
    """Virtual stages as torchtitan and Megatron run them: pp 2 x 3 stages a rank (6 stages of a 6-block GPT,
    placed 0, 2, 4 and 1, 3, 5), one process's weights and norms after 3 steps."""
    model = {"n_layer": 6, "tie_embeddings": False}
    ref = spawn(layouts.train, 1, {"model": model}, steps=3, accum=4)[0]
    layout = {"pp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 3, "model": model}
    out = spawn(layouts.train_pipeline, 2, layout, steps=3, timeout=240)
    _check([[rank] for rank in out], ref, ["interleaved_1f1b, 3 stages a rank"])
    assert [rank["stages"] for rank in out] == [[0, 2, 4], [1, 3, 5]]
    assert out[0]["mesh"] == "pp=2,micro_batch=2,schedule=interleaved_1f1b,stages_per_rank=3"


@pytest.mark.slow
def test_pipeline_with_fsdp_and_tensor_parallel_equals_one_process(reference):
    names = [{"pp": 2, "schedule": "1f1b", "model": MODEL},                      # PP 2 x FSDP 2
             {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "interleaved_1f1b", "model": MODEL}]  # PP 2 x TP 2
    out = spawn(layouts.train_pipelines, 4, names, timeout=300)
    _check(out, reference, names)
    assert out[0][0]["mesh"].startswith("pp=2,dp_shard=2,micro_batch=1")


@pytest.mark.slow
def test_three_d_pipeline_fsdp_tensor_parallel_on_8_ranks_equals_one_process(reference):
    names = [{"pp": 2, "tp": 2, "schedule": "1f1b", "model": MODEL}]          # PP 2 x FSDP 2 x TP 2
    out = spawn(layouts.train_pipelines, 8, names, timeout=400)
    _check(out, reference, names)
    assert out[0][0]["mesh"].startswith("pp=2,dp_shard=2,tp=2,micro_batch=1")


@pytest.mark.slow
def test_checkpoints_resume_across_layouts_pipelines_included(reference, tmp_path):
    """Each layout trains from the last one's checkpoint: 1F1B on 2 ranks (steps 0-1), FSDP 2 x TP 2 with
    sequence parallel (step 2), one process (step 3), the interleaved schedule, 2 stages per rank (step 4):
    the weights of one process trained alone for the 5 steps, each run starting where the loader stood."""
    ckpt = str(tmp_path / "ckpt")
    runs = [(layouts.train_pipeline, 2, {"pp": 2, "schedule": "1f1b", "model": MODEL}, [0, 1]),
            (layouts.train, 4, {"tp": 2, "sequence_parallel": True, "model": MODEL}, [2]),
            (layouts.train, 1, {"model": MODEL}, [3]),
            (layouts.train_pipeline, 2, {"pp": 2, "schedule": "interleaved_1f1b", "model": MODEL}, [4])]
    for fn, world, layout, steps in runs:
        out = spawn(fn, world, layout, accum=4, ckpt=ckpt, stop_after=steps[-1], timeout=240)
        for rank in out:   # the steps after the checkpoint's
            assert rank["norms"] == pytest.approx([reference["norms"][s] for s in steps], rel=NORM_RTOL), layout
    for rank in out:
        diff = max((rank["state"][k] - reference["state"][k]).abs().max().item() for k in reference["state"])
        assert diff < TOL, diff


def test_stages_balance_blocks_counting_embeddings_and_head():
    assert [list(r) for r in stage_ranges(8, 4)] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [list(r) for r in stage_ranges(12, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    # The GPT's blocks sit in a ModuleDict: a stage deletes the others' and sets what it does not run to None.
    model, layout = GPT(config("tiny", n_layer=4, tie_embeddings=False)), mg.parallel.Layout(pp=2, dp_shard=1)
    make, ranges, how = split(model, layout, 2)
    part = make(1)
    assert sorted(part.blocks) == ["2", "3"] and part.embed is None and part.head is not None
    assert how.startswith("its blocks ModuleDict (4 blocks")
    # Split points given: where stages 2.. begin.
    assert [list(r) for r in stage_ranges(8, 3, [2, 7])] == [[0, 1], [2, 3, 4, 5, 6], [7]]
    part = split(model, layout, 2, [3])[0](0)
    assert sorted(part.blocks) == ["0", "1", "2"] and part.head is None and part.ln_f is None
    assert sorted(model.blocks) == ["0", "1", "2", "3"]  # the model itself is left whole


def test_pipeline_refusals_are_one_line():
    from multigpu.recipes.gpt.parallelize import check_layout

    for bad in ([4], [0], [3, 2], [2]):
        with pytest.raises(mg.UsageError, match=r"split points must be 2 increasing block indices between 1 and 7"):
            stage_ranges(8, 3, bad)
    with pytest.raises(mg.UsageError, match=r"4 pipeline stages \(pp 4 x 1 per rank, schedule '1f1b'\) but the GPT has 2"):
        check_layout(config("tiny", tie_embeddings=False), mg.parallel.Layout(pp=4))
    with pytest.raises(mg.UsageError, match="the token table of the GPT is tied to its head.*--untied"):
        check_layout(config("tiny"), mg.parallel.Layout(pp=2))
    with pytest.raises(mg.UsageError, match="needs at least as many micro-batches as stages, got 1 micro-batches for 2"):
        pp.check("1f1b", 2, 1)
    assert pp.check("gpipe", 2, 1) == 2 and pp.check("interleaved_1f1b", 2, 4) == 4
    with pytest.raises(mg.UsageError, match="unknown pipeline schedule 'pipedream'"):
        pp.check("pipedream", 2, 4)
    with pytest.raises(mg.UsageError, match="pp 2 x dp_replicate 1 x tp 1 = 2"):
        mg.parallel.Layout(pp=2).resolve(3)
    assert pp.stage_ids("zbv", 0, 2) == [0, 3] and pp.stage_ids("looped_bfs", 1, 2) == [1, 3]


def test_stages_per_rank_is_the_layouts_and_refused_where_the_schedule_cannot_run_it():
    from multigpu.parallel.flags import parse_layouts
    from multigpu.recipes.gpt.parallelize import check_layout

    Layout = mg.parallel.Layout
    (layout,) = parse_layouts("pp=2,schedule=interleaved_1f1b,stages_per_rank=3")
    assert layout.stages == 6 and Layout(pp=2, schedule="interleaved_1f1b").stages == 4
    assert mg.layout_from_args(layout.flags) == (layout, [])  # the flags a verb passes read back the same
    assert pp.stage_ids("looped_bfs", 1, 2, 3) == [1, 3, 5] and pp.check("interleaved_1f1b", 2, 4, 3) == 6
    assert layout.resolve(2).data_share(1).counts and not layout.resolve(2).data_share(0).counts  # 5 is on rank 1
    for bad, said in [
        ({"stages_per_rank": 2}, "pipeline schedule '1f1b' runs 1 stage per rank, got stages_per_rank=2; leave "
         "stages_per_rank out, or use a looped schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble) for 2 "
         "per rank"),
        ({"schedule": "zbv", "stages_per_rank": 3}, "pipeline schedule 'zbv' places 2 stages per rank in a V, got "
         "stages_per_rank=3; leave stages_per_rank out, or use a looped schedule"),
        ({"schedule": "looped_bfs", "stages_per_rank": 0}, "stages_per_rank must be a positive integer, got 0; use "
         "e.g. stages_per_rank=3 with schedule 'interleaved_1f1b', or leave it out for the schedule's own"),
    ]:
        with pytest.raises(mg.UsageError) as err:
            Layout(pp=2, **bad)
        assert str(err.value).startswith(said) and "\n" not in str(err.value)
    with pytest.raises(mg.UsageError, match=r"--layouts stages_per_rank takes a positive integer, got '0'"):
        parse_layouts("pp=2,schedule=interleaved_1f1b,stages_per_rank=0")
    # The block count is checked against the stages the layout runs: 6, not the schedule's 4.
    with pytest.raises(mg.UsageError, match=r"6 pipeline stages \(pp 2 x 3 per rank, schedule 'interleaved_1f1b'\) "
                       r"but the GPT has 4 blocks; use pp <= 1, stages_per_rank <= 2 or a deeper model"):
        check_layout(config("tiny", n_layer=4, tie_embeddings=False), layout)
    # The forecast leaves it out by the same count.
    from types import SimpleNamespace

    from multigpu.forecast.cost import Run
    from multigpu.forecast.plan import _why_not

    counts = SimpleNamespace(heads=0, kv_heads=0, experts=0, layers=4)
    assert _why_not(counts, layout.resolve(2), Run(global_batch=4, seq_len=8)) == (
        "6 pipeline stages (interleaved_1f1b) exceed the 4 blocks")


@pytest.mark.gpu
def test_pipeline_paths_import_and_refuse_cleanly_on_one_gpu(tmp_path):
    """One GPU holds one stage: the recipe's pipeline mode is refused in one line, exit 2, before any NCCL work."""
    import subprocess
    import sys

    import torch.distributed.pipelining  # noqa: F401 - the CUDA build's pipelining imports

    proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", "1", "--log-dir", str(tmp_path), "-m",
                           "multigpu.recipes.gpt", "--pp", "2", "--untied", "--steps", "2"],
                          capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("multigpu: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "world size 1 is not divisible by pp 2" in errors[0]
    assert "Traceback" not in proc.stderr
