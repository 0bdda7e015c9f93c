"""`multigpu tune`: the candidates, the cost model's counting, and a real tune on 2 CPU ranks."""

from __future__ import annotations

import json

import pytest

from multigpu.errors import UsageError
from multigpu.recipes.gpt.model import config
from multigpu.tune import TuneConfig, run_tune
from multigpu.tune.model import Links, Shape, predict
from multigpu.parallel.layout import Layout
from multigpu.tune.space import candidates, name


def test_candidates_cover_every_layout_that_computes_the_same_training_and_say_why_others_are_out():
    found, out = candidates(4, config("tiny"), 16)
    names = {name(c).split(",")[0] for c in found}
    assert names == {"DDP 4", "FSDP 4", "HSDP 2x2", "FSDP 2 x TP 2", "TP 4"}
    assert {o["reason"] for o in out} == {"the token table of the GPT is tied to its head, but a pipeline puts them on "
                                          "different stages; untie them (the GPT recipe: --untied) or use pp=1"}
    assert all(16 % (c.dp_size * c.micro_batch) == 0 for c in found)
    untied, out = candidates(4, config("tiny", tie_embeddings=False), 16, micro_batches=[4, 8])
    pipes = [c for c in untied if c.pp > 1]
    assert {(c.pp, c.tp, c.schedule) for c in pipes} == {(2, 1, "1f1b"), (2, 1, "gpipe"), (2, 2, "1f1b"), (2, 2, "gpipe")}
    assert any("2 blocks" in o["reason"] for o in out)  # PP 4 on a 2-block model
    assert any(o["reason"] == "1 micro-batches per step, fewer than 2 stages" for o in out)
    c = Layout(dp_replicate=2, dp_shard=2, micro_batch=4, activation_checkpointing=True)
    assert name(c) == "HSDP 2x2, micro-batch 4, AC" and c.flags == ["--dp-replicate", "2", "--dp-shard", "2", "--micro-batch", "4", "--activation-checkpointing"]
    # The accumulation is the BatchPlan's, over the Layout's data-parallel ranks.
    assert c.world_size == 4 and c.accum_steps(32) == 2 and Layout(tp=2, micro_batch=2).accum_steps(16, world_size=4) == 4
    assert Layout(tp=2).world_size is None
    with pytest.raises(UsageError, match="leaves dp_shard to the world size"):
        Layout(micro_batch=2).accum_steps(16)
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
    ddp = predict(Layout(dp_replicate=4, dp_shard=1, micro_batch=2), shape, 16, compute, links)
    fsdp = predict(Layout(dp_shard=4, micro_batch=2), shape, 16, compute, links)
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
    slow = predict(Layout(dp_replicate=4, dp_shard=1, micro_batch=2), shape, 16, compute, links, slowdown=2.0)
    assert slow["compute_s"] == pytest.approx(2 * ddp["compute_s"])  # 4 one-thread workers on 2 cores
    pipe = predict(Layout(dp_shard=2, pp=2, micro_batch=2, schedule="1f1b"), shape, 16, compute, links)
    gpipe = predict(Layout(dp_shard=2, pp=2, micro_batch=2, schedule="gpipe"), shape, 16, compute, links)
    assert pipe["compute_s"] > 0.5 * (4 * 0.010)  # (m + p - 1) slots of half the model: the bubble
    assert gpipe["activation_bytes"] == 2 * pipe["activation_bytes"]  # 4 micro-batches in flight against 2
    tp = predict(Layout(dp_shard=2, tp=2, micro_batch=2), shape, 16, compute, links)
    assert tp["activation_bytes"] == pytest.approx(ddp["activation_bytes"] / 2) and "all_reduce (tensor parallel)" in tp["comm"]
    # Beyond the largest size: the bandwidth between the two largest; inside: log-log; below: the smallest's time.
    assert links.time("all_reduce", 2, 10**7) == pytest.approx(2e-3 + 9e6 * 1e-3 / 999_000)
    assert links.time("all_reduce", 2, 10**4.5 * 10**0) == pytest.approx(10 ** (-3 + 0.5 * 0.30103), rel=1e-3)
    assert links.time("all_reduce", 2, 10) == 1e-3 and links.time("all_reduce", 1, 10**6) == 0.0


