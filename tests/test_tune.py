"""`multigpu tune`: the candidates, the cost model's counting, and a real tune on 2 CPU ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from multigpu.errors import UsageError
from multigpu.recipes.gpt.model import GPT, config
from multigpu.tune import TuneConfig, run_tune
from multigpu.forecast.hardware import Links
from multigpu.parallel.layout import Layout
from multigpu.parallel.space import name
from multigpu.tune.run import recipe


def _candidates(world: int, *flags: str, micro_batches=None):
    """The GPT recipe's candidates as tune weighs them (its workload: space.candidates with the recipe's refusal)."""
    work = recipe(TuneConfig("gpt", (*flags, "--global-batch", "16"), nproc=world, micro_batches=micro_batches))
    return work.found, work.left_out


def test_candidates_cover_every_layout_that_computes_the_same_training_and_say_why_others_are_out():
    found, out = _candidates(4)
    names = {name(c).split(",")[0] for c in found}
    assert names == {"DDP 4", "FSDP 4", "HSDP 2x2", "FSDP 2 x TP 2", "TP 4"}
    assert {o["reason"] for o in out} == {"the token table of the GPT is tied to its head, but a pipeline puts them on "
                                          "different stages; untie them (the GPT recipe: --untied) or use pp=1"}
    assert all(16 % (c.dp_size * c.micro_batch) == 0 for c in found)
    untied, out = _candidates(4, "--untied", micro_batches=(4, 8))
    pipes = [c for c in untied if c.pp > 1]
    assert {(c.pp, c.tp, c.schedule) for c in pipes} == {(2, 1, "1f1b"), (2, 1, "gpipe"), (2, 2, "1f1b"), (2, 2, "gpipe")}
    assert any("2 blocks" in o["reason"] for o in out)  # PP 4 on a 2-block model
    # One micro-batch a step on 2 stages: 1F1B refuses it in the library's own line, GPipe runs it.
    one = "got 1 micro-batches for 2 stages"
    assert [o["layout"] for o in out if one in o["reason"]] == ["pp=2,dp_shard=2,micro_batch=8"]  # dp 2 x PP 2 (tp 1)
    assert {(c.tp, c.schedule) for c in pipes if c.micro_batch == 8} == {(1, "gpipe"), (2, "gpipe"), (2, "1f1b")}
    c = Layout(dp_replicate=2, dp_shard=2, micro_batch=4, activation_checkpointing=True)
    assert name(c) == "HSDP 2x2, micro-batch 4, AC" and c.flags == ["--dp-replicate", "2", "--dp-shard", "2", "--micro-batch", "4", "--activation-checkpointing"]
    # The accumulation is the BatchPlan's, over the Layout's data-parallel ranks.
    assert c.world_size == 4 and c.accum_steps(32) == 2 and Layout(tp=2, micro_batch=2).accum_steps(16, world_size=4) == 4
    assert Layout(tp=2).world_size is None
    with pytest.raises(UsageError, match="leaves dp_shard to the world size"):
        Layout(micro_batch=2).accum_steps(16)
    with pytest.raises(UsageError, match="no layout of 3 ranks fits this model and global batch 16"):
        _candidates(3)
    # Micro-batch sizes asked for that divide no rank's share: said, not replaced by a size nobody asked for.
    with pytest.raises(UsageError, match="--micro-batches 3 divides no rank's share of 4 sequences"):
        _candidates(4, micro_batches=(3,))


def _parts(slowdown: float = 1.0, fixed: dict | None = None, sync: dict | None = None) -> dict:
    """A probe's measured parts, made up: 10 ms a micro-batch whatever its size, 2 ms the optimizer, 1 ms
    latency below 1 KB then 1 GB/s for every op and group size."""
    part = {"time_s": 0.010, "optimizer_s": 0.002}
    zero = {"micro_s": 0.0, "step_s": 0.0}
    return {"compute": {(m, ac): part for m in (1, 2, 4, 8) for ac in (False, True)},
            "links": Links({(op, n): [(1000, 1e-3), (10**6, 1e-3 + 1e-3)]
                            for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") for n in (2, 4)}),
            "slowdown": slowdown, "sync": sync or {},
            "fixed": fixed or {f"{f}{ac}": zero for f in ("none", "ddp", "fsdp", "tp", "fsdp+tp") for ac in ("", "+ac")}}


def _tune_predict(cfg, parts, world: int = 4):
    import torch

    from multigpu.forecast.counts import count
    from multigpu.tune import machine

    counts = count(lambda: GPT(cfg), cfg.block_size, dtype=torch.float32)
    here = machine.measured_cluster(counts, parts, world, None)
    return counts, lambda layout: machine.predict(layout.resolve(world), counts, here, parts, 16)


def test_tune_predicts_with_the_forecast_model_on_this_machines_measured_rates_and_links():
    cfg = config("tiny", tie_embeddings=False)
    parts = _parts()
    counts, predict = _tune_predict(cfg, parts)
    links = parts["links"]
    assert counts.params == cfg.parameters and counts.block_linears == (6, 6) and counts.vocab == cfg.vocab_size
    ddp = predict(Layout(dp_replicate=4, dp_shard=1, micro_batch=2))
    fsdp = predict(Layout(dp_shard=4, micro_batch=2))
    states = lambda p: sum(p["memory"][k] for k in ("parameters", "gradients", "optimizer"))  # noqa: E731
    assert states(ddp) == pytest.approx(16 * cfg.parameters) and states(fsdp) == pytest.approx(4 * cfg.parameters)
    # The rate is the forecast's own count over the measured time: a micro-batch costs what the probe measured.
    assert ddp["compute_s"] == pytest.approx(2 * 0.010 + 0.002)  # 2 micro-batches of 2 per rank, one optimizer step
    assert ddp["time"]["data-parallel collectives (exposed)"] == pytest.approx(links.time("all_reduce", 4, 4 * cfg.parameters))
    # FSDP per micro-batch (2 here): each of the 2 blocks gathered twice (forward, backward), the root once; each
    # unit reduce-scattered once a step.
    block = sum(p.numel() for n, p in GPT(cfg).named_parameters() if n.startswith("blocks.0."))
    root = cfg.parameters - 2 * block
    assert fsdp["time"]["data-parallel collectives (exposed)"] == pytest.approx(
        2 * (4 * links.time("all_gather", 4, 4 * block) + links.time("all_gather", 4, 4 * root))
        + 2 * links.time("reduce_scatter", 4, 4 * block) + links.time("reduce_scatter", 4, 4 * root))
    slow = _tune_predict(cfg, _parts(slowdown=2.0))[1](Layout(dp_replicate=4, dp_shard=1, micro_batch=2))
    assert slow["compute_s"] == pytest.approx(2 * ddp["compute_s"])  # 4 one-thread workers on 2 cores
    pipe = predict(Layout(dp_shard=2, pp=2, micro_batch=2, schedule="1f1b"))
    gpipe = predict(Layout(dp_shard=2, pp=2, micro_batch=2, schedule="gpipe"))
    assert pipe["time"]["pipeline bubble"] > 0 and pipe["time"]["pipeline send/recv"] > 0
    assert gpipe["memory"]["activations"] > pipe["memory"]["activations"]  # 4 micro-batches in flight against 2
    tp = predict(Layout(dp_shard=2, tp=2, micro_batch=2))
    assert tp["memory"]["activations"] < ddp["memory"]["activations"] and tp["time"]["tensor-parallel collectives"] > 0
    # Beyond the largest size: the bandwidth between the two largest; inside: log-log; below: the smallest's time.
    assert links.time("all_reduce", 2, 10**7) == pytest.approx(2e-3 + 9e6 * 1e-3 / 999_000)
    assert links.time("all_reduce", 2, 10**4.5 * 10**0) == pytest.approx(10 ** (-3 + 0.5 * 0.30103), rel=1e-3)
    assert links.time("all_reduce", 2, 10) == 1e-3 and links.time("all_reduce", 1, 10**6) == 0.0
    with pytest.raises(UsageError, match="no measurement of all_to_all on 4 ranks"):
        links.time("all_to_all", 4, 10)


def test_refusals_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)
    for argv, expected in (
        (["gpt", "--tp", "2"], "tune chooses --tp itself; drop it"),
        (["train.py"], "tune knows the layouts of the GPT recipe"),
        (["--top", "0", "gpt"], "--top takes a number of candidates (at least 1) or 'all', got '0'"),
        (["-n", "3", "gpt"], "no layout of 3 ranks fits this model and global batch 16"),
        (["--model", "m.py:f", "--seq-len", "8", "gpt"], "--model tells tune a script's model; the recipe's is its own "
                                                          "flags (--size, --block-size): drop --model"),
    ):
        code = main(["tune", "--cpu", *argv])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


# One report for every workload (tests/test_layout_contract.py: a script measured alone has the first keys only).
REPORT = {"workload", "world_size", "device", "threads_per_worker", "steps", "repeats", "top", "candidates", "left_out",
          "winner", "command", "verdict", "wall_s"}
PREDICTED = REPORT | {"model", "global_batch", "budget", "probe", "prediction_error"}
ROW = {"candidate", "args", "measured", "pruned", "predicted", "result", "error"}  # error: measured and predicted


@pytest.mark.slow
def test_tune_on_two_cpu_ranks_measures_the_top_candidates_and_writes_the_report(tmp_path):
    lines = []
    out, report = run_tune(TuneConfig("gpt", ("--global-batch", "16"), nproc=2, cpu=True, top=2, repeats=1, steps=6,
                                      out=str(tmp_path / "tune"), micro_batches=(4, 8)), say=lines.append)
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    saved = json.loads((out / "tune.json").read_text())
    assert set(saved) == PREDICTED and {k for r in saved["candidates"] for k in r} == ROW | {"fits"}
    assert saved["winner"] == report["winner"] and len(saved["candidates"]) == 12
    measured = [c for c in saved["candidates"] if c["measured"]]
    assert len(measured) == 2 and all(c["result"] for c in measured)  # the 2 fastest predicted, both ran
    preds = [c["predicted"]["step_time_s"] for c in saved["candidates"]]
    assert preds == sorted(preds) and measured == saved["candidates"][:2]
    winner = min(measured, key=lambda c: c["result"]["step_time_s"])
    assert saved["winner"] == winner["candidate"] and " ".join(winner["args"]) in saved["command"]
    for c in measured:  # the memory count is the recipe's own: state exactly, activations of its first step
        assert abs(c["error"]["memory"]) < 0.3, c
    assert "measuring the links in groups of 2 of the 2 ranks" in "\n".join(lines)
    assert report["verdict"] in lines
    # The busy probe's wait on the 2 ranks after each stretch of work, the stretches as long as measured there.
    from multigpu.tune.probe import SYNC_GAPS

    points = saved["probe"]["busy"]["wait_s"]["2"]
    assert len(points) == len(SYNC_GAPS) and all(w >= 0 for _, w in points)
    work = saved["probe"]["busy"]["work_s"]  # one matmul's
    assert [g for g, _ in points] == sorted(g for g, _ in points) and points[0][0] == work
    assert points[-1][0] > 0.5 * SYNC_GAPS[-1] * work  # k matmuls take about k times one
    # The links' rows are kept in tune.json: a prediction is made again from it alone.
    from multigpu.tune import machine

    rows = saved["probe"]["links"]["2"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"} and len(rows) == 4 * 7
    again = machine.parts_of(saved)["links"]
    assert again.time("all_gather", 2, rows[7]["size"]) == rows[7]["time_s"]
    # A tune.json from before kept the path of a cache file instead: read where it is, one line where it is gone.
    old = {"probe": saved["probe"] | {"links": {"2": f"cached {tmp_path / 'gone.json'}"}}}
    with pytest.raises(UsageError, match="links on 2 ranks were kept in .*gone.json, which is gone; run the tune again"):
        machine.parts_of(old)
    (tmp_path / "kept.json").write_text(json.dumps(rows))
    old["probe"]["links"]["2"] = f"measured, {tmp_path / 'kept.json'}"
    assert machine.parts_of(old)["links"].time("all_gather", 2, rows[7]["size"]) == rows[7]["time_s"]


def test_the_measured_fixed_costs_and_the_collectives_waits_add_in():
    from multigpu.tune import machine
    from multigpu.tune.machine import family

    fixed = {f"{f}{ac}": {"micro_s": 0.001 * (i + 1), "step_s": 0.01 * (i + 1)}
             for i, f in enumerate(("none", "ddp", "fsdp", "tp", "fsdp+tp")) for ac in ("", "+ac")}
    sync = {2: [(0.0, 0.004)], 4: [(0.0, 0.006)]}  # the same wait after any work (a tune.json from before: one figure)
    assert machine.waits(0.004) == sync[2] and machine.waits([[0.001, 0.004]]) == [(0.001, 0.004)]
    _, bare_of = _tune_predict(config("tiny"), _parts(2.0))
    _, full_of = _tune_predict(config("tiny"), _parts(2.0, fixed, sync))
    links = _parts()["links"]
    floor = links.time("all_reduce", 4, 1024)  # the sync probe's own 1 KiB transfer, which the links count
    layouts = {"ddp": Layout(dp_replicate=4, dp_shard=1, micro_batch=2), "fsdp": Layout(dp_shard=4, micro_batch=2),
               "hsdp": Layout(dp_replicate=2, dp_shard=2, micro_batch=2), "tp": Layout(dp_shard=1, tp=4, micro_batch=4),
               "fsdp+tp": Layout(dp_shard=2, tp=2, micro_batch=4, activation_checkpointing=True)}
    assert {k: family(v.resolve(4)) for k, v in layouts.items()} == {"ddp": "ddp", "fsdp": "fsdp", "hsdp": "fsdp",
                                                                     "tp": "tp", "fsdp+tp": "fsdp+tp"}
    for key, layout in layouts.items():
        bare, full = bare_of(layout), full_of(layout)
        m = layout.accum_steps(16, world_size=4)
        f = fixed[family(layout.resolve(4)) + ("+ac" if layout.activation_checkpointing else "")]
        # HSDP's and FSDP x TP's blocks issue collectives along two mesh dimensions: every group waits as the 4 do.
        w = {g: sync[4 if key in ("hsdp", "fsdp+tp") else g][0][1] - links.time("all_reduce", g, 1024) for g in sync}
        waits = sum(n * w[4 if key in ("hsdp", "fsdp+tp") else g] for g, n in full["collectives"].items())
        # slowdown 2: the wrapper's work is CPU work, as slow as the compute
        assert full["overhead_s"] == pytest.approx(m * f["micro_s"] * 2.0 + f["step_s"] * 2.0 + waits), key
        assert bare["overhead_s"] == 0.0
        assert full["step_time_s"] == pytest.approx(bare["step_time_s"] + full["overhead_s"])
        assert full["compute_s"] == bare["compute_s"] and full["comm_s"] == pytest.approx(bare["comm_s"])
    # The collectives counted per step: DDP one bucket and the token count, on the 4 ranks.
    ddp = full_of(layouts["ddp"])
    assert ddp["collectives"] == {4: 2} and ddp["overhead_s"] == pytest.approx(2 * 0.002 * 2 + 0.02 * 2 + 2 * (0.006 - floor))
    # Measured after stretches of work, the wait is read at the layout's own: its step's work over its collectives.
    grows = {2: [(0.001, 0.004), (0.011, 0.009)], 4: [(0.001, 0.006), (0.011, 0.016)]}
    _, grows_of = _tune_predict(config("tiny"), _parts(2.0, fixed, grows))
    for key in ("ddp", "fsdp"):
        got = grows_of(layouts[key])
        m, f = layouts[key].accum_steps(16, world_size=4), fixed[key]
        work = m * f["micro_s"] * 2.0 + f["step_s"] * 2.0
        gap = (work + got["compute_s"]) / got["collectives"][4]
        # DDP: 2 collectives, past the last point (its wait); FSDP's 15 between the two (on the line)
        assert (gap > 0.011) if key == "ddp" else (0.001 < gap < 0.011), key
        at = 0.006 + (0.016 - 0.006) * (min(gap, 0.011) - 0.001) / 0.010 - floor
        assert got["overhead_s"] == pytest.approx(work + got["collectives"][4] * at), key
    # The transfer taken off a wait is the same all-reduce's time back to back, measured beside it by the busy
    # probe (the links' may come from another day's load).
    _, beside_of = _tune_predict(config("tiny"), _parts(2.0, fixed, sync) | {"idle": {2: 0.001, 4: 0.0025}})
    assert beside_of(layouts["ddp"])["overhead_s"] == pytest.approx(2 * 0.002 * 2 + 0.02 * 2 + 2 * (0.006 - 0.0025))
    # FSDP 4, 2 micro-batches of 2 blocks: 5 gathers each, 3 reduce-scatters, the norm, the token count.
    assert full_of(layouts["fsdp"])["collectives"] == {4: 2 * 5 + 3 + 1 + 1}
    # HSDP 2x2: the same on the shard groups of 2, an all-reduce per unit on the replica groups, the count on 4.
    assert full_of(layouts["hsdp"])["collectives"] == {2: 2 * 5 + 3 + 1 + 3, 4: 1}
    # TP 4, 4 micro-batches (the recipe's plan, no sequence parallelism): per block an all-reduce after each of
    # the 2 row-wise linears and of each of the 4 column-wise ones' input gradient, the table's and the head's,
    # the logits' gather; the norm over tp, the token count.
    assert full_of(layouts["tp"])["collectives"] == {4: 4 * (6 * 2 + 2 + 1) + 1 + 1}
    # Under activation checkpointing the forward's 2 all-reduces per block run again in the backward.
    tp_ac = full_of(layouts["fsdp+tp"])["collectives"]
    assert tp_ac[2] == (2 * 5 + 3 + 1) + (2 * (8 * 2 + 2 + 1) + 1) and tp_ac[4] == 1  # 2 micro-batches of 4
    # With sequence parallelism (the forecast's published layouts and its printed commands): per sub-layer an
    # all-gather in, a reduce-scatter out, mirrored in the backward.
    sp = full_of(dataclasses.replace(layouts["tp"], sequence_parallel=True))["collectives"]
    assert sp == {4: 4 * (8 * 2 + 2 + 2 + 1) + 1 + 1}


def test_the_links_are_measured_on_the_whole_world_in_groups_every_group_at_once(monkeypatch):
    """A group size below the world is measured among that many consecutive ranks of all of them, every group at
    once (as a layout's mesh dimension runs them), not on that many processes alone; the world's on the world."""
    import multigpu.commbench.run as bench
    from multigpu.tune import probe

    asked = []

    def fake(cfg, nproc):
        asked.append((cfg.group, nproc, cfg.backend))
        t = 1e-3 * (cfg.group or nproc)
        return {"rows": [{"op": op, "size": size, "out": {"time_us": t * 1e6 * (1 + size / 2**20)}, "in": None}
                         for op in cfg.ops for size in cfg.sizes]}

    monkeypatch.setattr(bench, "run_bench", fake)
    links, rows = probe.links({1, 2, 4}, 4, "cpu", 1, say=lambda _: None)
    assert asked == [(2, 4, "gloo"), (None, 4, "gloo")]
    assert sorted(rows) == [2, 4] and len(rows[2]) == len(probe.OPS) * len(probe.SIZES)
    assert links.time("all_gather", 2, 2**20) == pytest.approx(2e-3 * 2) and links.time("all_gather", 4, 2**20) == pytest.approx(4e-3 * 2)


def test_the_loop_probe_differences_each_round_and_keeps_the_medians():
    from multigpu.tune.probe import loop_costs

    part = {"time_s": 0.007, "optimizer_s": 0.003}
    # Rounds of (1, 3) micro-batches: the loop adds 1 ms per micro-batch and 2 ms per step; the second round ran in a
    # slow phase of the machine (everything 1.5x), which the medians leave out.
    steady = (0.007 + 0.001) * 1 + 0.003 + 0.002, (0.007 + 0.001) * 3 + 0.003 + 0.002
    got = loop_costs({1: [steady[0], 1.5 * steady[0], steady[0]], 3: [steady[1], 1.5 * steady[1], steady[1]]}, part)
    assert got["micro_s"] == pytest.approx(0.001) and got["step_s"] == pytest.approx(0.002)
    # A pair timed across a change of load (its 1-micro-batch step slow): its difference is less than a
    # micro-batch's forward+backward, which it cannot be; floored there, it puts nothing extra per step.
    got = loop_costs({1: [0.015, 0.015, 0.015], 3: [0.023, 0.023, 0.023]}, part)
    assert got["micro_s"] == 0.0 and got["step_s"] == pytest.approx(0.015 - 0.007 - 0.003)


def test_the_rounds_interleave_retry_with_checkpointing_and_read_the_workers_refusal(tmp_path):
    import json as _json

    from multigpu.tune import rounds
    from multigpu.tune.script import with_checkpointing

    rows = [rounds.row(Layout(dp_shard=2, micro_batch=m)) for m in (1, 2, 4)]
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


def test_the_wrappers_fixed_costs_are_measured_on_the_model_itself_with_mg_parallelizes_pieces():
    """tune/wrappers.py puts each family's real wrapper on the model it is given (here a transformers Llama,
    which the GPT-only probe could not take): DTensor weights under TP (the plan the model declares), FSDP2
    units per decoder layer, DDP, every block recomputing under checkpointing; and times them all."""
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.distributed as tdist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from multigpu.tune import wrappers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    subject = wrappers.causal_lm(cfg, 16)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        layers = lambda m: list(m.model.layers)  # noqa: E731
        tp, fsdp, both = (wrappers.wrapped(subject, f, False) for f in ("tp", "fsdp", "fsdp+tp"))
        assert isinstance(tp.model.layers[0].self_attn.q_proj.weight, DTensor)
        assert not isinstance(tp, FSDPModule) and all(isinstance(x, FSDPModule) for x in [fsdp, *layers(fsdp)])
        assert isinstance(both.model.layers[0].mlp.down_proj.weight, DTensor) and isinstance(both.model.layers[1], FSDPModule)
        assert isinstance(wrappers.wrapped(subject, "ddp", False), torch.nn.parallel.DistributedDataParallel)
        ac = wrappers.wrapped(subject, "none", True)
        assert all("forward" in vars(layer) for layer in layers(ac))  # mg.parallelize's checkpointing, per layer
        assert not any("forward" in vars(layer) for layer in layers(wrappers.wrapped(subject, "none", False)))
        got = wrappers.overheads(subject, 2, 1, acs=(False,), rounds=1)
    finally:
        tdist.destroy_process_group()
    assert set(got) == set(wrappers.FAMILIES) and all(v["micro_s"] >= 0 and v["step_s"] >= 0 for v in got.values())


def test_a_scripts_layouts_the_model_cannot_take_are_refused_before_anything_is_probed():
    """tune --model refuses a layout as the script's mg.parallelize would: tensor parallelism for a model that
    declares no plan and has none to find (its own blocks of plain Linears) is refused with mg.parallelize's own
    line, so tune neither predicts nor probes it (it used to stop the whole tune at the TP wrapper's probe)."""
    import torch
    from torch import nn

    from multigpu.forecast.counts import count
    from multigpu.tune.script import _refusal

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(x)

    class TableLM(nn.Module):  # the logits through the token table: no head, no TP plan
        def __init__(self):
            super().__init__()
            self.embed, self.blocks = nn.Embedding(32, 16), nn.ModuleList(Block() for _ in range(2))

        def forward(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            return nn.functional.linear(x, self.embed.weight)

    counts = count(TableLM, 8, dtype=torch.float32)
    why = _refusal(TableLM, counts, 8, 8)
    assert why(Layout(tp=2).resolve(2)).startswith("tensor parallelism (tp=2) found no plan for TableLM")
    assert why(Layout(dp_shard=2).resolve(2)) is None
    # A pipeline: mg.parallel.pipeline's own line (a ModuleList of blocks under a forward of its own: no cut).
    assert why(Layout(pp=2, micro_batch=4).resolve(2)).startswith("a pipeline cuts a model into stages of blocks, "
                                                                  "but TableLM has its repeated blocks (Block)")
    assert counts.tied  # which is no refusal by itself: the pipeline keeps the table's copy on each stage using it
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, tie_word_embeddings=True)
    tied = lambda: transformers.LlamaForCausalLM(cfg)  # noqa: E731
    counts = count(tied, 8, dtype=torch.float32)
    why = _refusal(tied, counts, 8, 8)
    assert counts.tied and why(Layout(pp=2, micro_batch=4).resolve(2)) is None
    # A model whose forward runs on the meta device too: the cut is asked, the probe (values to compare) is not.
    mamba = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)
    build = lambda: transformers.MambaForCausalLM(mamba)  # noqa: E731
    assert _refusal(build, count(build, 8, dtype=torch.float32), 8, 8)(Layout(pp=2, micro_batch=4).resolve(2)) is None
    # The schedule's micro-batch rule is the library's (pp.microbatches_refusal), per schedule: 1 a step is
    # too few for 1F1B's 2 stages, and runs under GPipe (every schedule: test_pipeline_checks.py's grid).
    from multigpu.parallel import pp

    assert why(Layout(pp=2, micro_batch=8).resolve(2)) == pp.microbatches_refusal("1f1b", 2, 1)
    assert why(Layout(pp=2, micro_batch=8, schedule="gpipe").resolve(2)) is None


