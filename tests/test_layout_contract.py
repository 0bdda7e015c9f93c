"""The layout contract: a script reads its Layout from its command line, and verify and tune run it in any layout."""

from __future__ import annotations

from pathlib import Path

import pytest

import multigpu as mg
from multigpu.parallel.flags import parse_layouts

from _cli import run_cli


def test_layout_from_args_reads_every_flag_and_leaves_the_rest():
    layout, rest = mg.layout_from_args(["--tp", "2", "--steps", "5", "--pp=2", "--dp-replicate", "1", "--dp-shard", "2",
                                        "--micro-batch", "4", "--activation-checkpointing", "--schedule", "gpipe",
                                        "--compile", "--sequence-parallel", "--seed", "3"])
    assert layout == mg.parallel.Layout(tp=2, pp=2, dp_replicate=1, dp_shard=2, micro_batch=4,
                                        activation_checkpointing=True, schedule="gpipe", compile=True,
                                        sequence_parallel=True)
    assert rest == ["--steps", "5", "--seed", "3"]
    # a flag left out keeps the script's default; none given is one process's layout
    assert mg.layout_from_args(["--tp", "2"], default=mg.parallel.Layout(micro_batch=2))[0].micro_batch == 2
    assert mg.layout_from_args([]) == (mg.parallel.Layout(), [])
    # the script's own flags are never read as abbreviations of the layout's
    assert mg.layout_from_args(["--sched", "x"])[1] == ["--sched", "x"]


def test_layout_flags_round_trip_through_the_verbs_spelling():
    layouts = parse_layouts("tp=2; dp_shard=2,tp=2 ;pp=2,micro_batch=1,schedule=gpipe;dp_replicate=2,activation_checkpointing=true;"
                            "tp=2,sequence_parallel=true;dp_replicate=2,zero1=true;dp_shard=2,activation_checkpointing=true,checkpoint_blocks=2")
    assert [l.world_size for l in layouts] == [2, 4, 2, 2, 2, 2, 2]
    assert [l.label for l in layouts] == ["tp=2", "dp_shard=2,tp=2", "pp=2,micro_batch=1,schedule=gpipe",
                                              "dp_replicate=2,activation_checkpointing=true",
                                              "tp=2,sequence_parallel=true", "dp_replicate=2,zero1=true",
                                              "dp_shard=2,activation_checkpointing=true,checkpoint_blocks=2"]
    for layout in layouts:
        assert mg.layout_from_args(layout.flags) == (layout, [])
    # ZeRO-1 shards DDP's optimizer state over the replicas: beside tp (pp, ep) a layout describes it and multigpu
    # does not build it, the one line (Layout.unbuilt) its builders raise, the mesh's too; beside FSDP's shards
    # (dp_shard filled by the world too) it is no layout at all, refused as it is made
    layout = mg.parallel.Layout(zero1=True, dp_replicate=2, tp=2).resolve(4)
    assert "beside tp 2 is not built yet; use dp_replicate alone with zero1" in layout.unbuilt()
    with pytest.raises(mg.UsageError, match="beside tp 2 is not built yet"):
        layout.device_mesh("cpu")
    for fsdp in ({}, {"dp_shard": 2}, {"cp": 2}):
        with pytest.raises(mg.UsageError, match=r"zero1 shards DDP's optimizer state over the replicas, but FSDP \("):
            mg.parallel.Layout(zero1=True, **fsdp).resolve(4)
    assert parse_layouts("pp=2,cp=2")[0].unbuilt().startswith("context parallelism (cp 2) with pp is not built yet")


