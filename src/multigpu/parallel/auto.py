"""What a model says about itself, or what can be found in it: its repeated blocks and its tensor-parallel plan.

Blocks: the classes a transformers model declares (``_no_split_modules``,
what Accelerate's and HF Trainer's auto-wrap read), else the class repeated
in the model's largest container of one class (``layers``, ``h``,
``blocks``; a ResNet's stages). Plans: the user's, else the one the model
declares (``model.tp_plan``, ``base_model_tp_plan``), else one found from the
module pattern (q/k/v column-wise and o row-wise, gate/up column-wise and
down row-wise, inside the repeated blocks; GPT-2's Conv1D c_attn, fused q/k/v, column-wise in 3 parts, c_fc
column-wise, c_proj row-wise, with ``hf/conv1d.py``'s styles). Plans may use ``*`` for one
name component (``model.layers.*.mlp.down_proj``) and transformers' style
names (``"colwise"``, ``"rowwise"``...), translated here to PyTorch's
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``. Every
entry must name a module the model has, and every module a style shards
must be one the style can shard, or the plan is refused naming it.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..errors import UsageError
from ..runtime.values import positive_int

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

# transformers' style names -> (torch style, its keyword layouts). Both 4.x names (colwise_rep, rowwise_rep)
# and 5.x names (colwise_gather_output, embedding_rowwise, rowwise_split_input); "replicate" means
# nothing to shard (the parameter stays a plain tensor, equal on every TP rank since its inputs are).
HF_STYLES = {
    "colwise": ("ColwiseParallel", {}),
    "rowwise": ("RowwiseParallel", {}),
    "colwise_rep": ("ColwiseParallel", {"output_layouts": "Replicate"}),
    "colwise_gather_output": ("ColwiseParallel", {"output_layouts": "Replicate"}),
    "rowwise_rep": ("RowwiseParallel", {"input_layouts": "Replicate"}),
    "rowwise_split_input": ("RowwiseParallel", {"input_layouts": "Replicate"}),
    "embedding_rowwise": ("RowwiseParallel", {"input_layouts": "Replicate"}),
    "sequence_parallel": ("SequenceParallel", {}),
    "replicate": (None, {}),
    # Parameters shared by the heads this rank holds (Qwen3's q_norm/k_norm): whole on every rank, their
    # gradients summed over the TP ranks (tp.headwise_replicated).
    "replicated_with_grad_allreduce": ("headwise_replicated", {}),
}

# The names the pattern search knows: a column-wise set followed by one row-wise projection in the same
# parent (attention: q, k, v then o; MLP: gate, up then down).
# GPT-2's (transformers' Conv1D): c_attn fuses q, k, v; c_fc (E -> 4E) is one projection, c_proj the row-wise one
# of both its attention and its MLP.
COLWISE_NAMES = {"q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "wq", "wk", "wv",
                 "q_lin", "k_lin", "v_lin", "gate_proj", "up_proj", "up", "w1", "w3", "fc1", "fc_in", "c_fc", "lin1"}
ROWWISE_NAMES = {"o_proj", "out_proj", "out", "o", "wo", "out_lin", "down_proj", "down", "w2", "fc2", "fc_out",
                 "c_proj", "lin2", "Wo"}
FUSED_NAMES = {"c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "gate_up_proj", "in_proj", "Wi"}
GATHERED = -1  # found_plan's mark for a fused nn.Linear: column-wise with its output gathered


# A block smaller than this is not worth its own all-gather: it joins its
# parent's. At fp32 1M parameters are 4 MB, about where NCCL collectives stop
# being latency-bound (see docs/strategies.md).
DEFAULT_MIN_BLOCK_PARAMS = 1_000_000


def check_block_options(block_classes: Any, min_block_params: Any) -> None:
    if block_classes is not None and (isinstance(block_classes, type) or not all(isinstance(c, type) for c in block_classes)):
        raise UsageError(f"fsdp block_classes must be a list of module classes, got {block_classes!r}; "
                         "e.g. block_classes=[TransformerBlock] (mg.wrap(model, 'fsdp', ...) or mg.parallelize)")
    positive_int(min_block_params, "fsdp min_block_params")


def _first_name(model: nn.Module, cls_name: str) -> str:
    return next((n for n, m in model.named_modules() if type(m).__name__ == cls_name), "?")


def declared_blocks(model: nn.Module) -> list[type]:
    """The classes of ``model``'s modules named in its ``_no_split_modules`` (transformers' declaration)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return sorted({type(m) for m in model.modules() if type(m).__name__ in names}, key=lambda c: c.__name__)


