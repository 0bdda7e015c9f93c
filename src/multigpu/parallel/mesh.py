"""The one device-mesh builder: ``Layout.device_mesh`` calls it with the resolved degrees.

``world = pp x dp_replicate x dp_shard x tp``, outer to inner, as torchtitan
and Accelerate order them: a tensor-parallel group is a run of consecutive
ranks (the GPUs of one node, where TP's per-layer collectives belong), and
the data-parallel rank is the flattened (replicate, shard) coordinate.
"""

from __future__ import annotations

from typing import Any

_MESHES: dict[Any, Any] = {}


def device_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """The one device-mesh builder (collective the first time: every rank calls it), on the job's device
    type (gloo meshes are "cpu", NCCL meshes "cuda"). Built once per shape in a process group and reused:
    each ``init_device_mesh`` creates new process groups that live as long as the job, so a process that
    spreads many models (tune, verify, the test zoo) would otherwise gather hundreds of them, each
    collective slower for it."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    world = tdist.group.WORLD  # another object after the group is torn down and started again
    if _MESHES.get("world") is not world:
        _MESHES.clear()
        _MESHES["world"] = world
    key = (device_type, tuple(sizes), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    return _MESHES[key]