@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "0"], "--tp takes a positive integer, got '0'; use e.g. --tp 2"),
    (["--micro-batch", "x"], "--micro-batch takes a positive integer, got 'x'"),
    (["--schedule", "zigzag"], "--schedule takes one of gpipe, 1f1b"),
    (["--pp"], "argument --pp: expected one argument"),
    # a layout multigpu does not build yet: the script would spread by it (Layout.unbuilt's line)
    (["--cp", "2", "--pp", "2"], "context parallelism (cp 2) with pp is not built yet; use cp with dp_shard, "
                                 "dp_replicate and tp, or drop one of them"),
    (["--zero1", "--tp", "2"], "zero1 (DDP's optimizer state sharded over the replicas) beside tp 2 is not built"),
    (["--zero1", "--dp-shard", "2"], "zero1 shards DDP's optimizer state over the replicas, but FSDP (dp_shard 2"),
])
def test_bad_layout_flags_are_one_line(argv, fragment):
    with pytest.raises(mg.UsageError) as err:
        mg.layout_from_args(argv)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, fragment", [
    ("tp=0", '--layouts tp takes a positive integer, got \'0\'; use e.g. --layouts "tp=2"'),
    ("tpp=2", "--layouts takes field=value pairs of"),
    (";", "--layouts names no layout"),
    ("pp=2,schedule=zigzag", "unknown pipeline schedule 'zigzag'"),
    ("activation_checkpointing=maybe", "activation_checkpointing takes true or false"),
])
def test_bad_layouts_are_one_line(text, fragment):
    with pytest.raises(mg.UsageError) as err:
        parse_layouts(text)
    assert fragment in str(err.value) and "\n" not in str(err.value)


SCRIPT = str(Path(__file__).with_name("_layout_script.py"))