def found_blocks(model: nn.Module) -> list[type]:
    """The class repeated in the containers of ``model`` (ModuleList, Sequential, ModuleDict with 2 or more
    children all of one class), the one whose instances there hold the most parameters."""
    weight: dict[type, int] = {}
    for m in model.modules():
        if isinstance(m, CONTAINERS) and len(m) >= 2:
            kinds = {type(c) for c in m.children()}
            if len(kinds) == 1:
                cls = kinds.pop()
                if not issubclass(cls, CONTAINERS) and any(True for _ in next(iter(m.children())).parameters()):
                    weight[cls] = weight.get(cls, 0) + sum(p.numel() for p in m.parameters())
    if not weight:
        return []
    return [max(weight, key=lambda c: weight[c])]


def blocks_of(model: nn.Module, block_classes: Any = None) -> tuple[list[type], str]:
    """The block classes to spread by, and where they came from (for the one-line report)."""
    if block_classes is not None:
        check_block_options(block_classes, DEFAULT_MIN_BLOCK_PARAMS)  # mg.wrap's one-line refusal, also under DDP
        return list(block_classes), "given"
    declared = declared_blocks(model)
    if declared:
        return declared, "declared _no_split_modules"
    found = found_blocks(model)
    return found, "found repeated" if found else "none found"


def block_modules(model: nn.Module, classes: list[type] | None = None) -> list[tuple[str, nn.Module]]:
    classes_t = tuple(blocks_of(model)[0] if classes is None else classes)
    return [(n, m) for n, m in model.named_modules() if classes_t and isinstance(m, classes_t)]


