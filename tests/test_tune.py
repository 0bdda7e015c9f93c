"""`multigpu tune`: the candidates, the cost model's counting, and a real tune on 2 CPU ranks."""

from __future__ import annotations

import json

import pytest

from multigpu.errors import UsageError
from multigpu.recipes.gpt.model import config
from multigpu.tune import TuneConfig, run_tune
from multigpu.tune.model import Links, Shape, predict
from multigpu.tune.space import Candidate, candidates


def test_candidates_cover_every_layout_that_computes_the_same_training_and_say_why_others_are_out():
    found, out = candidates(4, config("tiny"), 16)
    names = {c.name.split(",")[0] for c in found}
    assert names == {"DDP 4", "FSDP 4", "HSDP 2x2", "FSDP 2 x TP 2", "TP 4"}
    assert {o["reason"] for o in out} == {"a pipeline puts the token table and the head on two stages: the model must be "
                                          "untied (--untied)"}
    assert all(16 % (c.dp_size * c.micro_batch) == 0 for c in found)
    untied, out = candidates(4, config("tiny", tie_embeddings=False), 16, micro_batches=[4, 8])
    pipes = [c for c in untied if c.pp > 1]
    assert {(c.pp, c.tp, c.schedule) for c in pipes} == {(2, 1, "1f1b"), (2, 1, "gpipe"), (2, 2, "1f1b"), (2, 2, "gpipe")}
    assert any("2 blocks" in o["reason"] for o in out)  # PP 4 on a 2-block model
    assert any(o["reason"] == "1 micro-batches per step, fewer than 2 stages" for o in out)
    c = Candidate("hsdp", 2, 2, 1, 1, 4, True)
    assert c.args() == ["--micro-batch", "4", "--dp-replicate", "2", "--dp-shard", "2", "--activation-checkpointing"]
    with pytest.raises(UsageError, match="no layout of 3 ranks fits this model and global batch 16"):
        candidates(3, config("tiny"), 16)


def test_the_cost_model_counts_sharding_bubbles_and_communication():
    cfg = config("tiny", tie_embeddings=False)
    shape = Shape.of(cfg)
    assert shape.parameters == cfg.parameters
    part = {"time_s": 0.010, "optimizer_s": 0.002, "activation_bytes": 1000}
    compute = {(m, ac): part for m in (1, 2, 4, 8) for ac in (False, True)}
    # 1 ms latency below 1 KB, then 1 GB/s, for every op and group size.
    links = Links({(op, n): [(1000, 1e-3), (10**6, 1e-3 + 1e-3)] for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                                          "broadcast") for n in (2, 4)})
    ddp = predict(Candidate("ddp", 4, 1, 1, 1, 2, False), shape, 16, compute, links)
    fsdp = predict(Candidate("fsdp", 1, 4, 1, 1, 2, False), shape, 16, compute, links)
    assert ddp["state_bytes"] == 16 * shape.parameters and fsdp["state_bytes"] == pytest.approx(4 * shape.parameters)
    assert ddp["compute_s"] == pytest.approx(2 * 0.010 + 0.002)  # 2 micro-batches of 2 per rank, one optimizer step
    grads = 4 * shape.parameters
    assert ddp["comm"]["all_reduce (gradients)"] == pytest.approx(links.time("all_reduce", 4, grads))
    # FSDP per micro-batch (2 here): each of the 2 blocks gathered twice (forward, backward), the root once.
    block = 4 * (shape.block_sharded + shape.block_replicated)
    root = grads - 2 * block
    assert fsdp["comm"]["all_gather (weights)"] == pytest.approx(
        2 * (4 * links.time("all_gather", 4, block) + links.time("all_gather", 4, root)))
    assert fsdp["comm"]["reduce_scatter (gradients)"] == pytest.approx(
        2 * links.time("reduce_scatter", 4, block) + links.time("reduce_scatter", 4, root))
    slow = predict(Candidate("ddp", 4, 1, 1, 1, 2, False), shape, 16, compute, links, slowdown=2.0)
    assert slow["compute_s"] == pytest.approx(2 * ddp["compute_s"])  # 4 one-thread workers on 2 cores
    pipe = predict(Candidate("fsdp", 1, 2, 1, 2, 2, False, "1f1b"), shape, 16, compute, links)
    gpipe = predict(Candidate("fsdp", 1, 2, 1, 2, 2, False, "gpipe"), shape, 16, compute, links)
    assert pipe["compute_s"] > 0.5 * (4 * 0.010)  # (m + p - 1) slots of half the model: the bubble
    assert gpipe["activation_bytes"] == 2 * pipe["activation_bytes"]  # 4 micro-batches in flight against 2
    tp = predict(Candidate("fsdp", 1, 2, 2, 1, 2, False), shape, 16, compute, links)
    assert tp["activation_bytes"] == pytest.approx(ddp["activation_bytes"] / 2) and "all_reduce (tensor parallel)" in tp["comm"]
    # Beyond the largest size: the bandwidth between the two largest; inside: log-log; below: the smallest's time.
    assert links.time("all_reduce", 2, 10**7) == pytest.approx(2e-3 + 9e6 * 1e-3 / 999_000)
    assert links.time("all_reduce", 2, 10**4.5 * 10**0) == pytest.approx(10 ** (-3 + 0.5 * 0.30103), rel=1e-3)
    assert links.time("all_reduce", 2, 10) == 1e-3 and links.time("all_reduce", 1, 10**6) == 0.0


def test_refusals_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)
    for argv, expected in (
        (["gpt", "--tp", "2"], "tune chooses --tp itself; drop them"),
        (["train.py"], "tune knows the layouts of the GPT recipe"),
        (["--top", "0", "gpt"], "--top takes a number of candidates (at least 1) or 'all', got '0'"),
        (["-n", "3", "gpt"], "no layout of 3 ranks fits this model and global batch 16"),
    ):
        code = main(["tune", "--cpu", *argv])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.slow
def test_tune_on_two_cpu_ranks_measures_the_top_candidates_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lines = []
    out, report = run_tune(TuneConfig("gpt", ("--global-batch", "16"), nproc=2, cpu=True, top=2, repeats=1, steps=6,
                                      out=str(tmp_path / "tune"), micro_batches=(4, 8)), say=lines.append)
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    saved = json.loads((out / "tune.json").read_text())
    assert saved["winner"] == report["winner"] and len(saved["candidates"]) == 12
    measured = [c for c in saved["candidates"] if c["measured"]]
    assert len(measured) == 2 and all(c["result"] for c in measured)  # the 2 fastest predicted, both ran
    preds = [c["predicted"]["step_time_s"] for c in saved["candidates"]]
    assert preds == sorted(preds) and measured == saved["candidates"][:2]
    winner = min(measured, key=lambda c: c["result"]["step_time_s"])
    assert saved["winner"] == winner["candidate"] and " ".join(winner["args"]) in saved["command"]
    for c in measured:  # the memory count is the recipe's own: state exactly, activations of its first step
        assert abs(c["error"]["memory"]) < 0.3, c
    assert "measuring the links on 2 ranks" in "\n".join(lines)
    assert report["verdict"] in lines
    # The next tune reads the links from the cache.
    from multigpu.tune import probe

    assert probe.links({2}, "cpu", 1)[1][2].startswith("cached ")
