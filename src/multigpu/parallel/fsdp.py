"""Strategy ``"fsdp"``: PyTorch's FSDP2 (``fully_shard``), applied per block.

Each rank keeps 1/N of every parameter, gradient and optimizer state; a
block's full parameters exist only while that block runs (all-gather before,
free after when ``reshard_after_forward``), and gradients are reduce-scattered
straight into shards. The unit of sharding is a block: one all-gather and one
reduce-scatter per block and step, so the peak memory is the sharded state
plus about one block's full parameters.

``fully_shard`` changes the module in place (its class becomes an
``FSDPModule`` subclass and its parameters become ``DTensor`` shards), so
``mg.unwrap`` returns the module itself, and ``module.state_dict()`` holds
DTensors: use ``mg.full_state_dict(model)`` for plain full tensors, or
``torch.distributed.checkpoint`` (``get_state_dict``/``set_state_dict``) for
sharded checkpoints that resume under any strategy.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as tdist
from torch import nn

from ..errors import UsageError
from ..runtime.values import DTYPES, TRAINING_DTYPES
from .auto import DEFAULT_MIN_BLOCK_PARAMS, blocks_of, check_block_options
from .batchnorm import prepare_batchnorm


def _fsdp2() -> Any:
    """FSDP2's module, imported on first use: it pulls in DTensor and device
    meshes, seconds of import time that `import multigpu` should not pay."""
    # Public since torch 2.6; pyproject requires >= 2.7, so no fallback to the old _composable path.
    import torch.distributed.fsdp as fsdp2

    return fsdp2



def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value in TRAINING_DTYPES:
        return DTYPES[value]
    raise UsageError(f"fsdp {name} must be a torch.dtype or one of {', '.join(TRAINING_DTYPES)}, got {value!r}; "
                     f"e.g. mg.wrap(model, 'fsdp', {name}='bf16')")


def _own_params(module: nn.Module, sharded: set[int]) -> int:
    """Parameters of ``module`` not already inside a sharded sub-block."""
    return sum(p.numel() for p in module.parameters() if id(p) not in sharded)


def _param_uses(module: nn.Module) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


def pick_blocks(model: nn.Module, block_classes: Iterable[type] | None, min_block_params: int) -> list[nn.Module]:
    """The sub-modules to shard separately, innermost first (the root is not included).

    With ``block_classes``, every instance of those classes; otherwise every
    module below the root whose parameters not yet in a smaller block number
    at least ``min_block_params`` (FSDP1's size-based auto-wrap rule).
    Modules sharing a parameter with a module outside them are never blocks.
    """
    blocks: list[nn.Module] = []
    sharded: set[int] = set()
    classes = tuple(block_classes or ())
    uses = _param_uses(model)

    def visit(module: nn.Module, is_root: bool) -> None:
        for child in module.children():
            visit(child, False)
        if is_root:
            return
        chosen = isinstance(module, classes) if classes else _own_params(module, sharded) >= min_block_params
        # A parameter tied to a module outside this one (a language model's
        # embedding and output head) must stay in one FSDP unit with both:
        # leave it to an enclosing block or the root.
        tied_out = any(_param_uses(module)[k] < uses[k] for k in _param_uses(module))
        if chosen and not tied_out and _own_params(module, sharded) > 0:
            blocks.append(module)
            sharded.update(id(p) for p in module.parameters())

    visit(model, True)
    return blocks


def _matched_blocks(model: nn.Module, block_classes: Iterable[type] | None, min_block_params: int) -> list[nn.Module]:
    """``pick_blocks``, refusing ``block_classes`` that match nothing (a typo would shard only the root)."""
    blocks = pick_blocks(model, block_classes, min_block_params)
    if block_classes is not None and not blocks:
        names = ", ".join(c.__name__ for c in block_classes)
        raise UsageError(f"fsdp block_classes [{names}] matched no module of {type(model).__name__} (tied-weight "
                         "modules do not count); pass the classes of its repeated blocks, or drop block_classes "
                         "to shard by size")
    return blocks


def _fsdp_imported() -> bool:
    import sys

    return "torch.distributed.fsdp" in sys.modules


def unit_rule(model: nn.Module, block_classes: Iterable[type] | None, min_block_params: int | None
              ) -> tuple[list[type] | None, int, str]:
    """(the block classes to shard by, the size rule's minimum, how they were chosen): the one rule of both
    FSDP entries (``mg.wrap(model, "fsdp")`` and ``mg.parallelize``). Given classes, or a given size, win;
    else the blocks the model declares (``_no_split_modules``), else its repeated blocks, else the size rule."""
    if block_classes is None and min_block_params is None:
        classes, source = blocks_of(model)
        block_classes = classes or None
    else:
        source = "given"
    minimum = DEFAULT_MIN_BLOCK_PARAMS if min_block_params is None else min_block_params
    if block_classes:
        names = ", ".join(c.__name__ for c in block_classes)
        return list(block_classes), minimum, f"{names} ({source})"
    return None, minimum, size_rule(minimum, "given" if min_block_params is not None else "no repeated blocks")


def size_rule(minimum: int = DEFAULT_MIN_BLOCK_PARAMS, why: str = "no repeated blocks") -> str:
    return f"blocks of >= {minimum:,} parameters ({why})"


def units_line(model: nn.Module, rule: str, experts: int = 0) -> str:
    """``3 units of ViTLayer (declared _no_split_modules) + the root``, counted from what was sharded (expert
    parallelism's ``experts`` modules, sharded over efsdp, counted apart)."""
    units = fsdp_modules(model)
    other = {id(m) for m in _other_dtype_modules(model, [])} & {id(u) for u in units}
    kept = f" + {len(other)} kept in their own dtype" if other else ""
    return (f"{len(units) - 1 - experts - len(other)} units of {rule}{f' + {experts} experts modules' if experts else ''}"
            f"{kept} + the root")


def wrap_fsdp(
    model: nn.Module,
    block_classes: Iterable[type] | None = None,
    min_block_params: int | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | str | None = None,
    reduce_dtype: torch.dtype | str | None = None,
    cpu_offload: bool = False,
    sync_batchnorm: bool = False,
) -> nn.Module:
    """FSDP2 per block, then on the root, the blocks chosen by ``unit_rule`` and said in one line. Returns the
    same module, sharded in place."""
    params = list(model.parameters())
    if not params:
        raise UsageError(f"strategy 'fsdp' shards parameters but {type(model).__name__} has none; "
                         "use strategy 'none' (or 'ddp') for a model without parameters")
    device = params[0].device
    if device.type == "meta":
        raise UsageError("strategy 'fsdp' got a model on the meta device; materialise it on dist.device first "
                         "(model.to_empty(device=dist.device) and initialise its weights)")
    check_block_options(block_classes, DEFAULT_MIN_BLOCK_PARAMS if min_block_params is None else min_block_params)
    block_classes, min_block_params, rule = unit_rule(model, block_classes, min_block_params)
    if not (tdist.is_available() and tdist.is_initialized()):
        raise UsageError("strategy 'fsdp' needs a process group; call mg.wrap inside `with mg.init() as dist:`")
    if tdist.get_backend() == "nccl" and device.type != "cuda":
        raise UsageError(f"strategy 'fsdp' over NCCL needs the model on the GPU but it is on {device.type}; "
                         "use mg.wrap(model.to(dist.device), 'fsdp')")
    # Check everything before changing the model: a refused call leaves it as it was.
    pdt, rdt = _dtype("param_dtype", param_dtype), _dtype("reduce_dtype", reduce_dtype)
    blocks = _matched_blocks(model, block_classes, min_block_params)
    model = prepare_batchnorm(model, "fsdp", sync_batchnorm, device)
    if sync_batchnorm:  # the conversion replaced BatchNorm modules: pick from the model as it is now
        blocks = pick_blocks(model, block_classes, min_block_params)
    from .layout import Layout

    # The one device mesh, of the layout that shards over every rank; on the parameters' device type (gloo
    # meshes are "cpu", NCCL meshes "cuda"), not what init_device_mesh would guess from what is installed.
    mesh = Layout(dp_shard=tdist.get_world_size()).device_mesh(device.type)["dp_shard"]
    model = _shard(model, blocks, mesh, reshard_after_forward, pdt, rdt, cpu_offload, device)
    from ..dist import print0

    print0(f"mg.wrap: FSDP over {tdist.get_world_size()} ranks: {units_line(model, rule)}")
    return model


def _shard(model: nn.Module, blocks: list[nn.Module], mesh: Any, reshard_after_forward: bool,
           pdt: torch.dtype | None, rdt: torch.dtype | None, cpu_offload: bool, device: torch.device,
           experts: tuple[list, Any] | None = None) -> nn.Module:
    fsdp2 = _fsdp2()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if pdt is not None or rdt is not None:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=rdt)
    if cpu_offload:
        # Pinned host memory makes the host<->GPU copies asynchronous; it
        # exists only with CUDA.
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # Expert parallelism's experts modules (experts.py) first, over the ranks that hold the same experts
    # (efsdp): the blocks around them then take only the dense parameters, over every dp_shard rank.
    modules, experts_mesh = experts or ([], None)
    # FSDP2 flattens a unit's parameters into one dtype: a module a model keeps in another dtype than the rest
    # (transformers' _keep_in_fp32_modules: a router's float32 gate in a bf16 model) becomes a unit of its own
    # first, without the mixed-precision cast, so it computes in its dtype as it does in one process.
    other_dtype = _other_dtype_modules(model, modules)
    for module in modules:
        fsdp2.fully_shard(module, **{**kwargs, "mesh": experts_mesh})
    for module in other_dtype:
        fsdp2.fully_shard(module, **{k: v for k, v in kwargs.items() if k != "mp_policy"})
    for block in (b for b in blocks if all(b is not m for m in modules)):  # an experts module is no block unit
        fsdp2.fully_shard(block, **kwargs)
    # The root takes whatever no block took (embeddings, heads, norms); FSDP2
    # itself keeps the root unsharded between forward and backward.
    fsdp2.fully_shard(model, **kwargs)
    return model


def _other_dtype_modules(model: nn.Module, skip: list[nn.Module]) -> list[nn.Module]:
    """The modules whose own parameters are in another dtype than most of the model's parameters (by count);
    refused in one line where one module holds parameters of two dtypes (no unit can take it)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=sizes.get)
    inside = {id(m) for s in skip for m in s.modules()}
    found = []
    for name, module in model.named_modules():
        dtypes = {p.dtype for p in module.parameters(recurse=False)}
        # A unit takes its submodules' parameters too: one kept in the other dtype over submodules in the main
        # one (DeepSeek-V4's attention: float32 sinks beside its float64 projections) is two dtypes in one unit.
        below = {p.dtype for p in module.parameters()} if dtypes and dtypes != {main} else set()
        if len(dtypes) > 1 or (module is model and dtypes and dtypes != {main}) or len(below) > 1:
            where = f"{name} holds {', '.join(sorted(str(d) for d in dtypes))}" if len(dtypes) > 1 else \
                f"the model itself holds {', '.join(str(d) for d in dtypes)} beside its blocks' {main}" \
                if module is model else f"{name} holds {', '.join(str(d) for d in dtypes)} and its submodules {main}"
            raise UsageError(f"FSDP shards a module's parameters in one dtype, but {where}; cast it to one "
                             "(module.to(dtype)), move the parameter into a module of its own, or keep the model in "
                             "one dtype")
        if dtypes and dtypes != {main} and id(module) not in inside:
            found.append(module)
    return found[::-1]  # submodules before the modules holding them: FSDP2 shards a unit's children first


def shard_blocks(model: nn.Module, mesh: Any, block_classes: Iterable[type] | None = None,
                 min_block_params: int = DEFAULT_MIN_BLOCK_PARAMS, reshard_after_forward: bool = True,
                 param_dtype: torch.dtype | str | None = None, reduce_dtype: torch.dtype | str | None = None,
                 cpu_offload: bool = False, experts: tuple[list, Any] | None = None) -> nn.Module:
    """FSDP2 per block and on the root over a given mesh: 1-D (FSDP) or 2-D (replicate, shard: HSDP).

    ``mg.parallelize``'s FSDP step, after tensor parallelism: the data-parallel dimensions
    (``layout.dp_mesh``) shard what TP left on each rank. ``experts``: (expert parallelism's experts
    modules, the mesh they are sharded over first).
    """
    check_block_options(block_classes, min_block_params)
    pdt, rdt = _dtype("param_dtype", param_dtype), _dtype("reduce_dtype", reduce_dtype)
    blocks = _matched_blocks(model, block_classes, min_block_params)
    device = next(model.parameters()).device
    return _shard(model, blocks, mesh, reshard_after_forward, pdt, rdt, cpu_offload, device, experts)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (without importing FSDP if it never was)."""
    if not _fsdp_imported():
        return []
    cls = _fsdp2().FSDPModule
    return [m for m in model.modules() if isinstance(m, cls)]


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` itself."""
    if not _fsdp_imported():
        return False
    return isinstance(model, _fsdp2().FSDPModule)
