"""Worker for tests/test_float8.py: the tiny GPT with its blocks' Linear layers in emulated float8 (torchao),
trained 3 SGD steps under one layout; its full weights, losses and FSDP's float8 weight scales returned.

float32, not float64: torchao's emulated float8 matmul computes in float32 whatever the input dtype. Every
layout runs micro-batches of 2 samples, one process too (accumulating 4 of them): an activation's float8
scale is the amax of the tensor a rank holds, so a layout equals one process that runs the same micro-batches,
and another micro-batch size is another (equally valid) float8 rounding.
"""

import contextlib
import dataclasses
import io

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.recipes.gpt.model import GPT, config
from multigpu.recipes.gpt.parallelize import spread

from _gpt_layouts import full, tokens

GLOBAL_BATCH, MICRO_BATCH, BLOCK = 8, 2, 16


def _float8_linears(model):
    from multigpu.parallel.float8 import is_float8_linear

    return {n: m for n, m in mg.unwrap(model).named_modules() if is_float8_linear(m)}


def _shard_scales(model) -> None:
    """The planted bug: each FSDP shard's weight scale from its own shard's amax instead of the whole weight's."""
    from torchao.float8.float8_utils import tensor_to_scale

    for m in _float8_linears(model).values():
        local = m.weight._local_tensor
        local._precomputed_scale = tensor_to_scale(local._tensor, m.config.cast_config_weight.target_dtype)


def _scales(model) -> dict:
    """Each float8 weight's scale for the next forward: FSDP's precomputed one where the weight is sharded by
    FSDP, else torchao's scale of the whole weight (what one process casts by)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_utils import tensor_to_scale

    out = {}
    for name, m in _float8_linears(model).items():
        w = m.weight
        local = w._local_tensor if isinstance(w, DTensor) else w
        scale = getattr(local, "_precomputed_scale", None)
        if scale is None:
            scale = tensor_to_scale(full(w).float(), m.config.cast_config_weight.target_dtype)
        out[name] = float(scale)
    return out


def _model(dist, recipe: str, seed: int, bias: bool, tied: bool):
    torch.manual_seed(seed)
    model = GPT(config("tiny", block_size=BLOCK, tie_embeddings=tied))  # the full model, on every rank
    if not bias:
        for m in model.blocks.modules():
            if isinstance(m, torch.nn.Linear):
                m.bias = None
    amp = mg.Precision("fp8", dist.device, recipe=recipe)
    # The tiny GPT's layers are below torchao's size rule: name them (the head stays out).
    return amp.convert(model, include=["blocks"], verbose=False), amp


def train(dist, layout: dict, recipe: str = "tensorwise", steps: int = 3, plant: str | None = None,
          seed: int = 0, bias: bool = True, tied: bool = True) -> dict:
    """``bias=False``: the blocks' Linear layers without biases, which take torchao's float8 TP styles;
    ``tied=False``: the head has its own weight (as a pipeline needs); a layout with ``pp`` runs ``pipeline``."""
    if layout.get("pp", 1) > 1:
        return pipeline(dist, layout, recipe, steps, seed, bias)
    layout = dict(layout)
    model, amp = _model(dist, recipe, seed, bias, tied)
    layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
    layout = dataclasses.replace(layout, micro_batch=MICRO_BATCH)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        model = spread(model, layout, verbose=True)  # its lines captured: the float8 styles line among them
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plan = layout.plan(GLOBAL_BATCH, dist)
    losses = []
    for _, micro_batches in zip(range(steps), mg.loader(tokens(seed=1 + seed), plan, dist, seed=0)):
        total = 0.0
        for x, y in mg.accumulate(model, micro_batches):
            with amp.autocast():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / plan.accum_steps
            amp.scale(loss).backward()
            total += float(full(loss))
        amp.step(opt)  # under FSDP: the float8 weights' scales for the next step, from the whole weights
        opt.zero_grad(set_to_none=True)
        if plant == "shard_scales":
            _shard_scales(model)
        losses.append(total)
    net = mg.unwrap(model)
    state = {k: full(v).float() for k, v in net.state_dict().items()}
    return {"state": state, "losses": losses, "scales": _scales(model), "mesh": layout.label,
            "float8": len(_float8_linears(model)), "said": said.getvalue()}


def pipeline(dist, layout: dict, recipe: str, steps: int, seed: int, bias: bool) -> dict:
    """The untied GPT in pipeline stages (the GPT recipe's ``pipeline``), each micro-batch of 2 samples."""
    from multigpu.recipes.gpt.parallelize import pipeline as gpt_pipeline

    model, amp = _model(dist, recipe, seed, bias, tied=False)
    layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
    layout = dataclasses.replace(layout, micro_batch=MICRO_BATCH)
    plan = layout.plan(GLOBAL_BATCH, dist)
    pipe = gpt_pipeline(model, layout, plan)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for _, micro_batches in zip(range(steps), mg.loader(tokens(seed=1 + seed), plan, dist, seed=0)):
        losses.append(pipe.step(micro_batches))
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    mine = {k: full(v).float() for part in pipe.modules for k, v in part.state_dict().items()}
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, mine)
    state = {k: v for d in gathered for k, v in d.items()}
    converted = {n for part in pipe.modules for n, m in part.named_modules() if _is_float8(m)}
    names = [None] * dist.world_size  # data-parallel ranks hold the same stages: the layers counted once
    torch.distributed.all_gather_object(names, converted)
    from multigpu.parallel.float8 import refresh_scales

    refresh_scales(pipe.modules)  # what the next pipe.step does first: the scales its forward casts by
    scales = [None] * dist.world_size  # the stages' own weights: amp.convert's model lent them its copies
    torch.distributed.all_gather_object(scales, {k: v for part in pipe.modules for k, v in _scales(part).items()})
    return {"state": state, "losses": losses, "scales": {k: v for d in scales for k, v in d.items()},
            "mesh": layout.label, "float8": len(set().union(*names)), "said": ""}


def _is_float8(m) -> bool:
    from multigpu.parallel.float8 import is_float8_linear

    return is_float8_linear(m)


def train_layouts(dist, runs: list[dict]) -> list[dict]:
    """Several runs (``{"layout": ..., "recipe": ..., "plant": ...}``) in the same processes, one start-up."""
    return [train(dist, **run) for run in runs]
