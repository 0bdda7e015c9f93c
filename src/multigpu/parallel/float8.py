"""Float8 training through torchao: which Linear layers convert, the TP styles they take, FSDP's scales.

``mg.Precision("fp8")`` converts a model with torchao's ``convert_to_float8_training``
(``Float8Linear`` layers: float8 matmuls, master weights kept in the model's
dtype) before ``mg.parallelize`` spreads it. Nothing here re-implements torchao:
the layer rule is its ``_auto_filter_for_recipe``, the TP styles its
``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, FSDP's weight scales its
``precompute_float8_dynamic_scale_for_fsdp``. torchao is imported only when
float8 is asked for (the ``fp8`` extra).

Where a float8 path would compute something other than one process does, the
plain path is kept and said: torchao's float8 TP styles cast a layer's output
gradient to float8 before the layer's bias takes its gradient from it, while
one process's ``Float8Linear`` gives the bias the unrounded gradient (measured:
1.5e-2 on the tiny GPT's biases), so a biased layer keeps PyTorch's own styles
(its matmuls are float8 all the same; only the TP communication stays in the
model's dtype). The float8 styles assume tensorwise scaling (torchao's
docstrings), so the rowwise recipe keeps PyTorch's styles too, as torchtitan does.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import UsageError

RECIPES = ("tensorwise", "rowwise")
REQUIREMENT = "torchao>=0.18"
# torchao's rule (_auto_filter_for_tensorwise / _rowwise, measured on H100): below these sizes the casts cost
# more than the float8 matmul saves. Stated here because a user reads it in the refusal; torchao decides.
RULE = {"tensorwise": "both dims multiples of 16, and not (in_features <= 4096 and out_features <= 1024)",
        "rowwise": "both dims multiples of 16, out_features > 2048, in_features > 1024, "
                   "and not (out_features <= 4096 and in_features <= 2048)"}
# torchao's float8 grouped GEMM (torchao.prototype.moe_training) has no emulated mode, so it cannot be checked
# against one process on CPU: experts held as 3-D weights stay in the model's dtype (nn.Linear experts convert).
EXPERTS = ("its 3-D expert weights stay in the model's dtype (torchao's float8 grouped GEMM is a prototype without "
           "an emulated mode)")


def torchao_float8() -> Any:
    """``torchao.float8``, or a one-line refusal naming the extra that installs it."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise UsageError(f"float8 training needs {REQUIREMENT}, which is not installed ({err}); "
                         "pip install 'multigpu[fp8]', or use precision 'bf16'") from None
    return float8


def check_device(device: torch.device) -> bool:
    """True when float8 runs emulated (CPU); refuses a GPU without float8 units (compute capability < 8.9)."""
    if device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UsageError(f"precision 'fp8' needs a GPU with float8 units (compute capability 8.9 or more: Ada, Hopper, "
                         f"Blackwell), got {torch.cuda.get_device_name(device)} ({major}.{minor}); "
                         "use precision 'bf16' on this GPU")
    return False


