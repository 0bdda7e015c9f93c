"""``multigpu ckpt import HF_DIR OUT``: a Hugging Face directory (transformers' ``save_pretrained``) as a new run
directory ``OUT`` holding one checkpoint, ``OUT/step-0``, in the Checkpointer's own format, which
``mg.Checkpointer(OUT, ...).resume()`` loads onto any layout (continued pretraining from a published model).

The checkpoint holds the model's weights as transformers' ``from_pretrained`` gives them (the config's dtype,
tied copies under each name, a mixture's experts fused as transformers 5 fuses the tensors it stores one per
expert, persistent buffers the files lack as ``__init__`` computes them), and nothing
else: no optimizer state (a published model has none), no loader position, no RNG states. Its manifest says
``imported``, so a resume keeps the optimizer, scheduler, loader and random states as the run built them
(fresh) and says so in one line, and returns step 0 (``loading.load_imported``).

The safetensors are read tensor by tensor (``safe_open``, each cast to the model's dtype as it is read), so the
process holds the model once, written by DCP as one rank, and checked, hashed and renamed into place by the
Checkpointer's own ``storage.finish``, under a temporary name renamed when complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError
from . import storage

STRATEGY = "imported"  # the manifest's strategy: no run wrote it


def import_hf(hf_dir: str | Path, out: str | Path) -> dict[str, int | str]:
    """Write the Hugging Face directory ``hf_dir`` as a new run directory ``out`` holding the checkpoint
    ``out/step-0`` that ``mg.Checkpointer(out, ...)`` resumes from on any layout, the optimizer fresh;
    (checkpoint, tensors, parameters, bytes).

    >>> import_hf("checkpoints/llama", "runs/continued")   # then mg.Checkpointer("runs/continued", ...).resume()
    """
    from ..pretrained import _empty, check_names, checkpoint_tensors
    from ..pretrained.experts import Names
    from ..pretrained.save import _cause

    root, out = Path(hf_dir), Path(out)
    tensors = checkpoint_tensors(root)  # the loader's checks: a directory, config.json, safetensors, every shard
    if out.exists():
        raise UsageError(f"ckpt import writes a new run directory, but {out} exists; pass another path or remove it")
    model = _empty(root, None, None)  # on the meta device, its buffers real: the names, shapes and dtypes
    names = Names(model, tensors, root)
    check_names(model, names.tensors, root)
    state = _read(model, root, tensors, names)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as the Checkpointer creates its directory
        partial.mkdir()
        final = _write(state, partial, root, model)
        os.replace(partial, out)
    except (OSError, CheckpointException) as e:  # DCP's writer wraps a full disk in its own exception
        raise UsageError(f"ckpt import could not write {out}: {_cause(e)}; nothing was left there") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    step = out / final.name
    return {"checkpoint": str(step), "tensors": len(state), "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": sum(f.stat().st_size for f in step.rglob("*") if f.is_file())}


def _read(model: torch.nn.Module, root: Path, tensors: dict, names) -> dict[str, torch.Tensor]:
    """The model's state, every name ``model.state_dict()`` has (the keys the Checkpointer saves and loads),
    read tensor by tensor in the model's dtype; a tied copy is the same tensor as the one the files hold; a
    mixture's fused experts stacked from their per-expert tensors by transformers' own converter
    (``pretrained/experts.py``, as ``mg.from_pretrained`` reads them)."""
    from safetensors import safe_open

    from ..pretrained.experts import _converted

    state: dict[str, torch.Tensor] = {}
    by_key: dict[str, torch.Tensor] = {}
    opened: dict[str, object] = {}

    with contextlib.ExitStack() as files:
        def reader(key: str):
            file = tensors[key][1]
            if file not in opened:
                opened[file] = files.enter_context(safe_open(str(root / file), framework="pt"))
            return lambda: opened[file].get_tensor(key)

        for name, like in model.state_dict(keep_vars=True).items():
            if (stacked := names.stacked.get(name)) is not None:
                pieces = {p: [reader(k) for k in keys] for p, keys in stacked.keys.items()}
                state[name] = _converted(stacked.converter, name, pieces, model)[name].to(like.dtype).contiguous()
                continue
            key = names.read_as.get(name)
            if key is None or key not in tensors:
                if like.is_meta:  # check_names found every tensor a parameter needs: a bug, not an input
                    raise UsageError(f"ckpt import found no tensor for {name} in {root}; report this model")
                state[name] = like.detach().clone()  # a buffer the files lack: as __init__ computes it
                continue
            if key not in by_key:  # as transformers' from_pretrained: the stored tensor cast to the parameter's dtype
                by_key[key] = reader(key)().to(like.dtype).contiguous()
            state[name] = by_key[key]
    return state


def _write(state: dict[str, torch.Tensor], partial: Path, root: Path, model: torch.nn.Module) -> Path:
    """``partial/step-0`` written by DCP as one process and completed by the Checkpointer's own
    ``storage.finish`` (manifest with every file's checksum, rename, COMPLETE marker)."""
    import torch.distributed.checkpoint as dcp

    tmp, final = storage.tmp_dir(partial, 0), storage.step_dir(partial, 0)
    tmp.mkdir()
    with storage.single_process_ok():
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True,
                                                                       single_file_per_rank=True), no_dist=True)
    files = storage.hash_files(tmp, storage.list_files(tmp))
    manifest = {
        "format": storage.FORMAT,
        "step": 0,
        "world_size": 1,
        "strategy": STRATEGY,
        "imported": {"from": str(root.resolve()), "model": type(model).__name__},
        **storage.provenance(),
        "state_keys": ["model"],
        "optimizer_fresh": True,
        "loader": None,
        "extra": {},
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "model_tensors": len(state),
        "files": files,
        "bytes": sum(v["bytes"] for v in files.values()),
    }
    storage.finish(tmp, final, manifest)
    return final
