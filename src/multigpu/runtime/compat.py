"""The private torch APIs multigpu uses, in one place, so a torch upgrade has one file to check.

The project supports torch >= 2.7. Each entry says the torch versions it was
checked on: "2.13" is the installed 2.13.0 (CPU), "2.14" the 2.14.1 (CUDA)
wheel, "older source" a stored pytorch/pytorch source from before 2.7 that
has the same name (2.7 itself lies between, not read).
Every torch import here happens inside the function that needs it, as the
callers did before, so importing this module imports nothing beyond torch
(``torch.distributed.checkpoint`` costs about a second).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def dcp_load_in_place(state_dict: dict[str, Any], storage_reader: Any, planner: Any, no_dist: bool) -> None:
    """DCP's loader that fills ``state_dict`` itself (the public ``dcp.load`` copies into a new dict,
    so an empty dict filled by ``empty_load_planner()`` must go through this one, as torch's own
    ``dcp_to_torch_save`` does).

    ``torch.distributed.checkpoint.state_dict_loader._load_state_dict``: checked on 2.13, 2.14, older source.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict, storage_reader=storage_reader, planner=planner, no_dist=no_dist)


def empty_load_planner() -> type:
    """DCP's load planner that rebuilds the state dict from the checkpoint metadata
    (``keys=`` picks top-level entries); a class, for subclassing.

    ``torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner(keys=None, ...)``:
    checked on 2.13, 2.14, older source.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


def set_nested(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's flattening mapping) inside the nested ``root``.

    ``torch.distributed.checkpoint._nested_dict.set_element``: checked on 2.13 (re-exported there
    from ``_traverse``) and 2.14.
    """
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)


def ddp_first_bucket_bytes() -> int:
    """DDP's size limit for its first gradient bucket (1 MiB).

    ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: checked on 2.13, 2.14, older source.
    """
    import torch.distributed as tdist

    return tdist._DEFAULT_FIRST_BUCKET_BYTES


def ddp_bucket_assignment(params: list[torch.Tensor], limits: list[int]) -> list[list[int]]:
    """Indices into ``params`` per bucket, as DDP's Reducer assigns them (no sparse gradients).

    ``torch.distributed._compute_bucket_assignment_by_size(tensors, limits, expect_sparse_gradient)``,
    which returns ``(buckets, per_bucket_limits)``: checked on 2.13, 2.14; the name also in older source.
    """
    import torch.distributed as tdist

    buckets, _ = tdist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return buckets


