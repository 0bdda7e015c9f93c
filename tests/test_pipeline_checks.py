"""``mg.parallel.Pipeline`` refuses stages its schedule cannot run, in one line, the same on every rank.

Each bad layout is tried in turn in the same 2 processes: all ranks gather what every rank was
given before judging, so they raise together and the next case starts with no rank left in a
collective. Only rank 1 is wrong in some cases: rank 0 must still name it.
"""

import torch
from torch import nn

import multigpu as mg
from multigpu.parallel import pp
from multigpu.testing import spawn


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _bad_layouts(r: int) -> dict:
    """name: (schedule, ids, n_stages, number of modules) on pp rank ``r`` of 2."""
    return {
        "duplicate": ("gpipe", [0], 2, 1),                                   # rank 1 repeats stage 0
        "gap": ("interleaved_1f1b", [[0, 2], [1, 4]][r], 4, 2),              # stage 3 skipped
        "shifted": ("1f1b", [r + 1], 2, 1),                                  # 1..n instead of 0..n-1
        "two_stages_one_stage_schedule": ("gpipe", pp.stage_ids("interleaved_1f1b", r, 2), 4, 2),
        "n_stages": ("1f1b", [r], 4, 1),                                     # the interleaved count
        "n_stages_differ": ("gpipe", [r], 2 + r, 1),
        "looped_n_stages": ("interleaved_1f1b", pp.stage_ids("interleaved_1f1b", r, 2, 3), 4, 3),  # 3 a rank, 4 said
        "modules": ("gpipe", [r], 2, 1 + r),                                 # rank 1 passes 2 modules
        "swapped": ("gpipe", [1 - r], 2, 1),                                 # each stage on the other's rank
        "not_a_list": ("gpipe", r, 2, 1),
        "unknown_schedule": ("pipedream", [r], 2, 1),
    }


def _try_layouts(dist) -> dict:
    pp_mesh = mg.parallel.Layout(pp=2).resolve(dist.world_size).device_mesh(dist.device.type)["pp"]
    group = pp_mesh.get_group()
    out = {}
    for name, (schedule, ids, n_stages, n_modules) in _bad_layouts(pp_mesh.get_local_rank()).items():
        modules = [nn.Linear(4, 4) for _ in range(n_modules)]
        try:
            mg.parallel.Pipeline(modules, ids, n_stages, group, dist.device, schedule, 2, _loss)
            out[name] = None
        except mg.UsageError as e:
            out[name] = str(e)
    # After every refusal the ranks are still in step: a good pipeline builds and runs.
    torch.manual_seed(0)
    pipe = mg.parallel.Pipeline([nn.Linear(4, 4)], [pp_mesh.get_local_rank()], 2, group, dist.device, "gpipe", 2, _loss)
    loss = pipe.step([(torch.ones(2, 4), torch.zeros(2, 4))] * 2)
    out["good"] = None if loss is None else float(loss)
    return out


