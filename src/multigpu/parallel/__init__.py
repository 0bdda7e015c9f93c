"""How a model is spread over the ranks: the strategies and the one dispatcher that chooses between them.

``wrap.py`` is the dispatcher (``wrap``, ``unwrap``, ``optimizer``,
``accumulate``, ``no_sync``, ``strategy_of``); each strategy is one flat file
(``ddp.py``, ``dp.py``, ``zero.py``, ``fsdp.py``) and the pieces they share
sit beside them (``comm_hooks.py``, ``batchnorm.py``, ``clip.py``,
``footprint.py``). Model parallelism: ``mesh.py`` (the device mesh and the
data-parallel rank), ``tp.py`` (tensor-parallel plans), ``pp.py`` (pipeline stages and
their schedule). ``layout.py`` (the one ``Layout``), ``auto.py`` (blocks and plans a model declares or
that are found in it) and ``spread.py`` (``mg.parallelize``: TP, then FSDP/HSDP or DDP, for a whole
model or a pipeline stage): the one way to spread a model over a mesh. ``fsdp.shard_blocks`` is the
FSDP it applies, not a second way in (so not exported here).
"""

from .clip import clip_grad_norm_
from .context import context_share
from .layout import Layout
from .spread import parallelize
from .stages import pipeline
from .pp import Pipeline
from .tp import apply_tp, loss_parallel
from .wrap import STRATEGIES, accumulate, full_state_dict, no_sync, optimizer, strategy_of, unwrap, wrap

# The names the top-level package exports (wrap, accumulate, parallelize...) are left out here: one public
# name, one place (they stay importable from this package).
__all__ = ["STRATEGIES", "Layout", "Pipeline", "apply_tp", "loss_parallel", "no_sync", "pipeline", "strategy_of"]

# Names a user may have called that moved or went (CHANGELOG.md): what to write instead, in one line.
MOVED = {
    "shard_blocks": "mg.parallelize(model, mg.parallel.Layout()) (FSDP over the blocks the model declares or "
                    "repeats; block_classes= to choose them), or mg.wrap(model, 'fsdp')",
    "StageBlocks": "mg.parallel.pipeline(model, layout, loss_fn, plan): a stage keeps the model's own forward, "
                   "the other stages' blocks stand in at their indices",
    "mesh": "layout = mg.parallel.Layout(tp=2).resolve(dist.world_size); mg.parallelize(model, layout); "
            "plan = layout.plan(global_batch, dist) (the device mesh: layout.device_mesh(dist.device.type))",
    "Mesh": "mg.parallel.Layout: a resolved layout (layout.resolve(world_size)) owns the degrees, the data-parallel "
            "size and rank (layout.dp_rank(rank)) and the device mesh (layout.device_mesh(device_type))",
    "MeshShape": "mg.parallel.Layout(...).resolve(world_size): every degree set, with .dp_size and .world_size",
    "factor": "mg.parallel.Layout(tp=..., dp_replicate=..., pp=...).resolve(world_size) (dp_shard takes the rest)",
}


def __getattr__(name: str):
    if name in MOVED:
        raise AttributeError(f"mg.parallel.{name} is gone; use {MOVED[name]}")
    raise AttributeError(f"module 'multigpu.parallel' has no attribute {name!r}")