def test_refusals_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)
    for argv, expected in (
        (["gpt", "--tp", "2"], "tune chooses --tp itself; drop it"),
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


def test_the_measured_fixed_costs_and_the_collectives_waits_add_in():
    from multigpu.tune.model import family

    shape = Shape.of(config("tiny"))
    part = {"time_s": 0.010, "optimizer_s": 0.002, "activation_bytes": 1000}
    compute = {(m, ac): part for m in (2, 4) for ac in (False, True)}
    links = Links({(op, n): [(1000, 1e-3), (10**6, 2e-3)] for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                                     "broadcast") for n in (2, 4)})
    fixed = {f"{f}{ac}": {"micro_s": 0.001 * (i + 1), "step_s": 0.01 * (i + 1)}
             for i, f in enumerate(("none", "ddp", "fsdp", "tp", "fsdp+tp")) for ac in ("", "+ac")}
    sync = {2: 0.004, 4: 0.006}
    floor = links.time("all_reduce", 4, 1024)  # the sync probe's own 1 KiB transfer, which the links count
    layouts = {"ddp": Layout(dp_replicate=4, dp_shard=1, micro_batch=2), "fsdp": Layout(dp_shard=4, micro_batch=2),
               "hsdp": Layout(dp_replicate=2, dp_shard=2, micro_batch=2), "tp": Layout(dp_shard=1, tp=4, micro_batch=4),
               "fsdp+tp": Layout(dp_shard=2, tp=2, micro_batch=4, activation_checkpointing=True)}
    assert {k: family(v) for k, v in layouts.items()} == {"ddp": "ddp", "fsdp": "fsdp", "hsdp": "fsdp", "tp": "tp",
                                                          "fsdp+tp": "fsdp+tp"}
    for key, layout in layouts.items():
        bare = predict(layout, shape, 16, compute, links, 2.0)
        full = predict(layout, shape, 16, compute, links, 2.0, fixed, sync)
        assert bare["overhead_s"] == 0.0 and bare["overhead"] == {}
        m = layout.accum_steps(16)
        f = fixed[family(layout) + ("+ac" if layout.activation_checkpointing else "")]
        assert full["overhead"]["wrapper (per micro-batch)"] == pytest.approx(m * f["micro_s"] * 2.0)  # slowdown 2
        assert full["overhead"]["loop and wrapper (per step)"] == pytest.approx(f["step_s"] * 2.0)
        waits = sum(n * (sync[g] - links.time("all_reduce", g, 1024)) for g, n in full["collectives"].items())
        assert full["overhead"]["collectives' waits"] == pytest.approx(waits)
        assert full["step_time_s"] == pytest.approx(bare["step_time_s"] + full["overhead_s"])
        assert full["compute_s"] == bare["compute_s"] and full["comm_s"] == bare["comm_s"]
    # The collectives counted per step: DDP one bucket and the token count, on the 4 ranks.
    ddp = predict(layouts["ddp"], shape, 16, compute, links, 1.0, fixed, sync)
    assert ddp["collectives"] == {4: 2} and ddp["overhead"]["collectives' waits"] == pytest.approx(2 * (0.006 - floor))
    # FSDP 4, 2 micro-batches of 2 blocks: 5 gathers each, 3 reduce-scatters, the norm, the token count.
    assert predict(layouts["fsdp"], shape, 16, compute, links, 1.0, fixed, sync)["collectives"] == {4: 2 * 5 + 3 + 1 + 1}
    # HSDP 2x2: the same on the shard groups of 2, an all-reduce per unit on the replica groups, the count on 4.
    assert predict(layouts["hsdp"], shape, 16, compute, links, 1.0, fixed, sync)["collectives"] == {2: 2 * 5 + 3 + 1 + 3,
                                                                                                    4: 1}
    # TP 4, 4 micro-batches: per block 6 all-reduces, 2 for the table and head, the logits' gather; the norm.
    assert predict(layouts["tp"], shape, 16, compute, links, 1.0, fixed, sync)["collectives"] == {4: 4 * (6 * 2 + 3) + 1 + 1}
    # Under activation checkpointing the forward's 2 all-reduces per block run again in the backward.
    tp_ac = predict(layouts["fsdp+tp"], shape, 16, compute, links, 1.0, fixed, sync)["collectives"]
    assert tp_ac[2] == (2 * 5 + 3 + 1) + (2 * (8 * 2 + 3) + 1) and tp_ac[4] == 1  # 2 micro-batches of 4


