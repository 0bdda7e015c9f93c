"""Worker for tests/test_hf_pipeline.py: GPT-2 (its head tied to its token table, no declared ``_pp_plan``)
and a Llama cut into pipeline stages by ``mg.parallel.pipeline``, trained in float64, against one process.

Both runs take the same 5 AdamW steps of global batch 8 with 4 micro-batches and clipping at 0.5 (as
tests/_hf_layouts.py's ``train_pipeline``); models may differ from _hf_layouts.build's defaults
(``overrides``: 4 blocks for 4 stages).
"""

from __future__ import annotations

import torch
from torch import nn

import multigpu as mg

import _hf_layouts as hf

STEPS, ACCUM, CLIP = 5, 4, 0.5


def one_process(dist, kind: str, overrides: dict) -> dict:
    """The reference: the whole model, accumulation over the same micro-batches, mg.clip_grad_norm_."""
    model = hf.build(kind, **overrides)
    plan = mg.parallel.Layout(micro_batch=hf.GLOBAL_BATCH // ACCUM).plan(hf.GLOBAL_BATCH, dist)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, norms = [], []
    for _, micro_batches in zip(range(STEPS), mg.loader(hf.tokens(), plan, dist, seed=0)):
        total = 0.0
        for x, y in micro_batches:
            loss = hf.loss_fn(hf.logits_of(model, x), y) / plan.accum_steps
            loss.backward()
            total += float(loss.detach())
        norms.append(float(mg.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses, "norms": norms}


def pipelined(dist, kind: str, overrides: dict, layout: dict, ckpt: str | None = None,
              stop_after: int | None = None) -> dict:
    """``kind`` cut by ``mg.parallel.pipeline`` under ``layout``; the full weights gathered from the stages.
    ``ckpt``: resume from and save to that Checkpointer directory every step (``model=pipe.model``)."""
    model = hf.build(kind, **overrides)
    micro = hf.GLOBAL_BATCH // ACCUM // mg.parallel.Layout(**layout).shape(dist.world_size).dp
    layout = mg.parallel.Layout(**layout, micro_batch=micro)
    plan = layout.plan(hf.GLOBAL_BATCH, dist)
    pipe = mg.parallel.pipeline(model, layout, hf.loss_fn, plan)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    loader = mg.loader(hf.tokens(), plan, dist, seed=0)
    start = 0
    if ckpt is not None:
        checkpointer = mg.Checkpointer(ckpt, model=pipe.model, optimizer=opt, loader=loader)
        start = checkpointer.resume()
    losses, norms = [], []
    for step, micro_batches in zip(range(start, STEPS), loader):
        loss = pipe.step(micro_batches)
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else float(loss))
        if ckpt is not None:
            checkpointer.save(step)
            if step == stop_after:
                break
    held = sorted({n for m in pipe.modules for n, _ in m.named_parameters(remove_duplicate=False)}
                  & {"transformer.wte.weight", "lm_head.weight"})
    return {"state": mg.full_state_dict(pipe), "losses": losses, "norms": norms, "stages": pipe.ids,
            "tied_held": held, "tied": pipe.tied.sums != [], "counted_once": len(pipe.tied.skip)}


def run(dist, jobs: list[tuple[str, dict, dict | None]]) -> list[dict]:
    """Several runs in the same processes (one start-up for all): ``(kind, overrides, layout)``, layout None for
    the one-process reference."""
    return [one_process(dist, kind, o) if layout is None else pipelined(dist, kind, o, layout)
            for kind, o, layout in jobs]


def resumed_across(dist, jobs: list[tuple[str, dict, dict, dict, str]]) -> list[dict]:
    """Each (kind, overrides, first, then, directory): steps 0-2 under layout ``first``, saved (DCP), the rest
    resumed under ``then``; a layout with pp > 1 runs as a pipeline, any other as mg.parallelize
    (tests/_hf_layouts.py's train, which builds the default model: overrides only with pipelines)."""
    def part(kind: str, overrides: dict, layout: dict, ckpt: str, stop_after: int | None) -> dict:
        if layout.get("pp", 1) > 1:
            return pipelined(dist, kind, overrides, layout, ckpt=ckpt, stop_after=stop_after)
        assert not overrides, "tests/_hf_layouts.train builds the default model"
        return hf.train(dist, kind, layout, ckpt=ckpt, stop_after=stop_after)

    out = []
    for kind, overrides, first, then, ckpt in jobs:
        part(kind, overrides, first, ckpt, 2)
        out.append(part(kind, overrides, then, ckpt, None))
    return out


def mismatched_tie(dist) -> str:
    """A hand-built pipeline whose tied copies differ in shape on the two stages: refused, the same line on both."""
    mesh = mg.parallel.mesh(dist, pp=2)
    part = nn.Sequential()
    part.add_module(str(mesh.pp_rank), nn.Linear(4, 4 + mesh.pp_rank))
    try:
        mg.parallel.Pipeline([part], [mesh.pp_rank], 2, mesh.pp_mesh.get_group(), dist.device, "gpipe", 2,
                             hf.loss_fn, tied=[["0.weight", "1.weight"]])
    except mg.UsageError as e:
        return str(e)
    return "accepted"


def refusals(dist, cases: list[dict]) -> list[str]:
    return [mismatched_tie(dist)] + hf.refusals(dist, cases)
