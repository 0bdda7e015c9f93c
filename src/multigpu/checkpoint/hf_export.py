"""``multigpu ckpt export CHECKPOINT OUT --hf BASE_DIR``: a multigpu checkpoint of a transformers model, from
any layout, as the directory transformers' ``save_pretrained`` writes, one output file at a time.

The checkpoint's model tensors (DCP, any layout's shards) are read one output file's worth at a time (at most
``max_shard_bytes`` in memory, never the whole model), each written as a safetensors file, then the index;
``config.json``, ``generation_config.json`` and the tokenizer's files come from ``BASE_DIR``, the directory
the run started from (``mg.from_pretrained``'s): the checkpoint holds weights, not the model's description.
The tensors are checked against the model that config builds (names, shapes; a tied copy left out as
transformers leaves it out), and the directory is written under a temporary name renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..runtime import compat
from . import hf_files, storage

_DESCRIPTION = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def export_hf(checkpoint: str | Path, out: str | Path, base: str | Path,
              max_shard_bytes: int = hf_files.DEFAULT_SHARD_BYTES) -> dict[str, int]:
    """Write checkpoint ``checkpoint``'s model as a Hugging Face directory ``out``, described by ``base``'s
    config; (step, tensors, files, bytes).

    >>> export_hf("runs/x/step-120", "out/tuned", "checkpoints/llama")
    """
    from ..pretrained import _empty, _expected

    src, out, base = Path(checkpoint), Path(out), Path(base)
    manifest = storage.verified_model(src)
    if not (base / "config.json").is_file():
        raise UsageError(f"--hf takes the Hugging Face directory the run started from (its config.json describes "
                         f"the model), but {base} has no config.json")
    if out.exists():
        raise UsageError(f"export --hf writes a new directory, but {out} exists; pass another path or remove it")
    if not out.parent.is_dir():
        raise UsageError(f"the parent of export target {out} does not exist; create {out.parent} first")
    stored = _stored(src)
    model = _empty(base, None, None)  # on the meta device: the names and shapes, and transformers' naming
    wanted = _expected(model)
    names = [n for n, (_, tied) in wanted.items() if not tied]
    _check(stored, wanted, names, src, base)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    partial.mkdir()
    try:
        files, written = _write(src, stored, names, partial, max_shard_bytes, model)
        for name in _DESCRIPTION:
            if (base / name).is_file():
                shutil.copy2(base / name, partial / name)
        os.replace(partial, out)
    except OSError as e:
        raise UsageError(f"export --hf could not write {out}: {e.strerror or e}; nothing was left there") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"step": manifest["step"], "tensors": written, "files": files, "bytes": size}


def _stored(src: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint's model tensors: name -> (shape, dtype), from its metadata (nothing read)."""
    metadata = storage.SafeReader(src).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            out[key[len("model."):]] = (tuple(meta.size), meta.properties.dtype)
    return out


def _check(stored: dict, wanted: dict, names: list[str], src: Path, base: Path) -> None:
    missing = [n for n in names if n not in stored]
    unexpected = [n for n in stored if n not in wanted]
    if missing or unexpected:
        raise UsageError(f"checkpoint {src} is not of the model {base / 'config.json'} describes: "
                         f"{hf_files.name_mismatch(missing, unexpected)}; pass the directory the run started from")
    for n in names:
        if tuple(wanted[n][0]) != stored[n][0]:
            raise UsageError(f"checkpoint {src}: {n} has shape {list(stored[n][0])} but the model of "
                             f"{base / 'config.json'} has {list(wanted[n][0])}; pass the directory the run started from")


def _write(src: Path, stored: dict, names: list[str], partial: Path, limit: int, model: Any) -> tuple[int, int]:
    """The safetensors files and their index, one file's tensors in memory at a time, under the names
    transformers' ``save_pretrained`` writes (a mixture's experts one tensor each: ``pretrained/experts.py``);
    (how many files, how many tensors)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ..pretrained.experts import per_expert_state

    sizes = {n: torch.Size(stored[n][0]).numel() * torch.empty((), dtype=stored[n][1]).element_size() for n in names}
    groups: list[list[str]] = []
    for n, i in hf_files.shard_files(sizes, limit).items():  # transformers' split, as save_pretrained's
        if i > len(groups):
            groups.append([])
        groups[-1].append(n)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        tensors = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for n in group}
        compat.dcp_load_in_place({"model": tensors}, storage_reader=storage.SafeReader(src),
                                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors, _ = per_expert_state(model, tensors)
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(partial / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(groups), len(weight_map)