def test_the_rounds_interleave_retry_with_checkpointing_and_read_the_workers_refusal(tmp_path):
    import json as _json

    from multigpu.tune import rounds
    from multigpu.tune.script import _row, with_checkpointing

    rows = [_row(Layout(dp_shard=2, micro_batch=m)) for m in (1, 2, 4)]
    runs = iter([{"status": "ok", "step_time_s": 0.3}, {"status": "failed", "error": "x", "error_type": "OutOfMemoryError"},
                 {"status": "ok", "step_time_s": 0.2},  # the retry of micro-batch 2 with checkpointing, measured next
                 {"status": "failed", "error": "tp=4 does not divide", "exit_code": 2},
                 {"status": "ok", "step_time_s": 0.25}, {"status": "ok", "step_time_s": 0.35}])
    lines, order = [], []

    def measure(r, i):
        order.append((i, r["candidate"]))
        return next(runs)

    def pick(i):
        return rows[:3] if i == 0 else sorted((r for r in rows if r["measured"][0]["status"] == "ok"),
                                              key=lambda r: r["measured"][0]["step_time_s"])

    rounds.measure_rounds(rows, 2, pick, measure, lambda r, m: m["status"], lines.append, retry=with_checkpointing)
    ac = "dp_shard=2,micro_batch=2,activation_checkpointing=true"
    assert order == [(0, "dp_shard=2,micro_batch=1"), (0, "dp_shard=2,micro_batch=2"), (0, ac), (0, "dp_shard=2,micro_batch=4"),
                     (1, ac), (1, "dp_shard=2,micro_batch=1")]  # round 2: the fastest of round 1, in its order
    assert lines[2] == f"[1.3] {ac}: ok" and lines[3] == "[1.4] dp_shard=2,micro_batch=4: failed" and lines[4] == f"[2.1] {ac}: ok"
    assert len(rows) == 4 and rows[3]["args"][-1] == "--activation-checkpointing"
    assert rounds.summary(rows[3]["measured"]) == {"step_time_s": 0.225, "min_s": 0.2, "max_s": 0.25, "runs": 2}
    assert rounds.summary([{"status": "ok", "step_time_s": 1.0, "memory_bytes": 5}])["memory_bytes"] == 5
    assert rounds.out_of_memory({"status": "failed", "error": "killed", "exit_code": 137})
    assert not rounds.out_of_memory({"status": "failed", "error": "tp=4 does not divide", "exit_code": 2})
    # A refusal comes from the workers' failure records, a UsageError before any lost peer, in the last attempt.
    attempt = tmp_path / "run" / "attempt_1"
    attempt.mkdir(parents=True)
    (tmp_path / "run" / "attempt_0").mkdir()
    (tmp_path / "run" / "attempt_0" / "rank0.failure.json").write_text(_json.dumps({"type": "UsageError", "message": "old",
                                                                                    "time": 0.0}))
    (attempt / "rank0.failure.json").write_text(_json.dumps({"type": "RuntimeError", "message": "Connection reset by peer",
                                                             "time": 1.0}))
    (attempt / "rank1.failure.json").write_text(_json.dumps({"type": "UsageError", "message": "tensor-parallel degree 4 "
                                                             "does not divide KV heads 2", "time": 2.0}))
    assert rounds.first_failure(tmp_path / "run", 2)["message"] == "tensor-parallel degree 4 does not divide KV heads 2"
    assert rounds.first_failure(tmp_path / "run", 1)["type"] == "RuntimeError" and rounds.first_failure(None, 2) is None
    assert rounds.slug("HSDP 2x2, micro-batch 4, AC") == "hsdp-2x2-micro-batch-4-ac"
