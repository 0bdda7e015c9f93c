"""Hugging Face checkpoints in and out, on any layout, without any process holding the whole model.

``load.py`` reads, ``save.py`` writes, ``experts.py`` converts names and per-expert tensors (transformers' own
mapping).

``mg.from_pretrained(path, layout)`` builds the model from its ``config.json`` with its parameters on the
meta device (its buffers real, computed by its own ``__init__`` as ``from_pretrained`` computes them:
accelerate's ``init_empty_weights``), spreads it with ``mg.parallelize``, allocates only this rank's shards
and fills them from the safetensors files through PyTorch's own ``HuggingFaceStorageReader`` (DCP reads each
rank's slices of each tensor, nothing more). Under DDP (nothing sharded) every rank holds the whole model
by definition: it is loaded first and then spread, its plan checked on a probe batch as usual.

``mg.save_pretrained(model, directory)`` writes the reverse from any layout: ``HuggingFaceStorageWriter``
saves every rank's shards and consolidates them tensor by tensor into safetensors files with their index,
beside ``config.json`` (and ``generation_config.json``), under a temporary name renamed when complete.
Both take the checkpoint's names as transformers does, through its own conversion mapping
(``experts.py``): a mixture of experts' per-expert tensors are read by rank, each rank stacking only
the experts it holds into transformers 5's fused tensors, and written back per expert; a checkpoint whose
names are not the model's even so is refused in one line naming the keys that differ.
"""

from .load import INDEX, SINGLE, _empty, check_names, checkpoint_tensors, from_pretrained  # noqa: F401 (hf_export: _empty)
from .save import DEFAULT_SHARD_BYTES, _expected, save_pretrained  # noqa: F401 (the module's names before it was a package)

__all__ = ["from_pretrained", "save_pretrained"]
