"""Tensor parallelism: a plan of PyTorch's parallel styles applied with ``parallelize_module``.

A plan maps module names to ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` / ``PrepareModuleInput`` (``torch.distributed.tensor.parallel``);
the GPT recipe has one (``multigpu.recipes.gpt.parallelize.tp_plan``) and a user
writes their own for their modules. ``apply_tp`` checks that every named module
exists, distributes the full model each rank built with the same seed (so the
weights equal one process's, which meta-device init does not give on CPU
meshes), and ties again the parameters that were tied before: a table shared
by the embedding and the head is sharded the same way by both and stays one
parameter. A module that ``mg.Precision("fp8").convert`` made a torchao
``Float8Linear`` takes torchao's float8 styles where they compute what one
process does (``float8.tp_styles``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from ..dist import print0
from ..errors import UsageError
from . import float8


def _aliases(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _set_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def apply_tp(model: nn.Module, tp_mesh: Any, plan: dict[str, Any], say: Any = print0) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` by ``plan``; returns it. ``say``: where the line on float8
    layers' styles goes (``mg.parallelize`` passes its own, silent under ``verbose=False``).

    >>> apply_tp(model, mesh.tp_mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    """
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(model.named_modules())
    missing = sorted(name for name in plan if name not in modules)
    if missing:
        raise UsageError(f"tensor-parallel plan names modules the model does not have: {', '.join(missing[:6])}; "
                         f"use names from model.named_modules(), e.g. {', '.join(list(modules)[1:4])}")
    tied = _aliases(model)
    plan, float8_line = float8.tp_styles(model, plan, tp_mesh)
    if float8_line:
        say(f"mg.parallelize: {float8_line}")
    parallelize_module(model, tp_mesh, plan)
    for group in tied:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            other = model.get_parameter(name)
            if other is not first:
                if getattr(other, "placements", None) != getattr(first, "placements", None):
                    raise UsageError(f"tied parameters {group[0]} and {name} are sharded differently by the plan "
                                     f"({getattr(first, 'placements', 'plain')} vs {getattr(other, 'placements', 'plain')}); "
                                     "give both modules styles that shard the shared tensor alike, or untie them")
                _set_parameter(model, name, first)
    return model


def headwise_replicated() -> Any:
    """A style for a module applied to each of this rank's attention heads with parameters the heads share
    (Qwen3's ``q_norm``/``k_norm``: an RMSNorm over head_dim; transformers' "replicated_with_grad_allreduce").

    The parameters are replicated on the TP ranks, and the input, (..., heads, head_dim) holding this
    rank's heads, is a DTensor sharded on the heads: each rank's gradient of the shared weight is its heads'
    share, and DTensor sums the shares (an all-reduce) as one process's gradient. A hook that all-reduces
    ``param.grad`` after accumulation (transformers' way) would also sum the earlier micro-batches' gradient,
    already reduced, again: tp times too much under gradient accumulation.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class HeadwiseReplicated(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            from torch.distributed.tensor import distribute_module

            def heads_sharded(_module, inputs, mesh):
                return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
                             if hasattr(x, "dim") and not isinstance(x, DTensor) else x for x in inputs)

            def local(_module, output, _mesh):
                return output.to_local() if isinstance(output, DTensor) else output

            # partition_fn None: every parameter replicated on the TP ranks
            return distribute_module(module, device_mesh, None, heads_sharded, local)

        def __repr__(self) -> str:
            return "HeadwiseReplicated()"

    return HeadwiseReplicated()


@contextlib.contextmanager
def loss_parallel(enabled: bool = True) -> Iterator[None]:
    """PyTorch's ``loss_parallel()`` when ``enabled``: cross-entropy on vocabulary-sharded logits.

    The forward's loss and its ``backward()`` both run inside it.

    >>> with mg.parallel.loss_parallel(args.loss_parallel):
    ...     loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()); loss.backward()
    """
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield
