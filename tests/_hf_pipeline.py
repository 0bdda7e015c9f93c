"""Worker for tests/test_hf_pipeline.py: GPT-2 (its head tied to its token table, no declared ``_pp_plan``)
and a Llama cut into pipeline stages by ``mg.parallel.pipeline``, trained in float64, against one process.

Both runs take the same 5 AdamW steps of global batch 8 with 4 micro-batches and clipping at 0.5, through
tests/_hf_layouts.py's ``train`` (the reference) and ``train_pipeline``; models may differ from
_hf_layouts.build's defaults (``overrides``: 4 blocks for 4 stages).
"""

from __future__ import annotations

from torch import nn

import multigpu as mg

import _hf_layouts as hf

STEPS, ACCUM, CLIP = 5, 4, 0.5


TIED = {"transformer.wte.weight", "lm_head.weight"}


def run(dist, jobs: list[tuple[str, dict, dict | None]]) -> list[dict]:
    """Several runs in the same processes (one start-up for all): ``(kind, overrides, layout)``, layout None for
    the one-process reference (the same micro-batches, accumulated); ``tied_held``: GPT-2's tied names held."""
    out = []
    for kind, o, layout in jobs:
        if layout is None:
            out.append(hf.train(dist, kind, {}, steps=STEPS, accum=ACCUM, clip=CLIP, overrides=o))
        else:
            r = hf.train_pipeline(dist, kind, layout, steps=STEPS, accum=ACCUM, clip=CLIP, overrides=o)
            out.append(r | {"tied_held": sorted(set(r["held"]) & TIED)})
    return out


def resumed_across(dist, jobs: list[tuple[str, dict, dict, dict, str]]) -> list[dict]:
    """Each (kind, overrides, first, then, directory): steps 0-2 under layout ``first``, saved (DCP), the rest
    resumed under ``then``; a layout with pp > 1 runs as a pipeline, any other as mg.parallelize."""
    out = []
    for kind, overrides, first, then, ckpt in jobs:
        for layout, stop_after in ((first, 2), (then, None)):
            train = hf.train_pipeline if layout.get("pp", 1) > 1 else hf.train
            r = train(dist, kind, layout, steps=STEPS, accum=ACCUM, clip=CLIP, ckpt=ckpt, stop_after=stop_after,
                      overrides=overrides)
        out.append(r)
    return out


def mismatched_tie(dist) -> str:
    """A hand-built pipeline whose tied copies differ in shape on the two stages: refused, the same line on both."""
    pp_mesh = mg.parallel.Layout(pp=2).resolve(dist.world_size).device_mesh(dist.device.type)["pp"]
    rank = pp_mesh.get_local_rank()
    part = nn.Sequential()
    part.add_module(str(rank), nn.Linear(4, 4 + rank))
    try:
        mg.parallel.Pipeline([part], [rank], 2, pp_mesh.get_group(), dist.device, "gpipe", 2,
                             hf.loss_fn, tied=[["0.weight", "1.weight"]])
    except mg.UsageError as e:
        return str(e)
    return "accepted"


def refusals(dist, cases: list[dict]) -> list[str]:
    return [mismatched_tie(dist)] + hf.refusals(dist, cases)


def evaluate_under(dist, schedule: str) -> str:
    """``pipe.evaluate`` under ``schedule`` (a Llama of 4 blocks over 2 ranks): its loss on the last stage, or the
    refusal's line."""
    model = hf.build("llama", num_hidden_layers=4)
    layout = mg.parallel.Layout(pp=2, micro_batch=1, schedule=schedule)
    plan = layout.plan(hf.GLOBAL_BATCH, dist)
    pipe = mg.parallel.pipeline(model, layout, hf.loss_fn, plan, verbose=False)
    try:
        loss = pipe.evaluate(next(iter(mg.loader(hf.tokens(), plan, dist))))
    except mg.UsageError as e:
        return str(e)
    return "no loss here" if loss is None else f"loss {float(loss):.6f}"
