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


def saved_by_a_block(dist, kinds: list[str], layouts: list[dict | None], seq: int = 16) -> dict:
    """For each of ``kinds``: the bytes autograd saves in the model's second block (a storage once, the weights
    left out) for one forward of 2 sequences of ``seq`` under each of ``layouts`` (None: the plain model), and
    that block's input bytes on one rank: what forecast's activation memory under tp is checked against."""
    return {kind: _saved(kind, layouts, seq) for kind in kinds}


def _saved(kind: str, layouts: list[dict | None], seq: int) -> dict:
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    out = {"saved": []}
    for layout in layouts:
        model = hf.build(kind)
        if layout is not None:
            model = mg.parallelize(model, mg.parallel.Layout(**layout), verbose=False)
        weights = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        block, seen, on = mg.unwrap(model).model.layers[1], {}, [False]

        def pack(t):
            s = local(t).untyped_storage()
            if on[0] and s.data_ptr() not in weights:
                seen[s.data_ptr()] = s.nbytes()
            return t

        def enter(module, args, kwargs):
            on[0] = True
            if layout is None:
                x = args[0] if args else next(iter(kwargs.values()))
                out["input"] = x.numel() * x.element_size()

        handles = [block.register_forward_pre_hook(enter, with_kwargs=True),
                   block.register_forward_hook(lambda *_: on.__setitem__(0, False))]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hf.logits_of(model, torch.zeros(2, seq, dtype=torch.long))
        for h in handles:
            h.remove()
        out["saved"].append(sum(seen.values()))
    return out