def test_a_world_where_the_script_refuses_every_layout_is_one_line_and_writes_nothing(tmp_path):
    """2 ranks, a global batch of 1 and a model with one block and no TP plan: data parallelism cannot split the
    batch, a pipeline has more stages than micro-batches, tensor parallelism finds no plan. One line naming the
    first, before the out dir exists or anything is probed."""
    from pathlib import Path

    model = tmp_path / "onelm.py"
    model.write_text(
        "from torch import nn\n\n"
        "class OneLM(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.blocks = nn.Embedding(32, 16), nn.ModuleList([nn.Linear(16, 16)])\n\n"
        "    def forward(self, ids):\n"
        "        return nn.functional.linear(self.blocks[0](self.embed(ids)), self.embed.weight)\n\n"
        "def build():\n"
        "    return OneLM()\n")
    example = str(Path(__file__).resolve().parents[1] / "examples" / "hf_model.py")
    out = tmp_path / "tune"
    with pytest.raises(UsageError, match=r"^no layout of 2 ranks fits build and global batch 1: dp_shard=2,micro_batch=1: "
                                         r".*; change -n or the global batch$"):
        run_tune(TuneConfig(example, ("--global-batch", "1"), nproc=2, cpu=True, top=2, repeats=1, steps=6,
                            out=str(out), model=f"{model}:build", seq_len=8), say=lambda line: None)
    assert not out.exists()