def dump_nccl_trace() -> bytes:
    """The NCCL flight recorder's ring buffer, pickled; raises where there is none.

    ``torch._C._distributed_c10d._dump_nccl_trace()``: checked on 2.14 (CUDA); 2.13 CPU builds
    have no NCCL and so no such name (ImportError, which callers treat as "no trace").
    """
    from torch._C._distributed_c10d import _dump_nccl_trace

    return _dump_nccl_trace()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass has finished (after callbacks queued before).

    ``torch.autograd.Variable._execution_engine.queue_callback``: checked on 2.13, 2.14.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def fsdp_reduce_layout(module: torch.nn.Module) -> list[tuple[torch.nn.Parameter, int, int]]:
    """What FSDP2's reduce-scatter input holds for ``module``: per parameter, in the input's order,
    ``(sharded parameter, numel of its column block, data-parallel mesh dims)``.

    The input is ``shards x sum(blocks)`` (``foreach_reduce_scatter_copy_in``'s chunk-cat); the mesh
    dims past the data-parallel ones (1 for FSDP, 2 for HSDP) are tensor parallelism.
    ``FSDPModule._get_fsdp_state()._fsdp_param_groups[i].fsdp_params[j]`` with ``sharded_param``,
    ``padded_sharded_param_size`` and ``mesh_info.mesh``: checked on 2.13, 2.14 (older source has one
    ``_fsdp_param_group``).
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in [state._fsdp_param_group] if g is not None]
    return [(fp.sharded_param, fp.padded_sharded_param_size.numel(), fp.mesh_info.mesh.ndim)
            for g in groups for fp in g.fsdp_params]


def foreach_norms(tensors: list[torch.Tensor], weights: list[float] | None = None) -> list[torch.Tensor]:
    """Each tensor's L2 norm as an fp32 scalar (accumulated in fp32 whatever the dtype; in fp64 when a
    tensor is fp64, which torch refuses to narrow), times its weight when ``weights`` is given; one fused
    kernel for the lot.

    ``torch._foreach_norm(tensors, 2, dtype=torch.float32)`` and ``torch._foreach_mul_(tensors, scalars)``
    (what ``clip_grad_norm_`` runs; the public ``get_total_norm`` adds ~15 µs of Python per call):
    checked on 2.13. A torch without them (or without the ``dtype`` argument) gets the same numbers
    from public ops, one kernel per tensor.
    """
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    try:
        parts = list(torch._foreach_norm(tensors, 2, dtype=acc))
        if weights is not None:
            torch._foreach_mul_(parts, weights)
        return parts
    except (AttributeError, TypeError):  # pragma: no cover - a torch that renamed or dropped them
        parts = [torch.linalg.vector_norm(t, 2, dtype=acc) for t in tensors]
        return parts if weights is None else [p * w for p, w in zip(parts, weights)]


def batchnorm_base() -> type:
    """The base class of ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (a class, for subclassing and
    ``isinstance``; ``nn.modules.batchnorm`` is imported with ``torch.nn``).

    ``torch.nn.modules.batchnorm._BatchNorm``: checked on 2.13; torch has no public name for it.
    """
    return torch.nn.modules.batchnorm._BatchNorm


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, or None when ``model`` is not a compiled wrapper.

    ``OptimizedModule._orig_mod``: checked on 2.13. Read as an attribute, not by the class
    (``torch._dynamo.eval_frame.OptimizedModule``), so asking does not import dynamo.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def wrapped(model: Any) -> torch.nn.Module | None:
    """The module a wrapper holds (DDP's and DataParallel's ``.module``, ``torch.compile``'s original), or None
    when ``model`` is no wrapper: ``mg.unwrap`` and the spread record (``spreads.py``) peel by it."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return compiled_original(model) if isinstance(model, torch.nn.Module) else None


def direct_child(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """``module``'s registered child ``name``, or None: children only (``getattr`` would also find
    a parameter, a buffer or a plain attribute such as ``training``).

    ``nn.Module._modules``: checked on 2.13 (the dict every ``add_module`` writes to).
    """
    return module._modules.get(name)


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's placement for a tensor made of ``split_factor`` equal parts along ``dim``, each part
    sharded over the mesh dimension: rank r holds ``[part_0's r-th chunk, part_1's r-th chunk, ...]``
    and ``full_tensor()`` gives the parts back in one process's order (a fused q/k/v projection).

    ``torch.distributed.tensor.placement_types._StridedShard(dim, split_factor=...)``: checked on 2.13
    (its local layout and ``full_tensor()`` by tests/test_hf_gpt2_tp.py; FSDP2 accepts it on a 2-D mesh);
    older source has the same constructor (a frozen dataclass). Refused below 2.7, the project's floor:
    what older versions do with it was not checked.
    """
    from ..errors import UsageError

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 7):
        raise UsageError(f"tensor parallelism over a fused projection needs torch >= 2.7 (DTensor's _StridedShard), "
                         f"this is {torch.__version__}; upgrade torch or use tp=1 for this model")
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's ``_StridedShard`` (see ``strided_shard``): checked on 2.13.

    Read by the class's name, so asking imports nothing.
    """
    return type(placement).__name__ == "_StridedShard"


def watch_default_group(seen: Callable[[int], None]) -> Callable[[], None] | None:
    """Call ``seen(size)`` each time a default process group is set (``init_process_group``,
    ``init_device_mesh`` and ``mg.init`` all pass through torch's one setter), until the returned undo is
    called; None where this torch has no such setter (the launcher then draws no verdict from it).

    ``torch.distributed.distributed_c10d._update_default_pg(pg)``: checked on 2.13.
    """
    import torch.distributed as tdist

    if not tdist.is_available():
        return None
    from torch.distributed import distributed_c10d as c10d

    original = getattr(c10d, "_update_default_pg", None)
    if not callable(original):
        return None

    def update_default_pg(pg: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(pg, *args, **kwargs)
        try:
            seen(int(pg.size()))
        except Exception:  # noqa: BLE001 - None when a group is destroyed; a foreign object is no group
            pass
        return result

    c10d._update_default_pg = update_default_pg

    def undo() -> None:
        c10d._update_default_pg = original

    return undo


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (``Tensor._is_view``: private)."""
    return t._is_view()


# The logger of DTensor's redistribution advice (a private module's name): quieted where multigpu measures.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


_FIRST_INPUT: list[type] = []


def first_input_style_type() -> type:
    """A ``PrepareModuleInput`` for a module's first input only, by overriding its private
    ``_prepare_input_fn`` / ``_prepare_input_arg`` / ``_apply`` (torch 2.7-2.13): the class, built once."""
    if _FIRST_INPUT:
        return _FIRST_INPUT[0]
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class FirstInput(PrepareModuleInput):
        def __init__(self, name: str | None, src: Any, dst: Any, check: Callable[[Any, Any], None] | None,
                     then: Any) -> None:
            kwargs = {"input_kwarg_layouts": {name: src}, "desired_input_kwarg_layouts": {name: dst}} if name else {}
            super().__init__(input_layouts=(src,), desired_input_layouts=(dst,), use_local_output=True, **kwargs)
            self.check, self.then = check, then
            self.label = f"PrepareModuleInput({src} -> {dst})"

        def _prepare_input_fn(self, inputs, device_mesh):
            if not isinstance(inputs, tuple):
                inputs = (inputs,)
            if not inputs:  # passed by name: _prepare_input_kwarg_fn prepares it
                return inputs
            first = self._prepare_input_arg(inputs[0], device_mesh, self.input_layouts[0],
                                            self.desired_input_layouts[0])
            return (first, *inputs[1:])

        def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
            if self.check is not None and input_layout is not None:
                self.check(input, mesh)
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

        def _apply(self, module, device_mesh):
            super()._apply(module, device_mesh)
            if self.then is not None:
                self.then._apply(module, device_mesh)
            return module

    _FIRST_INPUT.append(FirstInput)
    return FirstInput


def first_input_style(name: str | None, src: Any, dst: Any, check: Callable[[Any, Any], None] | None = None,
                      then: Any = None) -> Any:
    """``PrepareModuleInput`` of a module's first input only, passed by position or by ``name`` (the other
    inputs pass through as they are); ``check(input, mesh)`` before the redistribution; ``then``: another
    style applied to the module after this one."""
    return first_input_style_type()(name, src, dst, check, then)
