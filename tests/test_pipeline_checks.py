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
