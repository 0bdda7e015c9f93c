"""`multigpu study --layouts`: a user's script studied in each layout (on the ranks it spans) against one worker.

The plan (which runs, with which flags and global batches) and the refusals are checked in this process; one
real study of tests/_layout_script.py runs the script in two layouts on gloo ranks and reads its meter back.
"""

from pathlib import Path

import pytest

from _cli import run_cli
from multigpu.study.measure import label, summarize
from multigpu.study.run import StudyConfig, plan_runs, run_study

SCRIPT = str(Path(__file__).with_name("_layout_script.py"))


def test_layouts_plan_one_worker_then_each_layout_with_its_flags_and_data_parallel_batch():
    cfg = StudyConfig(SCRIPT, workers=(1,), layouts="dp_shard=2;tp=2;dp_shard=2,tp=2", policies=("keep-global", "scale-global"),
                      global_batch=8, steps=8)
    by_id = {s.id: s for s in plan_runs(cfg, None)}
    assert list(by_id) == ["w1-gb8-r0", "w2-dp-shard2-gb8-r0", "w2-dp-shard2-gb16-r0", "w2-tp2-gb8-r0",
                           "w4-dp-shard2-tp2-gb8-r0", "w4-dp-shard2-tp2-gb16-r0"]
    # keep-global and scale-global coincide for TP 2 alone: one data-parallel rank, the same global batch
    assert by_id["w2-tp2-gb8-r0"].policies == ("keep-global", "scale-global")
    assert by_id["w2-tp2-gb8-r0"].args[:2] == ("--tp", "2") and by_id["w2-tp2-gb8-r0"].layout == "tp=2"
    four = by_id["w4-dp-shard2-tp2-gb16-r0"]
    assert four.workers == 4 and four.steps == 4  # scale-global: 2 data-parallel ranks double the batch, halve the steps
    assert list(four.args) == ["--tp", "2", "--dp-shard", "2", "--global-batch", "16", "--steps", "4"]
    assert "--tp" not in by_id["w1-gb8-r0"].args


def test_groups_and_speedups_are_per_layout_against_the_one_worker_baseline():
    def run(workers, layout, rate, repeat=0):
        return {"workers": workers, "layout": layout, "policies": ["keep-global"], "repeat": repeat, "status": "ok",
                "global_batch": 8, "samples_per_s": rate, "step_time_s": 1.0, "final": {}, "to_target": None,
                "noise_scale": None, "breakdown": {}, "error": None}

    runs = [run(1, "", 100.0), run(2, "tp=2", 50.0), run(2, "dp_shard=2", 180.0)]
    base, tp, fsdp = summarize(runs, [(1, ""), (2, "tp=2"), (2, "dp_shard=2")], ("keep-global",))
    assert (base["speedup"], tp["speedup"]["mean"], fsdp["speedup"]["mean"]) == (None, 0.5, 1.8)
    assert fsdp["efficiency"]["mean"] == pytest.approx(0.9)
    assert [label(g) for g in (base, tp)] == ["1 worker keep-global", "2 workers tp=2 keep-global"]


@pytest.mark.parametrize("argv, fragment", [
    (["--layouts", "tp=2", "--workers", "1,2"], "--layouts runs each layout on the ranks it spans"),
    (["--layouts", "tp=2;tp=2"], "names a layout twice or one process itself"),
    (["--layouts", "tp=1"], "names a layout twice or one process itself"),
    (["--layouts", "tp=x"], "--layouts tp takes a positive integer, got 'x'"),
    (["--layouts", "dp_shard=2", "--global-batch", "3"],
     "global batch 3 does not split over 2 data-parallel ranks (layout dp_shard=2)"),
    (["--layouts", "tp=2", "{script}", "--", "--tp", "2"], "--layouts sets --tp itself; drop it"),
])
def test_bad_layout_study_input_is_one_line_exit_2(argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{script}", SCRIPT) for a in argv]
    code, err = run_cli(["study", "--cpu", *argv, *([] if SCRIPT in argv else [SCRIPT])], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and fragment in err, err
    assert not (tmp_path / "studies").exists()


@pytest.mark.slow
def test_a_layout_study_runs_the_users_script_in_each_layout(tmp_path):
    said: list[str] = []
    cfg = StudyConfig(SCRIPT, layouts="dp_shard=2;tp=2", global_batch=16, steps=4, cpu=True, profile=None,
                      out=str(tmp_path / "study"))
    out, study = run_study(cfg, say=said.append)
    groups = {g["layout"]: g for g in study["groups"]}
    assert list(groups) == ["", "dp_shard=2", "tp=2"], said
    for layout, g in groups.items():
        assert g["n_ok"] == 1 and g["n_failed"] == 0, (layout, g["errors"])
        assert g["workers"] == (2 if layout else 1)
        assert (g["speedup"] is None) == (layout == "")
    runs = {r["layout"]: r for r in study["runs"]}
    assert runs["tp=2"]["args"][:2] == ["--tp", "2"] and (Path(runs["tp=2"]["run_dir"]) / "metrics.jsonl").is_file()
    assert "2 workers tp=2 keep-global: " in study["headline"]
    from multigpu.report import write_report

    html, md = write_report(out)
    assert "| 2 tp=2 | keep-global | 16 |" in md.read_text()