def test_pipeline_refuses_bad_stage_layouts_on_every_rank_in_one_line():
    out = spawn(_try_layouts, 2)
    assert out[0].keys() == out[1].keys()
    for name in out[0]:
        if name != "good":
            assert out[0][name] == out[1][name], name        # every rank raised the same line
            assert out[0][name] and "\n" not in out[0][name], (name, out[0][name])
    msg = out[0]
    fix = "pass ids=pp.stage_ids('gpipe', pp_rank, pp_size) (pp rank 0 [0], pp rank 1 [1])"
    assert msg["duplicate"] == ("pipeline stage ids over the 2 pp ranks must cover 0..1 once each, got pp rank 0 [0], "
                                f"pp rank 1 [0]: 0 twice (pp ranks 0, 1); missing 1; {fix}")
    assert "cover 0..3 once each, got pp rank 0 [0, 2], pp rank 1 [1, 4]: missing 3; out of range 4" in msg["gap"]
    assert "(pp rank 0 [0, 2], pp rank 1 [1, 3])" in msg["gap"]
    assert "cover 0..1 once each, got pp rank 0 [1], pp rank 1 [2]: missing 0; out of range 2" in msg["shifted"]
    assert msg["two_stages_one_stage_schedule"].startswith(
        "pipeline schedule 'gpipe' runs 1 stage per rank, got pp rank 0 [0, 2], pp rank 1 [1, 3]; " + fix)
    assert msg["two_stages_one_stage_schedule"].endswith("or use a multi-stage schedule (interleaved_1f1b, looped_bfs, "
                                                         "interleaved_zero_bubble, zbv)")
    assert msg["n_stages"] == ("pipeline schedule '1f1b' on 2 pp ranks runs 2 stages (1 per rank), got n_stages=4; "
                               "pass n_stages=pp.check('1f1b', pp_size, accum_steps)")
    assert msg["looped_n_stages"] == ("pipeline schedule 'interleaved_1f1b' runs 2 stages per rank, got pp rank 0 "
                                      "[0, 2, 4], pp rank 1 [1, 3, 5]; pass ids=pp.stage_ids('interleaved_1f1b', "
                                      "pp_rank, pp_size) (pp rank 0 [0, 2], pp rank 1 [1, 3]), or pass n_stages=2 x "
                                      "the stages a rank runs")
    assert msg["n_stages_differ"] == ("pipeline ranks were given different n_stages (pp rank 0 2, pp rank 1 3); "
                                      "pass the same n_stages on every pp rank")
    assert msg["modules"] == ("pipeline pp rank 1 passed 2 modules for 1 stage ids [1]; "
                              "pass one module per stage id, in the same order")
    assert msg["swapped"] == ("pipeline schedule 'gpipe' places stages pp rank 0 [0], pp rank 1 [1], "
                              f"got pp rank 0 [1], pp rank 1 [0] (the stages would exchange with the wrong ranks); {fix}")
    assert msg["not_a_list"].startswith("pipeline stage ids must be a list of ints, got 0 (int) on pp rank 0; ")
    assert msg["unknown_schedule"].startswith("unknown pipeline schedule 'pipedream'; expected one of gpipe, 1f1b")
    # The good pipeline's loss is on the last stage's rank only.
    assert out[0]["good"] is None and out[1]["good"] is not None


# Every schedule on 2, 3 and 4 pp ranks, 1 to 16 micro-batches a step: where the micro-batch rule is judged.
GRID = [(s, p, m) for s in pp.SCHEDULES for p in (2, 3, 4) for m in range(1, 17)]


def _library(schedule: str, pp_size: int, m: int) -> str | None:
    try:
        pp.check(schedule, pp_size, m)
    except mg.UsageError as e:
        return str(e)
    return None


def test_the_micro_batch_rule_is_what_torchs_schedules_accept():
    """Each schedule of torch built for real (a fake process group on every pp rank, 1 process, no
    communication): torch's constructor refuses exactly the counts ``pp.microbatches_refusal`` refuses."""
    import torch.distributed as tdist
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch_refuses: dict[tuple, set[bool]] = {}
    # The rule does not depend on the stages a rank runs: the looped schedules judged with 3 a rank too.
    runs = [(s, None) for s in pp.SCHEDULES] + [(s, 3) for s in pp.LOOPED]
    for size in (2, 3, 4):
        for rank in range(size):
            tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
            try:
                for schedule, per_rank in runs:
                    n_stages = size * pp.stages_per_rank(schedule, per_rank)
                    for m in range(1, 17):
                        stages = [PipelineStage(nn.Linear(2, 2), i, n_stages, torch.device("cpu"))
                                  for i in pp.stage_ids(schedule, rank, size, per_rank)]
                        try:
                            getattr(schedules, pp.SCHEDULES[schedule])(stages[0] if len(stages) == 1 else stages,
                                                                       n_microbatches=m, loss_fn=_loss)
                            refused = False
                        except ValueError:
                            refused = True
                        torch_refuses.setdefault((schedule, size, m), set()).add(refused)
            finally:
                tdist.destroy_process_group()
    assert all(len(v) == 1 for v in torch_refuses.values())  # every rank of a pipeline, 2 or 3 stages a rank, alike
    disagree = [(s, p, m) for s, p, m in GRID if torch_refuses[(s, p, m)] != {pp.microbatches_refusal(s, p, m) is not None}]
    assert not disagree, disagree
    assert torch_refuses[("zbv", 2, 2)] == {False} and torch_refuses[("interleaved_1f1b", 2, 5)] == {True}


