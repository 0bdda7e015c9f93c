"""PEFT adapters (``peft.get_peft_model``) under tensor parallelism: each plan entry on a LoRA-wrapped Linear,
translated once into styles for the layers inside it.

PEFT wraps a projection ``q_proj`` in a ``lora.Linear`` holding ``base_layer`` (the original Linear) and,
per adapter, ``lora_A[name]`` (in -> r) and ``lora_B[name]`` (r -> out); its output is
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. A PEFT model's names gain ``base_model.model.``
in front of the transformers model's. For the sum to equal one process's:

- column-wise (q/k/v, gate/up): the input is whole on every rank, so ``lora_A`` stays whole (its gradient
  the full one on every rank, as DTensor's all-reduce of the input gradient gives), and ``lora_B`` is split
  by output rows like ``base_layer``: each rank adds its rows of the adapter's output to its rows of the
  base output.
- row-wise (o, down): the input is split by features, so ``lora_A`` is split by input columns like
  ``base_layer`` and its r-wide partial sums are all-reduced (small: r features), then ``lora_B`` runs
  whole on every rank; the base output is all-reduced once by its own style, the adapter's once by
  ``lora_A``'s, and each is added once.

What this cannot do exactly is refused in one line naming it: dropout > 0 (a rank draws its mask over
its share of the features, one process over all of them), DoRA (its norm is over the whole weight),
LoRA on an embedding under a plan, other adapter types on a planned module, and sequence parallelism.
A module PEFT trains a copy of (``modules_to_save``: a head) takes the entry's style on the original and on
each copy. A plan found in the blocks plans an adapter layer as the projection it wraps (``auto.found_plan``).
A PEFT model made from a model already spread is refused (``check_wrapped_whole``).
Nothing here imports peft unless the model came from it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ...errors import UsageError

PREFIX = "base_model.model."  # what a PEFT model's names gain before the transformers model's


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (FSDP's subclass of one included); peft is not imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def wrapped_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a PEFT model (its names are ``PREFIX`` + the model's), else None."""
    if not is_peft(model):
        return None
    inner = model.get_submodule(PREFIX.rstrip("."))
    return inner if isinstance(inner, nn.Module) else None


def check_wrapped_whole(model: nn.Module, what: str) -> None:
    """Refuse a PEFT model built on a model already spread (``mg.from_pretrained``, ``mg.parallelize``): its
    adapters were made from sharded layers after the spreading, which neither shards nor synchronises them
    (FSDP fails on their shapes; under TP they silently compute something else)."""
    from ...spreads import spread_of

    inner = wrapped_model(model)
    if inner is not None and spread_of(model) is None and spread_of(inner) is not None:
        raise UsageError(f"{what} got a PEFT model whose {type(inner).__name__} was spread before get_peft_model "
                         "added its adapters; build the PEFT model on the whole model (transformers' "
                         "from_pretrained on every rank), then spread it: mg.parallelize(get_peft_model(model, "
                         "config), layout)")


def adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT adapter layer (a LoRA Linear wrapping its ``base_layer``, or another kind)."""
    return "peft" in sys.modules and isinstance(module, sys.modules["peft"].tuners.tuners_utils.BaseTunerLayer)


def _trained_copy(module: nn.Module) -> bool:
    """PEFT's ``modules_to_save`` wrapper: the original module and a trained copy per adapter, one of which
    runs (the same computation, so a plan entry's style applies to each of them)."""
    return "peft" in sys.modules and isinstance(module, sys.modules["peft"].utils.other.ModulesToSaveWrapper)


def _refuse(name: str, what: str) -> UsageError:
    return UsageError(f"tensor parallelism of the adapter on {name}: {what} is not built yet (it would not compute "
                      "what one process does); use tp=1 with adapters (DDP, FSDP and HSDP train them exactly), "
                      "or drop it from the adapter's config")


def _check_lora(name: str, module: nn.Module) -> list[str]:
    """The adapter names of the LoRA Linear ``module``, or a one-line refusal of what TP cannot do exactly."""
    from peft.tuners import lora

    if isinstance(module, lora.Embedding):
        raise _refuse(name, "LoRA on an embedding")
    if not isinstance(module, lora.Linear) or not isinstance(module.base_layer, nn.Linear):
        parts = type(module).__module__.split(".")
        kind = f"a {parts[2]} adapter" if parts[1:2] == ["tuners"] and len(parts) > 3 else "PEFT's"
        raise _refuse(name, f"{kind} {type(module).__name__} on a {type(getattr(module, 'base_layer', module)).__name__}")
    adapters = list(module.lora_A)
    for adapter in adapters:
        if module.use_dora.get(adapter):
            raise _refuse(name, "DoRA (use_dora=True)")
        dropout = module.lora_dropout[adapter]
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise _refuse(name, f"lora_dropout={dropout.p} (a rank would draw its mask over its share of the "
                               "features); lora_dropout=0.0")
    return adapters


def adapter_styles(model: nn.Module, styles: dict[str, Any], sequence_parallel: bool) -> dict[str, Any]:
    """``styles`` with every entry on a LoRA-wrapped Linear replaced by the entries for the layers inside it
    (module docstring); unchanged for a model without adapters."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, Any] = {}
    for name, style in styles.items():
        module = model.get_submodule(name)
        if _trained_copy(module):  # modules_to_save: the original and each trained copy sharded alike
            out[f"{name}.original_module"] = style
            out |= {f"{name}.modules_to_save.{adapter}": style for adapter in module.modules_to_save}
            continue
        if not adapter_layer(module):
            out[name] = style
            continue
        adapters = _check_lora(name, module)
        if sequence_parallel:
            raise _refuse(name, "sequence parallelism")
        if type(style) is ColwiseParallel and all(isinstance(p, Replicate) for p in style.input_layouts):
            out[f"{name}.base_layer"] = style
            for adapter in adapters:  # lora_A stays whole: its input is
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                                                  use_local_output=style.use_local_output)
        elif type(style) is RowwiseParallel and all(isinstance(p, Replicate) for p in style.output_layouts):
            out[f"{name}.base_layer"] = style
            for adapter in adapters:  # lora_B stays whole: lora_A's partial sums are all-reduced
                out[f"{name}.lora_A.{adapter}"] = RowwiseParallel(input_layouts=style.input_layouts[0],
                                                                  use_local_output=True)
        else:
            raise _refuse(name, f"the style {style!r} on a LoRA-wrapped Linear (column-wise and row-wise are built)")
    return out