@pytest.mark.slow
def test_tune_predicts_a_scripts_layouts_from_its_model_and_measures_the_fastest_that_fit(tmp_path):
    """`multigpu tune --model examples/hf_model.py:build_model --seq-len 64 examples/hf_model.py --global-batch 8`:
    the script's model counted and probed as the recipe's is, every layout (each micro-batch, with and without
    checkpointing) predicted, those over the memory budget pruned, the 2 fastest predicted of the rest run."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from multigpu.parallel import pp

    example = str(Path(__file__).resolve().parents[1] / "examples" / "hf_model.py")
    budget = 7 * 2**20  # below DDP's at micro-batch 4 (its whole states and 4 sequences' activations)
    lines: list[str] = []
    out, report = run_tune(TuneConfig(example, ("--global-batch", "8"), nproc=2, cpu=True, top=2, repeats=1, steps=7,
                                      out=str(tmp_path / "tune"), memory_budget=budget,
                                      model=f"{example}:build_model", seq_len=64), say=lines.append)
    saved = json.loads((out / "tune.json").read_text())
    rows = saved["candidates"]
    assert set(saved) == PREDICTED and {k for r in rows for k in r} == ROW | {"fits"}  # the recipe's shape
    assert len(rows) == 26  # 7 layouts x their micro-batches x AC, less the 2 the script would refuse:
    assert saved["left_out"][-1:] == [{"layout": "pp=2,micro_batch=8", "reason": pp.microbatches_refusal("1f1b", 2, 1)}]
    pruned = [r for r in rows if r["pruned"]]
    assert pruned and all(r["predicted"]["memory_bytes"] > budget and not r["measured"] for r in pruned)
    fit = sorted((r for r in rows if not r["pruned"]), key=lambda r: r["predicted"]["step_time_s"])
    assert all(r["predicted"] for r in rows)
    measured = [r for r in rows if r["measured"]]
    assert sorted(r["candidate"] for r in measured) == sorted(r["candidate"] for r in fit[:2])
    assert all(r["result"] and "memory_bytes" in r["result"] for r in measured)
    for r in measured:  # the same model as the recipe's tune: memory near (tens of %), time within 2x on a busy CI
        assert abs(r["error"]["memory"]) < 0.3 and abs(r["error"]["step_time"]) < 1.0, r
    assert saved["model"] == "build_model" and saved["global_batch"] == 8
    assert saved["prediction_error"]["memory_worst"] == max(abs(r["error"]["memory"]) for r in measured)
    assert saved["winner"] in [r["candidate"] for r in measured] and report["verdict"] in lines
    page = (out / "report.md").read_text()
    assert "predicted ms/step" in page and "Prediction error over the measured candidates" in page
    assert "slower predicted (" in page and "> budget 7.0 MiB" in page