def test_tune_and_forecast_ask_the_librarys_micro_batch_rule():
    """The one rule, three callers: for every schedule and (pp ranks, micro-batches a step), tune's and the
    forecast's reason to leave a pipeline out is the library's own line, or None where the library runs it."""
    from types import SimpleNamespace

    from multigpu.forecast.cost import Run
    from multigpu.forecast.plan import _why_not
    from multigpu.tune.space import pipeline_short

    counts = SimpleNamespace(heads=0, kv_heads=0, experts=0, layers=64)  # nothing else refuses
    for s, p, m in GRID:
        layout = mg.parallel.Layout(pp=p, micro_batch=1, schedule=s).resolve(p)  # 1 data-parallel rank
        lib = _library(s, p, m)
        assert pipeline_short(layout, global_batch=m) == lib, (s, p, m)
        assert _why_not(counts, layout, Run(global_batch=m, seq_len=8)) == lib, (s, p, m)
    # What the issue found: gpipe and interleaved 1F1B run 1 micro-batch on 2 ranks, zbv runs 2 and 3 on 4 stages.
    assert _library("gpipe", 2, 1) is _library("interleaved_1f1b", 2, 1) is _library("zbv", 2, 2) is None
    assert _library("1f1b", 2, 1) and _library("interleaved_1f1b", 2, 5)


def _run_counts(dist) -> dict:
    """On 2 pp ranks, each schedule with 1 to 6 micro-batches a step: torch's own schedule built directly
    (refused or not), and where the library accepts the count, ``mg.parallel.Pipeline``'s step against one
    process in float64 (the largest gradient difference over this rank's stages), else its refusal."""
    import torch.distributed as tdist
    from torch.distributed.pipelining import PipelineStage, schedules

    torch.set_default_dtype(torch.float64)
    group = mg.parallel.Layout(pp=2).resolve(dist.world_size).device_mesh(dist.device.type)["pp"].get_group()
    rank, out = tdist.get_rank(group), {}
    for schedule, cls in pp.SCHEDULES.items():
        n_stages = 2 * pp.stages_per_rank(schedule)
        ids = pp.stage_ids(schedule, rank, 2)
        for m in range(1, 7):
            torch.manual_seed(m)
            x, y = torch.randn(2 * m, 3), torch.randn(2 * m, 3)
            stages = [PipelineStage(nn.Linear(3, 3), i, n_stages, dist.device, group=group) for i in ids]
            try:
                getattr(schedules, cls)(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=_loss)
                torch_ok = True
            except ValueError:
                torch_ok = False
            full = [nn.Linear(3, 3) for _ in range(n_stages)]
            one = nn.Sequential(*[nn.Linear(3, 3) for _ in range(n_stages)])
            one.load_state_dict(nn.Sequential(*full).state_dict())
            (sum(_loss(one(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2]) for i in range(m)) / m).backward()
            try:
                pipe = mg.parallel.Pipeline([full[i] for i in ids], ids, n_stages, group, dist.device, schedule, m, _loss)
            except mg.UsageError as e:
                out[(schedule, m)] = (torch_ok, str(e))
                continue
            pipe.step([(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(m)])
            err = max(float((full[i].weight.grad - one[i].weight.grad).abs().max()) for i in ids)
            out[(schedule, m)] = (torch_ok, err)
    # A torch that asks more than the rule knows: its ValueError comes back as one line, not a traceback.
    rule, pp.microbatches_refusal = pp.microbatches_refusal, lambda *args: None
    try:
        mg.parallel.Pipeline([nn.Linear(3, 3)], [rank], 2, group, dist.device, "1f1b", 1, _loss)
    except mg.UsageError as e:
        out["torch"] = str(e)
    finally:
        pp.microbatches_refusal = rule
    return out


def test_every_micro_batch_count_the_rule_accepts_runs_and_equals_one_process():
    out = spawn(_run_counts, 2, timeout=240)
    assert out[0].pop("torch") == out[1].pop("torch") == (
        f"torch {torch.__version__}'s Schedule1F1B refuses 1 micro-batches on 1 stage(s) per rank: Number of "
        "microbatches (1) must be greater than or equal to the number of stages (2); use another micro-batch count "
        "or schedule")
    for (schedule, m), (torch_ok, got) in out[0].items():
        lib = pp.microbatches_refusal(schedule, 2, m)
        assert torch_ok == (lib is None), (schedule, m, torch_ok)       # the rule is torch's, built for real
        if lib is None:  # accepted: ran on both ranks, every stage's gradients as one process's
            assert isinstance(got, float) and got < 1e-9 and out[1][(schedule, m)][1] < 1e-9, (schedule, m, got)
        else:            # refused by the library first, in its one line, on every rank
            assert got == lib == out[1][(schedule, m)][1], (schedule, m, got)