def block_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, container) of the stack the hidden states pass through block by block, what a pipeline cuts and
    forecast counts per block: of the containers (ModuleList, ModuleDict, Sequential) whose first child holds
    parameters, the longest whose children all are, or hold, ``blocks_of``'s blocks (RoBERTa-PreLayerNorm
    declares its self-attention; Mllama's layers are of two classes), else the longest (a model of one block
    has nothing repeated); None if none. Not the root (an nn.Sequential model's children are its layers), nor a
    vision tower's list or a block's own list of attentions where the blocks lie elsewhere."""
    classes = tuple(blocks_of(model)[0])
    stacks = [(n, m) for n, m in model.named_modules() if n and isinstance(m, CONTAINERS) and len(m)
              and has_params(next(iter(m.children())))]
    holds = lambda m: all(any(isinstance(b, classes) for b in c.modules()) for c in m.children())  # noqa: E731
    return max(stacks, key=lambda nm: (holds(nm[1]), len(nm[1])), default=None)


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def declared_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan a transformers model declares, with names from the model's root; None if it declares none.
    A PEFT model's is its transformers model's, under the names PEFT gives it (``hf/lora.py``)."""
    from .hf import lora

    if (inner := lora.wrapped_model(model)) is not None:
        plan = declared_plan(inner)
        return None if plan is None else {lora.PREFIX + k: v for k, v in plan.items()}
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        owner = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        return {(f"{owner}.{k}" if owner else k): v for k, v in base.items()}
    return None


def _fused_or_conv(module: nn.Module, name: str) -> str | None:
    """Why PyTorch's own TP styles cannot shard ``module`` (a Conv1D, a fused projection), or None."""
    leaf = name.rpartition(".")[2]
    if type(module).__name__ == "Conv1D":
        return "a Conv1D (a Linear stored transposed)"
    if leaf in FUSED_NAMES:
        return "a fused projection (several projections in one weight)"
    return None


def _projection(module: nn.Module) -> bool:
    from .hf.conv1d import is_conv1d

    return isinstance(module, nn.Linear) or is_conv1d(module)


def _style(module: nn.Module, kind: str, parts: int = 1) -> Any:
    """nn.Linear: transformers' style names; Conv1D: multigpu's Conv1D styles (a fused one split by parts)."""
    from .hf.conv1d import Conv1DColwise, Conv1DRowwise, is_conv1d

    if is_conv1d(module):
        return Conv1DColwise(parts) if kind == "col" else Conv1DRowwise()
    return "colwise" if kind == "col" else "rowwise"


def _kind(parent_leaf: str, leaf: str, fused: bool) -> str | None:
    """"col", "row" or None for a projection by its name and its parent's: q/k/v, gate/up (and the fused ones)
    column-wise, o/down row-wise; an encoder's ``intermediate.dense`` column-wise and ``output.dense``
    (BERT's attention output and MLP down, each in a module of its own) row-wise."""
    if leaf in COLWISE_NAMES or fused or (parent_leaf, leaf) == ("intermediate", "dense"):
        return "col"
    if leaf in ROWWISE_NAMES or (parent_leaf, leaf) == ("output", "dense"):
        return "row"
    return None


def found_plan(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """A plan from the module pattern inside the blocks: the known column-wise projections (nn.Linear, or
    transformers' Conv1D: GPT-2) each run of which, in the block's order, is followed by one known row-wise
    projection (Llama: q, k, v then o, gate and up then down; BERT: query, key, value then
    attention.output.dense, intermediate.dense then output.dense). A fused projection is split when it is
    GPT-2's (a Conv1D c_attn of 3 equal parts that its attention's split_size cuts apart); a fused
    nn.Linear (ModernBERT's Wqkv and Wi) is split with its output gathered, the row-wise projection after it
    taking the whole input; a fused Conv1D of unequal parts is refused naming it."""
    from .hf.conv1d import fused_parts

    from .hf.conv1d import is_conv1d

    plan: dict[str, Any] = {}
    from .hf import lora

    for block_name, block in blocks:
        run: list[tuple[str, nn.Module, int]] = []
        wrapper = None  # a PEFT adapter layer is planned as the projection it wraps, its insides skipped
        for name, module in block.named_modules(prefix=block_name):
            if wrapper and name.startswith(wrapper):
                continue
            if lora.adapter_layer(module):
                wrapper, module = f"{name}.", getattr(module, "base_layer", module)
            if not _projection(module):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parts = 0
            if leaf in FUSED_NAMES and is_conv1d(module):
                parts, why = fused_parts(model.get_submodule(parent_name), leaf, module)
                if not parts:
                    raise UsageError(
                        f"tensor parallelism found {name} in {type(model).__name__}, {why}; use tp=1 for this model "
                        "(DDP, FSDP, HSDP and pipelines apply), a model with separate q/k/v projections (Llama, "
                        "Qwen), or pass tp_plan without it")
            elif leaf in FUSED_NAMES:
                parts = GATHERED  # a fused nn.Linear: how the model cuts it apart is in its forward only
            kind = _kind(parent_name.rpartition(".")[2], leaf, parts != 0)
            if kind == "col":
                run.append((name, module, parts or 1))
                continue
            if kind == "row" and run:
                if any(k == GATHERED for _, _, k in run):
                    # Its output gathered whole on every rank (and the row-wise one after it taking the whole
                    # input) is exact whatever the fusion; a split one would be cut apart by the model's own
                    # view(..., num_heads, ...) at the wrong places (ModernBERT's Wqkv, a silent error).
                    plan |= {n: "colwise_gather_output" for n, _, _ in run} | {name: "rowwise_split_input"}
                else:
                    plan |= {n: _style(m, "col", k) for n, m, k in run} | {name: _style(module, "row")}
            run = []  # a row-wise one closes a run; an unknown projection breaks it
    return plan


# transformers' styles for a mixture of experts' fused expert weights (3-D parameters inside one module):
# multigpu leaves them to expert parallelism (ep spans the TP ranks) and, without it, keeps them whole.
EXPERT_STYLES = {"moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert"}


def without_experts(plan: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a declared plan without its entries for the experts, those entries): an entry styled for experts or
    naming something inside an ``experts`` module (transformers names the experts' fused weights,
    parameters of one module, e.g. ``layers.*.mlp.experts.down_proj``). Kept whole on every TP rank, the
    experts compute on the replicated hidden states each rank holds there, as one process does."""
    dropped = [k for k, v in plan.items() if v in EXPERT_STYLES or "experts" in k.split(".")]
    return {k: v for k, v in plan.items() if k not in dropped}, dropped


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def expand(model: nn.Module, plan: dict[str, Any], declared: bool = False) -> dict[str, Any]:
    """The plan with ``*`` entries expanded to the module names they match; an entry matching nothing is refused,
    unless the model declared the plan (``declared``: transformers' plans name the modules of every variant of
    an architecture, e.g. Qwen2-MoE's dense MLPs that a configuration with every layer sparse does not have)."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    missing = []
    for key, style in plan.items():
        matched = [n for n in names if _pattern(key).match(n)] if "*" in key else ([key] if key in names else [])
        if not matched:
            missing.append(key)
        for n in matched:
            out[n] = style
    if missing and not declared:
        example = next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), names[0] if names else "")
        raise UsageError(f"tensor-parallel plan names modules {type(model).__name__} does not have: "
                         f"{', '.join(missing[:4])}; use names from model.named_modules() (wildcard * for one "
                         f"component), e.g. {example}")
    return out


def translate(style: Any, name: str) -> Any:
    """A torch ParallelStyle for ``style`` (one already, or a transformers style name); None: leave replicated."""
    if not isinstance(style, str):
        return style
    if style not in HF_STYLES:
        raise UsageError(f"tensor-parallel plan gives {name} the style {style!r}, which multigpu does not translate; "
                         f"use one of {', '.join(HF_STYLES)}, or a torch ParallelStyle object")
    import torch.distributed.tensor as dtensor
    import torch.distributed.tensor.parallel as tp

    cls, layouts = HF_STYLES[style]
    if cls is None:
        return None
    if cls == "headwise_replicated":
        from .tp import headwise_replicated

        return headwise_replicated()
    return getattr(tp, cls)(**{k: getattr(dtensor, v)() for k, v in layouts.items()})


def _gathered(style: Any) -> bool:
    """A column-wise style whose output is gathered whole on every TP rank (transformers' colwise_gather_output)."""
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in getattr(style, "output_layouts", ()) or ())