def test_bad_verify_layouts_are_one_line(tmp_path, capsys, monkeypatch):
    from multigpu import verify

    monkeypatch.chdir(tmp_path)
    for argv, fragment in ((["--layouts", "tp=x", SCRIPT], "--layouts tp takes a positive integer, got 'x'"),
                           (["--layouts", "tp=2", "--workers", "1,4", SCRIPT], "pass one"),
                           (["--layouts", "tp=2;tp=2", SCRIPT], "names a layout twice"),
                           (["--layouts", "tp=2", SCRIPT, "--tp", "2"], "--layouts sets --tp itself; drop it"),
                           (["--layouts", "tp=2;pp=2,cp=2", SCRIPT], "context parallelism (cp 2) with pp is not built"),
                           (["--layouts", "dp_shard=2", "--global-batch", "3", SCRIPT],
                            "global batch 3 does not split over the 2 data-parallel ranks of layout dp_shard=2; use --global-batch 2 or 4 (a multiple of 2)")):
        code, err = run_cli(["verify", "--cpu", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err and "Traceback" not in err, err
    # a layout for more ranks than the job has: refused before anything starts on GPUs ...
    monkeypatch.setattr(verify, "_visible_gpus", lambda cpu: 2)
    code, err = run_cli(["verify", "--layouts", "dp_shard=2,tp=2", SCRIPT], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "layout dp_shard=2,tp=2 spans 4 processes but 2 GPUs are visible; give a layout of at most 2 or use --cpu" in err


def test_a_layout_for_more_ranks_than_the_job_is_refused_in_one_line_by_the_script(tmp_path):
    # ... and by the script itself (the contract's Layout), as verify and tune report a failed run
    from multigpu.launch.once import run_once

    done = run_once(SCRIPT, ["--tp", "2", "--dp-shard", "2", "--steps", "1"], module=False, log_dir=tmp_path, nproc=1,
                    cpu=True)
    assert done.exit_code == 2, done.console.read_text()
    assert "mesh dp_replicate 1 x dp_shard 2 x tp 2 = 4 processes, but this job has 1; run on 4 processes" in done.failure()


@pytest.mark.slow
def test_verify_layouts_compares_each_layout_of_the_users_script_with_one_process(tmp_path):
    from multigpu.verify import verify

    said: list[str] = []
    report = verify(SCRIPT, layouts="tp=2;dp_shard=2;pp=2,micro_batch=2", steps=3, cpu=True, out=str(tmp_path),
                    say=said.append)
    assert report["same"] and report["reference"] == "one process" and list(report["comparisons"]) == [
        "tp=2", "dp_shard=2", "pp=2,micro_batch=2"], said
    for c in report["comparisons"].values():
        # float64: the loss as the meter logs it (fp32) and the parameters to rounding
        assert c["steps"] == 3 and c["largest_loss_rel"] < 1e-6 and c["final_rel"] < 1e-9 and c["first_data_step"] is None, c
    assert any(s.startswith("  layout tp=2 (2 processes) vs one process: SAME over 3 steps") for s in said), said


def test_bad_tune_input_for_a_script_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, fragment in ((["missing.py"], "tune knows the layouts of the GPT recipe"),
                           ([SCRIPT, "--tp", "2"], "tune chooses --tp itself; drop it"),
                           ([SCRIPT, "--steps=3"], "tune chooses --steps itself"),
                           (["--memory-budget", "1GiB", SCRIPT], "drop --memory-budget"),
                           (["--seq-len", "64", SCRIPT], "--seq-len serves the prediction of a script's layouts, "
                                                         "which needs its model: add --model"),
                           (["--model", "m.py:f", SCRIPT, "--global-batch", "8"], "add --seq-len N"),
                           (["--model", "m.py:f", "--seq-len", "8", SCRIPT], "pass the script's --global-batch N"),
                           (["--model", "m.py:f", "--seq-len", "8", SCRIPT, "--global-batch=x"],
                            "--global-batch takes a positive number of sequences, got 'x'"),
                           (["--model", "nope.py:f", "--seq-len", "8", SCRIPT, "--global-batch", "8"],
                            "--model nope.py:f: cannot load f from nope.py")):
        code, err = run_cli(["tune", "--cpu", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_tune_enumerates_every_layout_through_the_mesh_factoring():
    from multigpu.parallel.space import layouts

    found = layouts(4, micro_batches=[2, 4])
    shapes = {(l.pp, l.dp_replicate, l.dp_shard, l.tp) for l in found}
    assert len(shapes) == 10 and all(a * b * c * d == 4 for a, b, c, d in shapes)  # ordered factorings of 4
    assert len(found) == 20 and {l.micro_batch for l in found} == {2, 4}
    assert [l.label for l in layouts(2)] == ["dp_shard=2", "tp=2", "dp_replicate=2", "pp=2"]
    # a mixture of experts (tune --experts): each ep of tp x a divisor of dp_shard too, beside FSDP, TP, HSDP
    # and PP
    moe = [l.label for l in layouts(4, experts=True) if l.ep > 1]
    assert moe == ["dp_shard=4,ep=2", "dp_shard=4,ep=4", "dp_shard=2,tp=2,ep=2", "dp_shard=2,tp=2,ep=4", "tp=4,ep=4",
                   "dp_replicate=2,dp_shard=2,ep=2", "dp_replicate=2,tp=2,ep=2", "pp=2,dp_shard=2,ep=2",
                   "pp=2,tp=2,ep=2"]
    assert len(layouts(4, experts=True)) == 10 + 9
    # long sequences (tune --context): each cp of what dp_replicate and tp leave, without a pipeline
    long = [l.label for l in layouts(4, context=True) if l.cp > 1]
    assert long == ["dp_shard=2,cp=2", "cp=4", "cp=2,tp=2", "dp_replicate=2,cp=2"]
    # what multigpu does not build yet is never proposed (Layout.unbuilt, the builders' one rule); described (the
    # forecast of a named layout) it is: cp beside a pipeline, ZeRO-1 of the replicas beside tp or pp
    every = layouts(8, context=True, zero1=True, experts=True, schedules=("1f1b", "interleaved_1f1b"))
    assert len(every) > 40 and not [l.label for l in every if l.unbuilt()]
    described = {l.label for l in layouts(4, context=True, zero1=True, described=True) if l.unbuilt()}
    assert described == {"pp=2,cp=2", "dp_replicate=2,tp=2,zero1=true", "pp=2,dp_replicate=2,zero1=true"}


@pytest.mark.slow
def test_tune_measures_every_layout_of_the_users_script_and_picks_the_fastest(tmp_path):
    import json

    from multigpu.tune import TuneConfig, run_tune

    said: list[str] = []
    out, report = run_tune(TuneConfig(SCRIPT, ("--global-batch", "16"), nproc=2, cpu=True, top=2, repeats=2, steps=6,
                                      out=str(tmp_path / "tune")), say=said.append)
    saved = json.loads((out / "tune.json").read_text())
    assert (out / "report.md").is_file() and saved["winner"] == report["winner"]
    assert set(saved) == {"workload", "world_size", "device", "threads_per_worker", "steps", "repeats", "top",
                          "candidates", "left_out", "winner", "command", "verdict", "wall_s"}  # the recipe's, unpredicted
    rows = saved["candidates"]
    assert sorted(r["candidate"] for r in rows) == ["dp_replicate=2", "dp_shard=2", "pp=2", "tp=2"]
    assert all(r["result"] for r in rows) and saved["left_out"] == []
    assert sorted(len(r["measured"]) for r in rows) == [1, 1, 2, 2]  # every layout once, the 2 fastest again
    assert rows == sorted(rows, key=lambda r: r["result"]["step_time_s"]) and saved["winner"] == rows[0]["candidate"]
    assert saved["command"].startswith(f"multigpu run -n 2 --cpu {SCRIPT} --global-batch 16")
    assert saved["command"].endswith(" ".join(rows[0]["args"])) and report["verdict"] in said
    # Each run's memory: a warm-up step's real peak, the largest rank's (its StepMeter, asked by tune). DDP keeps
    # whole float64 states (weights, gradients, their bucket copy, AdamW's two moments: 5 x 8 x 1,120 bytes) and
    # the data beside them.
    memory = {r["candidate"]: r["result"]["memory_bytes"] for r in rows}
    assert memory["dp_replicate=2"] >= 5 * 8 * 1120 + 256 * 8 * 8 * 2, memory
    assert all(0 < m < 2**20 for m in memory.values()), memory


def test_noise_scale_reads_the_layout_instead_of_inferring_tp():
    from torch import nn

    from multigpu.noise.layout import tp_degree

    assert tp_degree(None, 4, 2) == 2  # the old guess: world / the plan's ranks
    assert tp_degree(mg.parallel.Layout(), 1, 1) == 1
    # the guess would read 2 pipeline stages as TP 2; the layout says what they are
    with pytest.raises(mg.UsageError, match=r"NoiseScale does not measure pipeline stages \(pp 2\)"):
        tp_degree(mg.parallel.Layout(pp=2), 4, 2)
    assert tp_degree(mg.parallel.Layout(tp=2), 4, 2) == 2
    with pytest.raises(mg.UsageError, match="the layout has 2 .* build the plan with layout.plan"):
        tp_degree(mg.parallel.Layout(tp=2), 4, 4)
    with pytest.raises(mg.UsageError, match=r"attach\(layout=\) takes the mg.parallel.Layout"):
        mg.NoiseScale(mg.BatchPlan(64, 1, micro_batch=8)).attach(nn.Linear(2, 2), layout="tp=2")
    with pytest.raises(mg.UsageError, match=r"^NoiseScale.attach\(mesh=\) is gone; pass layout= the Layout"):
        mg.NoiseScale(mg.BatchPlan(64, 1, micro_batch=8)).attach(nn.Linear(2, 2), mesh=mg.parallel.Layout())
    noise = mg.NoiseScale(mg.BatchPlan(64, 1, micro_batch=8)).attach(nn.Linear(2, 2), layout=mg.parallel.Layout())
    assert noise._kind == "micro"
    # mg.parallelize keeps the layout it spread the model by (beside it, nothing stamped on the module), and
    # NoiseScale reads it without being told
    from multigpu.spreads import remember, spread_of

    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = dict(net.__dict__)
    spread = mg.parallelize(net, mg.parallel.Layout(micro_batch=8), verbose=False)
    assert spread_of(spread).layout == mg.parallel.Layout(dp_shard=1, micro_batch=8) and net.__dict__ == before
    assert mg.NoiseScale(mg.BatchPlan(64, 1, micro_batch=8)).attach(spread)._kind == "micro"
    piped = nn.Linear(2, 2)
    remember(piped, layout=mg.parallel.Layout(pp=2))
    with pytest.raises(mg.UsageError, match=r"does not measure pipeline stages \(pp 2\)"):
        tp_degree(None, 4, 2, piped)