def config(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; under tensorwise FSDP2 all-gathers the weights in float8
    (the scale from the whole weight: one all-reduce of every layer's amax, ``refresh_scales``)."""
    float8 = torchao_float8()
    base = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate, enable_fsdp_float8_all_gather=recipe == "tensorwise")


def _covers(names: Iterable[str], fqn: str) -> bool:
    """A module name covers itself and what it holds (``"blocks.0"`` covers ``"blocks.0.mlp.up"``)."""
    return any(fqn == n or fqn.startswith(n + ".") or n == "" for n in names)


def _tied(model: nn.Module) -> set[str]:
    """Linear layers whose weight another module holds too (a head tied to the embedding): float8's weight
    wrapper would give the Linear its own parameter and untie them."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    return {n for group in owners.values() if len(group) > 1 for n in group
            if isinstance(model.get_submodule(n), nn.Linear)}


def choose(model: nn.Module, recipe: str, include: Iterable[str] = (), exclude: Iterable[str] = ()
           ) -> tuple[list[str], list[str]]:
    """(the Linear layers to convert, those left out with why): torchao's rule for ``recipe`` unless ``include``
    names them (then they must have dims that are multiples of 16, which float8 matmuls need) or ``exclude``
    does; a tied weight is never converted."""
    include, exclude = list(include), list(exclude)
    name = type(model).__name__
    modules = dict(model.named_modules())
    if unknown := [n for n in include + exclude if n not in modules]:
        raise UsageError(f"float8 include/exclude name modules {name} does not have: {', '.join(unknown[:6])}; "
                         f"use names from model.named_modules(), e.g. {', '.join(list(modules)[1:4])}")
    if any(is_float8_linear(m) for m in modules.values()):
        raise UsageError(f"{name} already has float8 layers (amp.convert ran on it); convert a model once, "
                         "before mg.parallelize")
    linears = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear)]
    if not linears:
        raise UsageError(f"precision 'fp8' converts torch.nn.Linear layers, but {name} has none; "
                         "use precision 'bf16' for this model")
    if bad := sorted({str(m.weight.dtype) for _, m in linears} - {"torch.float32", "torch.bfloat16"}):
        raise UsageError(f"float8 training keeps its master weights in float32 or bfloat16, got {', '.join(bad)} in "
                         f"{name}; build the model in float32 (or .to(torch.bfloat16)) before amp.convert(model)")
    auto = torchao_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])
    tied = _tied(model)
    chosen, left = [], []
    for fqn, m in linears:
        shape = f"{m.out_features} x {m.in_features}"
        if _covers(exclude, fqn):
            left.append(f"{fqn} (excluded)")
        elif _covers(include, fqn):
            if m.in_features % 16 or m.out_features % 16 or fqn in tied:
                why = "its weight is tied to another module's" if fqn in tied else f"{shape} is not a multiple of 16"
                raise UsageError(f"float8 cannot convert {fqn}: {why}; leave it out of include= "
                                 "(float8 matmuls need dims that are multiples of 16, and a tied weight would be untied)")
            chosen.append(fqn)
        elif fqn in tied:
            left.append(f"{fqn} (tied weight)")
        elif auto(m, fqn):
            chosen.append(fqn)
        else:
            left.append(f"{fqn} ({shape})")
    if not chosen:
        largest = max(linears, key=lambda nm: nm[1].weight.numel())
        raise UsageError(f"no Linear layer of {name} is converted to float8: {recipe}'s rule ({RULE[recipe]}) leaves "
                         f"out all {len(linears)} (the largest: {largest[0]}, {largest[1].out_features} x "
                         f"{largest[1].in_features}), where float8 would be slower; name the ones to convert anyway: "
                         f"amp.convert(model, include=[{largest[0]!r}]), or use precision 'bf16'")
    return chosen, left


def convert(model: nn.Module, recipe: str, emulate: bool, include: Iterable[str] = (),
            exclude: Iterable[str] = ()) -> tuple[nn.Module, str]:
    """torchao's ``convert_to_float8_training`` on the layers ``choose`` picks; (the model, one line saying what)."""
    chosen, left = choose(model, recipe, include, exclude)
    keep = set(chosen)
    model = torchao_float8().convert_to_float8_training(model, config=config(recipe, emulate),
                                                        module_filter_fn=lambda _m, fqn: fqn in keep)
    how = "emulated: float8 rounding, float32 matmuls" if emulate else "on torch._scaled_mm"
    experts = f"; {EXPERTS}" if any(p.dim() == 3 for p in model.parameters()) else ""
    return model, f"mg.Precision('fp8'): {describe(recipe, len(chosen), left, how)}{experts}"


def describe(recipe: str, converted: int, left: list[str], how: str = "") -> str:
    """"N of M Linear layers in float8 (recipe[, how]); left out: ...": what training and forecast both print."""
    out = f"; left out: {', '.join(left[:6])}" + (f", ... ({len(left) - 6} more)" if len(left) > 6 else "") if left else ""
    return f"{converted} of {converted + len(left)} Linear layers in float8 ({recipe}{', ' + how if how else ''}){out}"


def is_float8_linear(module: nn.Module) -> bool:
    """Without importing torchao: no module is a ``Float8Linear`` unless torchao's module was loaded."""
    loaded = sys.modules.get("torchao.float8.float8_linear")
    return loaded is not None and isinstance(module, loaded.Float8Linear)


def _moves_float8(style: Any) -> bool:
    """Whether torchao's float8 version of ``style`` sends float8 tensors between the TP ranks: a column-wise
    layer's input gathered from a split one (forward), a row-wise layer's output split (its gradient gathered
    in the backward). With replicated inputs and outputs every collective carries the model's dtype."""
    from torch.distributed.tensor import Replicate

    layouts = style.input_layouts if hasattr(style, "desired_input_layouts") else style.output_layouts
    return any(not isinstance(p, Replicate) for p in layouts)


def tp_styles(model: nn.Module, plan: dict[str, Any], tp_mesh: Any) -> tuple[dict[str, Any], str]:
    """``plan`` with torchao's float8 styles for the float8 layers that take them exactly (tensorwise, no bias;
    on gloo, which has no float8 collectives, only where no float8 tensor travels) in place of PyTorch's
    ``ColwiseParallel`` / ``RowwiseParallel``; what was done, in one line ("" if no float8 layer is in the plan)."""
    import torch.distributed as tdist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    converted = {k: model.get_submodule(k) for k in plan if is_float8_linear(model.get_submodule(k))}
    if not converted:
        return plan, ""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    gloo = tdist.get_backend(tp_mesh.get_group()) == "gloo"
    swapped, kept = [], {"biased": [], "rowwise": [], "gloo": []}
    out = dict(plan)
    for k, module in converted.items():
        style = plan[k]
        kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
        if kind is None:
            continue
        if module.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
            kept["rowwise"].append(k)
        elif module.bias is not None:
            kept["biased"].append(k)
        elif gloo and _moves_float8(style):
            kept["gloo"].append(k)
        else:
            out[k] = kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                          use_local_output=style.use_local_output)
            swapped.append(k)
    why = {"biased": "biased: torchao's float8 styles round the output gradient before the bias takes it",
           "rowwise": "rowwise scaling: the float8 styles are tensorwise",
           "gloo": "their float8 styles would send float8 over gloo, which has no float8 collectives"}
    said = "".join(f"; {len(v)} kept PyTorch's styles ({why[k]})" for k, v in kept.items() if v)
    return out, f"float8 tensor parallel: {len(swapped)} of {len(converted)} float8 layers take torchao's float8 styles{said}"


def refresh_scales(models: Iterable[nn.Module]) -> None:
    """Before a step's forward (after the optimizer step): every FSDP-sharded float8 weight's scale from the whole
    weight, all layers in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``). Without it
    torchao scales a weight at each all-gather by an amax reduced over the FSDP mesh only: per TP shard under
    FSDP x TP. Nothing when torchao's float8 was never loaded or no weight is sharded."""
    if sys.modules.get("torchao.float8.float8_linear") is None:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in models:
        precompute_float8_dynamic_scale_for_fsdp(model)
