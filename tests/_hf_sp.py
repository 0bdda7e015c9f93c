"""Workers for tests/test_hf_sequence_parallel.py: sequence parallelism derived from the plan a transformers
model declares (Llama, Qwen3), trained as ``_hf_layouts.train`` does (float64, 5 AdamW steps, accumulation 2,
clipping at 0.5), and the lines it refuses with."""

from __future__ import annotations

import torch

import multigpu as mg

import _hf_layouts as hf


_build = hf.build  # the model builder itself (train puts build in its place for a run)


def build(kind: str):
    """``_hf_layouts.build``'s model; "llama headless": a Llama whose plan leaves the head out (as a base model's
    has none): the split stream is then gathered at the last block's output, the final norm run whole."""
    model = _build(kind.split()[0])
    if kind.endswith(" headless"):
        model.tp_plan = {k: v for k, v in model.tp_plan.items() if k != "lm_head"}
    return model


def train(dist, kind: str, layout: dict) -> dict:
    """``_hf_layouts.train`` on ``build(kind)``'s model."""
    hf.build = lambda _kind, **overrides: build(kind)
    try:
        return hf.train(dist, kind, layout)
    finally:
        hf.build = _build


def odd_sequence(dist, kind: str, seq: int) -> str:
    """The line the first forward refuses a sequence length tp does not divide with (every rank alike)."""
    model = mg.parallelize(hf.build(kind), mg.parallel.Layout(tp=2, sequence_parallel=True), verbose=False)
    try:
        hf.logits_of(model, torch.zeros(2, seq, dtype=torch.long))
    except mg.UsageError as e:
        return str(e)
    return "accepted"


def runs(dist, trains: list[tuple[str, dict]], refusals: list[dict], odd: list[tuple[str, int]]) -> dict:
    """Training runs, refusals at mg.parallelize and at the first forward, all in the same processes."""
    return {"trains": [train(dist, kind, layout) for kind, layout in trains],
            "refusals": [hf.refusal(dist, **case) for case in refusals],
            "odd": [odd_sequence(dist, kind, seq) for kind, seq in odd]}
