"""Worker for tests/test_eval_layouts.py: a tiny language model in float64 (``own``: _hf_layouts.TinyLM, no
transformers import; ``llama``: 4 blocks, for sequence parallelism and pipelines) evaluated on held-out
sequences under a Layout by the README's pattern: ``mg.eval_loader``, per-rank sums, ``mg.all_reduce_sum``.

``how`` says how ``mg.eval_loader`` learns the layout: ``layout`` (the Layout), ``model`` (the model
``mg.parallelize`` returned) or ``none`` (nothing: the layout this process spread a model by). Under a pipeline the schedule's ``pipe.evaluate`` gives each group's mean
loss on the last stage; every stage counts its rows, and ``mg.all_reduce_sum`` must keep one count per
data-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import multigpu as mg

import _hf_layouts as hf

ROWS, BATCH, LAYERS = 101, 8, 4


def held_out(rows: int):
    return hf.tokens(rows, seed=5)


def _model(kind: str):
    return hf.build(kind, **({"num_hidden_layers": LAYERS} if kind == "llama" else {}))


def _sums(model, loader) -> dict:
    correct = count = loss = 0.0
    with torch.no_grad():
        for x, y in loader:
            logits = hf.full(hf.logits_of(model, x))
            correct += float((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += len(y)
    return mg.all_reduce_sum({"correct": correct, "count": count, "loss": loss})


def evaluate(dist, kind: str, layout: dict, how: str = "layout", rows: int = ROWS, batch: int = BATCH) -> dict:
    """The dataset-level sums every rank gets; ``layout`` {} is one process's model."""
    model, data = _model(kind), held_out(rows)
    if not layout:
        return _sums(model, mg.eval_loader(data, dist, batch))
    spread_by = mg.parallel.Layout(**layout)
    model = mg.parallelize(model, spread_by, verbose=False)
    told = {"layout": dict(layout=spread_by), "model": dict(layout=model), "none": {}}
    return _sums(model, mg.eval_loader(data, dist, batch, **told[how]))


def evaluate_pipeline(dist, kind: str, layout: dict, rows: int, batch: int = BATCH, accum: int = 4) -> dict | str:
    """Summed loss and row count through ``mg.parallel.pipeline``, or the line ``mg.eval_loader`` refuses with."""
    lay = mg.parallel.Layout(**layout, micro_batch=batch)
    plan = lay.plan(batch * accum * lay.resolve(dist.world_size).dp_size, dist)
    pipe = mg.parallel.pipeline(_model(kind), lay, hf.loss_fn, plan, verbose=False)
    try:
        batches = list(mg.eval_loader(held_out(rows), dist, batch, layout=lay))
    except mg.UsageError as e:
        return str(e)
    loss = count = 0.0
    for i in range(0, len(batches), plan.accum_steps):
        group = batches[i:i + plan.accum_steps]
        mean = pipe.evaluate(group)  # the mean per-token loss on the last stage's rank, None elsewhere
        if mean is not None:
            loss += float(mean) * sum(y.numel() for _, y in group)
        count += sum(len(y) for _, y in group)
    return mg.all_reduce_sum({"count": count, "loss": loss})


def cases(dist, kind: str, todo: list[tuple]) -> list:
    """Every case of model ``kind`` in the same processes (one start-up): ("eval", layout, how[, rows, batch]),
    ("pipeline", layout, rows), ("summary", layout)."""
    out = []
    for case, *args in todo:
        if case == "eval":
            out.append(evaluate(dist, kind, *args))
        elif case == "pipeline":
            out.append(evaluate_pipeline(dist, kind, *args))
        else:
            out.append(mg.parallel.Layout(**args[0]).plan(16, dist).summary())
    return out