def check_shardable(model: nn.Module, plan: dict[str, Any], tp: int, declared: bool = False) -> None:
    """Refuse a style on a module it cannot shard, or a sharded size ``tp`` does not divide, naming the module.

    A fused nn.Linear (q, k and v, or gate and up, in one weight: Phi-3's qkv_proj) is sharded column-wise
    when its output is gathered whole (exact whatever the fusion: every rank then holds the full fused
    output; transformers declares Phi-3's so), or when the model itself declares the sharded split
    (``declared``: GPT-NeoX's query_key_value holds q, k, v per head, so a split by rows is a split by
    heads); a sharded split the model does not declare, or a row-wise one, is refused naming it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .hf import conv1d

    for name, style in plan.items():
        if isinstance(style, (conv1d.Conv1DColwise, conv1d.Conv1DRowwise)):
            conv1d.check(model, name, style, tp)
            continue
        module = model.get_submodule(name)
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        kind = "column-wise" if isinstance(style, ColwiseParallel) else "row-wise"
        why = _fused_or_conv(module, name)
        if (why and isinstance(module, nn.Linear) and isinstance(style, ColwiseParallel)
                and (_gathered(style) or declared)):
            why = None
        if why and isinstance(module, nn.Linear) and isinstance(style, ColwiseParallel):
            raise UsageError(f"tensor-parallel plan shards {name} column-wise with its output left split, but it is "
                             f"{why}, whose parts a split by rows does not follow; give it 'colwise_gather_output' "
                             "(exact for any fusion; the row-wise projection after it then takes "
                             "'rowwise_split_input'), or use tp=1 for this model")
        if why or not isinstance(module, (nn.Linear, nn.Embedding)):
            hint = (" (the plan multigpu finds, tp_plan=None, shards GPT-2's Conv1D)" if conv1d.is_conv1d(module)
                    else "")
            raise UsageError(f"tensor-parallel plan shards {name} {kind}, but it is {why or 'a ' + type(module).__name__}: "
                             f"PyTorch's TP styles shard nn.Linear and nn.Embedding only; drop it from the plan "
                             f"(it stays replicated){hint} or use tp=1 for this model")
        if isinstance(module, nn.Linear):
            size, what = (module.out_features, "output features") if kind == "column-wise" else (module.in_features, "input features")
        else:
            size, what = (module.embedding_dim, "embedding dim") if kind == "column-wise" else (module.num_embeddings, "vocabulary")
        if size % tp:
            raise UsageError(f"tensor-parallel degree {tp} does not divide {name}'s {what} {size} ({kind}); "
                             f"use a tp that divides {size}, or drop {name} from the plan")


HEAD_ATTRS = {"num_heads": "attention heads", "n_head": "attention heads", "n_heads": "attention heads",
              "num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
              "n_kv_heads": "KV heads", "num_kv_heads": "KV heads"}


def head_counts(model: nn.Module) -> dict[str, int]:
    """Attention and KV head counts the model states (its config, or attributes of its modules)."""
    out: dict[str, int] = {}
    config = getattr(model, "config", None)
    sources = ([config] if config is not None else []) + list(model.modules())
    for src in sources:
        for attr, what in HEAD_ATTRS.items():
            value = getattr(src, attr, None) if attr in getattr(src, "__dict__", {}) or src is config else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and what not in out:
                out[what] = value
    return out
