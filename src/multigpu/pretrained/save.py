"""``mg.save_pretrained``: a transformers model written as its own ``save_pretrained`` writes it, from any layout.

``HuggingFaceStorageWriter`` saves every rank's shards and consolidates them tensor by tensor into safetensors
files with their index, beside ``config.json`` (and ``generation_config.json``), under a temporary name renamed
when complete; a mixture of experts' fused tensors are written one tensor per expert under the names
transformers writes (``experts.py``), each rank writing the experts it holds. A pipeline: each stage's ranks
write their stage's tensors, a tied tensor's copies (head on the last stage, table on the first) once. A PEFT
model: its adapter alone, in PEFT's format. The helpers ``mg.from_pretrained`` shares (the model's tensors
without tied copies, strided shards) are here, below it in the imports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.hf_files import DEFAULT_SHARD_BYTES, shard_files
from ..errors import UsageError
from .experts import per_expert_state



def _expected(model: nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The model's state names -> (shape, whether a tied copy of an earlier one, which a checkpoint leaves out)."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        out[name] = (tuple(tensor.shape), key in seen)
        seen.setdefault(key, name)
    return out


def _contiguous(t: torch.Tensor) -> list | None:
    """A DTensor's placements with each ``_StridedShard`` as the plain ``Shard`` of its dim, or None when it has
    none. DCP reads and writes a shard as the one box of the tensor it covers, but a strided shard is several
    (GPT-2's fused c_attn under TP: rank r holds q_r, k_r and v_r), which it takes for one: such a tensor is
    read and written through the contiguous layout, redistributed (one shard's worth at a time)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor) or not any(isinstance(p, _StridedShard) for p in t.placements):
        return None
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]


def _untied_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state without the tied copies a checkpoint leaves out (each tensor once, under its first name)."""
    tied = {n for n, (_, copy) in _expected(model).items() if copy}
    return {k: v for k, v in model.state_dict().items() if k not in tied}


def save_pretrained(model: nn.Module, directory: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``model`` (a transformers model, spread by any layout or not) as transformers' ``save_pretrained``
    does: safetensors files of at most ``max_shard_bytes`` with their index, ``config.json`` and
    ``generation_config.json``; every rank calls it (a pipeline: with the ``Pipeline`` or its ``.model``). Each
    rank writes its shards; they are consolidated tensor by tensor (no process gathers the model), under a
    temporary name renamed when complete.

    >>> mg.save_pretrained(model, "out/llama-tuned")   # AutoModelForCausalLM.from_pretrained("out/llama-tuned")
    """
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from ..parallel import unwrap
    from ..spreads import pipeline_of, refuse_stages

    pipe = pipeline_of(model)  # a pipeline (or its .model): each rank writes its own stages' tensors
    if pipe is None:
        refuse_stages(model, "save_pretrained", "pass the Pipeline (or its .model): every rank writes its stages")
    inner = unwrap(pipe.modules[0] if pipe is not None else model)  # a stage is a copy of the model: its config
    if getattr(inner, "config", None) is None or not hasattr(inner.config, "save_pretrained"):
        raise UsageError(f"save_pretrained writes a transformers model (with its config), got {type(inner).__name__}; "
                         "use mg.Checkpointer or mg.full_state_dict for your own model")
    out = Path(directory)
    on = tdist.is_available() and tdist.is_initialized()
    rank = tdist.get_rank() if on else 0
    if out.exists():
        raise UsageError(f"save_pretrained writes a new directory, but {out} exists; pass another path or remove it")
    if not out.parent.is_dir():
        raise UsageError(f"save_pretrained: the parent of {out} does not exist; create {out.parent} first")
    partial = out.with_name(f".{out.name}.partial")
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # an earlier attempt that did not finish
    if on:
        tdist.barrier()
    from ..parallel.hf.lora import check_wrapped_whole, is_peft

    check_wrapped_whole(inner, "save_pretrained")
    if is_peft(inner):  # a PEFT model: its adapter only, in PEFT's own format
        if pipe is not None:
            raise UsageError("save_pretrained of a PEFT adapter from a pipeline's stages is not built; save it from "
                             "a layout without pp (the adapter is small: load the model onto FSDP to export it)")
        return _save_adapter(inner, out, partial, rank, on)
    if pipe is not None:
        state, sizes = _pipeline_state(pipe)
    else:
        state, sizes = per_expert_state(inner, _writable(_untied_state(inner)))  # the names transformers writes
    files = shard_files(sizes, max_shard_bytes)
    state, scalars = _scalars_as_vectors(state, on)
    error = None
    try:
        writer = HuggingFaceStorageWriter(str(partial), fqn_to_index_mapping=files, save_distributed=True,
                                          enable_consolidation=True)
        dcp.save(state, storage_writer=writer, no_dist=not on)  # a failure on any rank raises on every rank
    except (OSError, CheckpointException) as e:
        error = _cause(e)
    if rank == 0 and error is None:
        try:
            inner.config.save_pretrained(str(partial))
            if getattr(inner, "generation_config", None) is not None and inner.can_generate():
                inner.generation_config.save_pretrained(str(partial))
            _keep_consolidated(partial)
            _restore_scalars(partial, scalars)
            os.replace(partial, out)
        except OSError as e:
            error = _cause(e)
    return _ended(error, out, partial, rank, on)


def _scalars_as_vectors(state: dict[str, torch.Tensor], on: bool) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``state`` with each 0-dim tensor as one of shape [1], and the names of those (every rank's): torch 2.13's
    consolidation of DCP's HF shards (``consolidate_safetensors_files``) writes a 0-dim tensor as zeros
    (Apertus' xIELU ``beta`` 0.5 read back as 0.0). Written with one dim, its header gets its shape back after
    (``_restore_scalars``)."""
    import torch.distributed as tdist

    scalars = [k for k, v in state.items() if v.dim() == 0]
    if on:  # a pipeline's stages hold different ones; rank 0 restores them all
        everyone: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(everyone, scalars)
        scalars = [k for per_rank in everyone for k in per_rank]
    return {k: v.reshape(1) if v.dim() == 0 else v for k, v in state.items()}, set(scalars)


def _restore_scalars(directory: Path, scalars: set[str]) -> None:
    """Give each of ``scalars`` its shape [] back in the header of the safetensors file holding it (the same
    bytes of data: one element either way), the header rewritten in place at its own length, padded with the
    spaces the format allows."""
    import json

    for file in sorted(directory.glob("*.safetensors")) if scalars else []:
        with open(file, "r+b") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
            held = [k for k in scalars if k in header]
            if not held:
                continue
            for k in held:
                header[k]["shape"] = []
            text = json.dumps(header, separators=(",", ":")).encode()
            if len(text) > length:  # a writer whose header was more compact than json's: not rewritten wrong
                raise OSError(f"the header of {file.name} does not fit its own length once its scalars' shapes "
                              "are restored")
            f.seek(8)
            f.write(text + b" " * (length - len(text)))


def _writable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each strided DTensor laid out contiguously (``_contiguous``: what DCP writes as one box)."""
    return {k: v if _contiguous(v) is None else v.redistribute(v.device_mesh, _contiguous(v)) for k, v in state.items()}


def _pipeline_state(pipe) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(what this rank's stages write, under transformers' names; every written tensor's bytes, in the whole
    model's order). A stage holds its own blocks under one process's names, so the ranks' keys differ and DCP
    writes each once (replicas, of a tensor-parallel or data-parallel coordinate, deduplicated by its planner).
    A tied tensor (the head on the last stage, the token table on the first) is a copy on each stage that uses
    it: written once, the copy ``Pipeline.clip_grad_norm_`` counts (the lowest stage's, transformers' name),
    after checking the copies are still equal. The file split needs every tensor's size, so the ranks' sizes
    are gathered: by stage id, which is the model's order."""
    import torch.distributed as tdist

    _check_tied_copies(pipe)
    state: dict[str, torch.Tensor] = {}
    sizes: list[tuple[int, list[tuple[str, int]]]] = []
    for stage, i in zip(pipe.modules, pipe.ids):
        copies = {n for n, p in stage.named_parameters(remove_duplicate=False) if id(p) in pipe.tied.skip}
        own = {k: v for k, v in _untied_state(stage).items() if k not in copies}
        written, stage_sizes = per_expert_state(stage, _writable(own))
        state.update(written)
        sizes.append((i, list(stage_sizes.items())))
    everyone: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, sizes)
    merged: dict[str, int] = {}
    for _, items in sorted((entry for per_rank in everyone for entry in per_rank), key=lambda e: e[0]):
        for name, size in items:
            merged.setdefault(name, size)
    return state, merged


def _check_tied_copies(pipe) -> None:
    """Refuse, in one line on every rank, a pipeline whose copies of a tied tensor differ (the Pipeline keeps them
    equal by summing their gradients; an optimizer that treats them apart, e.g. weight decay chosen by name,
    does not): writing one would export another model than the one trained. Each holder hashes its local
    shard; holders of one group, at one coordinate outside the pipeline, compare within the pipeline group."""
    import hashlib

    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    mine: dict[tuple, list[str]] = {}
    for params, order, _ in pipe.tied.sums:  # the holders' ranks name the group alike on each holder
        key = (tuple(order), sum(k[0] == tuple(order) for k in mine))
        local = [(p.to_local() if isinstance(p, DTensor) else p).detach().cpu().contiguous() for p in params]
        mine[key] = [hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for t in local]
    got: list = [None] * tdist.get_world_size(pipe.group)
    tdist.all_gather_object(got, mine, group=pipe.group)
    seen: dict[tuple, set[str]] = {}
    for per_rank in got:
        for key, digests in per_rank.items():
            seen.setdefault(key, set()).update(digests)
    differ = torch.tensor([float(any(len(d) > 1 for d in seen.values()))], device=pipe.stages[0].device)
    tdist.all_reduce(differ, op=tdist.ReduceOp.MAX)  # every pipeline group's verdict, on every rank
    if differ.item():
        raise UsageError("save_pretrained of a pipeline: the stages' copies of a tied tensor (the token table and "
                         "the head) differ, so one written would not be the model trained; give both copies the "
                         "same optimizer settings, or untie them (config.tie_word_embeddings=False)")


def _ended(error: str | None, out: Path, partial: Path, rank: int, on: bool) -> Path:
    """``out``, or one line on every rank when a write failed (rank 0's last steps are its own: every rank
    learns how they ended), the temporary directory removed."""
    import torch.distributed as tdist

    if on:
        said = [error]
        tdist.broadcast_object_list(said, src=0)
        error = said[0]
    if error is not None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise UsageError(f"save_pretrained could not write {out}: {error}; nothing was left there")
    return out


def _cause(e: BaseException) -> str:
    """An OSError's own words (a rank's inside DCP's CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        found = [exc for exc, _ in e.failures.values()]
        e = next((x for x in found if isinstance(x, OSError)), found[0] if found else e)
    return getattr(e, "strerror", None) or str(e)


def _keep_consolidated(partial: Path) -> None:
    """Keep the consolidated files and their index; the per-rank shards they were made from go."""
    sharded = partial / "sharded"
    if sharded.is_dir():
        shutil.rmtree(sharded)


def _save_adapter(model: nn.Module, out: Path, partial: Path, rank: int, on: bool) -> Path:
    """A PEFT model's adapter as ``PeftModel.save_pretrained`` writes it (``adapter_config.json``,
    ``adapter_model.safetensors``), from any layout: every rank gathers the adapter's tensors whole (they are
    small; each ``full_tensor`` is a collective, taken in the same order everywhere), rank 0 writes them
    through PEFT itself, under a temporary name renamed when complete. ``PeftModel.from_pretrained(base,
    directory)`` loads it."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    local = model.state_dict()
    # PEFT picks the adapter's entries (and renames them); the same tensors, so their names here are found
    picked = {id(v) for name in model.peft_config
              for v in get_peft_model_state_dict(model, state_dict=local, adapter_name=name,
                                                 save_embedding_layers=False).values()}
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in local.items() if id(v) in picked}
    error = None
    if rank == 0:
        try:
            model.save_pretrained(str(partial), state_dict=full, save_embedding_layers=False)
            os.replace(partial, out)
        except OSError as e:
            error = _cause(e)
    return _ended(error, out, partial, rank, on)
