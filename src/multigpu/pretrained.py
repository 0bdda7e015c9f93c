"""Hugging Face checkpoints in and out, on any layout, without any process holding the whole model.

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
(``expert_weights.py``): a mixture of experts' per-expert tensors are read by rank, each rank stacking only
the experts it holds into transformers 5's fused tensors, and written back per expert; a checkpoint whose
names are not the model's even so is refused in one line naming the keys that differ.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import UsageError
from .expert_weights import Names, per_expert_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default max_shard_size


def checkpoint_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the safetensors checkpoint in ``path``: name -> (shape, file), read from the files'
    headers (no tensor is read). One line for what is missing or not safetensors."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"from_pretrained takes a directory saved by save_pretrained, got {root} (not a directory)")
    if not (root / "config.json").is_file():
        raise UsageError(f"{root} has no config.json; a Hugging Face checkpoint directory holds the model's config "
                         "beside its weights (model.config.save_pretrained(dir))")
    if (root / INDEX).is_file():
        files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise UsageError(f"{root / INDEX} names {missing[0]}, which is not in {root}; copy the whole checkpoint "
                             "directory (every shard its index names)")
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        got = f"only {', '.join(pickled[:2])} (pickle, never unpickled here)" if pickled else "no weights"
        raise UsageError(f"{root} has {got}; expected {SINGLE} or {INDEX} with its shards: convert it once with "
                         "AutoModel.from_pretrained(dir).save_pretrained(new_dir) (safetensors by default)")
    tensors = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = (tuple(f.get_slice(key).get_shape()), name)
    return tensors


def _expected(model: nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The model's state names -> (shape, whether a tied copy of an earlier one, which a checkpoint leaves out)."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        out[name] = (tuple(tensor.shape), key in seen)
        seen.setdefault(key, name)
    return out


def check_names(model: nn.Module, tensors: dict[str, tuple[tuple[int, ...], str]], where: Path) -> None:
    """Refuse in one line a checkpoint whose names or shapes are not the model's (as built from its config)."""
    expected = _expected(model)
    missing = [n for n, (_, tied) in expected.items() if n not in tensors and not tied]
    unexpected = [n for n in tensors if n not in expected]
    name = type(model).__name__
    if missing or unexpected:
        said = "; ".join(x for x in (f"{len(missing)} of its tensors missing ({', '.join(missing[:3])})" if missing
                                      else "", f"{len(unexpected)} not its own ({', '.join(unexpected[:3])})"
                                      if unexpected else "") if x)
        raise UsageError(f"{where} does not hold {name}'s tensors by the names transformers gives them: {said}; "
                         "load it once with transformers' from_pretrained and save_pretrained it again")
    for n, (shape, _) in expected.items():  # in the model's order: the first that differs
        if n in tensors and tensors[n][0] != shape:
            raise UsageError(f"{where}: {n} has shape {list(tensors[n][0])} but {name} built from its config.json "
                             f"has {list(shape)}; the weights and the config are of different models")


def from_pretrained(path: str | Path, layout: Any = None, *, dtype: torch.dtype | str | None = None,
                    model_class: Any = None, device: torch.device | str | None = None,
                    attn_implementation: str | None = None, experts_implementation: str | None = None,
                    **options: Any) -> nn.Module:
    """The model saved in ``path`` (transformers' ``save_pretrained``: ``config.json`` and safetensors),
    spread by ``layout`` (a ``mg.parallel.Layout``; None: one process), each rank reading only its shards,
    in eval mode as transformers returns it (``model.train()`` before training).

    ``dtype`` (default: the config's), ``model_class`` (default ``AutoModelForCausalLM``), ``device``
    (default: this rank's, as ``mg.init`` picks it); ``attn_implementation`` and ``experts_implementation``
    as transformers' ``from_pretrained`` takes them (default: its choice); ``options`` go to
    ``mg.parallelize``. Under pp > 1 it returns this rank's ``mg.parallel.pipeline`` of the model, each stage
    reading its own tensors; ``options`` then are the pipeline's and must hold its ``loss_fn`` and ``plan``.

    >>> model = mg.from_pretrained("checkpoints/llama", mg.parallel.Layout(dp_shard=dist.world_size))
    """
    from .parallel import Layout, parallelize, pipeline
    from .parallel.hf.tied import tied_groups
    from .parallel.spread import _world, check_loaded_context

    root = Path(path)
    tensors = checkpoint_tensors(root)
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
        raise UsageError(f"from_pretrained takes a mg.parallel.Layout, got {type(layout).__name__}")
    if layout.pp > 1 and not ("loss_fn" in options and "plan" in options):
        raise UsageError(f"from_pretrained onto layout {layout.label} builds a pipeline (mg.parallel.pipeline), which "
                         "takes the loss and the batch plan: pass loss_fn= and plan= as mg.parallel.pipeline takes them")
    layout = layout.resolve(_world()[1])
    device = torch.device(device) if device is not None else _device()
    chosen = {k: v for k, v in (("attn_implementation", attn_implementation),
                                ("experts_implementation", experts_implementation)) if v is not None}

    def built() -> tuple[nn.Module, Names]:
        """The model on the meta device and how it reads the checkpoint (transformers' names), checked."""
        model = _empty(root, dtype, model_class, chosen)
        names = Names(model, tensors, root)
        check_names(model, names.tensors, root)
        return model, names

    model, names = built()
    if layout.pp > 1:  # this rank's stages, spread on meta, then each one's tensors read
        loss_fn, plan = options.pop("loss_fn"), options.pop("plan")
        pipe = pipeline(model, layout, loss_fn, plan, _empty=device, **options)
        for stage in pipe.modules:
            _fill(stage, root, device, names)
            stage.eval()
        reference, names = built()
        reference = parallelize(reference, Layout(dp_shard=_world()[1]).resolve(_world()[1]), _empty=device,
                                verbose=False)
        _fill(reference, root, device, names)
        _check_cut(pipe, reference.eval(), loss_fn, device, tied_groups(model), type(model).__name__)
        return pipe
    if layout.tp == 1 and layout.dp_shard == 1 and layout.cp == 1:  # nothing sharded: every rank holds it whole
        _fill(model, root, device, names)
        model = parallelize(model, layout, **options)
    else:
        model = parallelize(model, layout, _empty=device, **options)
        _fill(model, root, device, names)
        if layout.cp > 1:  # the probe mg.parallelize runs on a whole model, run on the loaded one
            check_loaded_context(model)
    return model.eval()  # as transformers' from_pretrained returns it: model.train() before training


def _check_cut(pipe: Any, reference: nn.Module, loss_fn: Any, device: torch.device, tied: list, name: str) -> None:
    """mg.parallel.pipeline checks its cut on a probe batch of the whole model (the stages composed must give
    its output); loaded, no process holds it, so the reference is the same checkpoint loaded by FSDP over every
    rank (one unit gathered at a time), its loss on the probe batch against the stages': exact or refused,
    alike on every rank. The stages run in a schedule of their own (torch's schedules keep the shapes of their
    first batch: the probe's must not be the training's); it and the reference are dropped after."""
    import torch.distributed as tdist

    from .parallel.pp import ZERO_BUBBLE, Pipeline
    from .parallel.probe import TOLERANCE, probe_input, run

    batch = probe_input(reference, 1)["input_ids"]
    probed = Pipeline(pipe.modules, pipe.ids, pipe.n_stages, pipe.group, device, pipe.schedule_name,
                      pipe.accum_steps, loss_fn, tied=tied)
    with torch.no_grad():
        expected = loss_fn(run(reference, {"input_ids": batch}, backward=False), batch)
    if pipe.schedule_name in ZERO_BUBBLE:  # torch's eval() of these fails: a step, its gradients dropped
        got = probed.step([(batch, batch)] * pipe.accum_steps)
        for stage in pipe.modules:
            stage.zero_grad(set_to_none=True)
    else:
        got = probed.evaluate([(batch, batch)] * pipe.accum_steps)
    error = torch.zeros((), dtype=torch.float64, device=expected.device)
    if got is not None:  # the last stage's ranks
        error += (got.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-30)
    tdist.all_reduce(error, op=tdist.ReduceOp.MAX)
    tol = TOLERANCE.get(expected.dtype, 1e-4)
    if not float(error) <= tol:
        raise UsageError(f"{name} cut into {pipe.n_stages} pipeline stages gives another loss than "
                         f"the model on a probe batch (relative error {float(error):.1e}, {expected.dtype} allows "
                         f"{tol:.0e}): its forward does more than the stages run; use pp=1 for this model")


def _device() -> torch.device:
    """This rank's device by ``mg.init``'s own rule (a GPU by local rank under nccl, else the CPU)."""
    import torch.distributed as tdist

    from .dist import _device as rank_device, read_env

    on = tdist.is_available() and tdist.is_initialized()
    backend = tdist.get_backend() if on else ("nccl" if torch.cuda.is_available() else "gloo")
    return rank_device(None, backend, read_env()[1])


def _empty(root: Path, dtype: Any, model_class: Any, chosen: dict[str, str] | None = None) -> nn.Module:
    """The model of ``root``'s config with its parameters on the meta device and its buffers as its
    ``__init__`` computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .runtime.values import DTYPES

    try:
        config = AutoConfig.from_pretrained(str(root))
    except (ValueError, KeyError, OSError) as err:  # a config.json transformers cannot read
        raise UsageError(f"{root / 'config.json'}: transformers cannot read it ({' '.join(str(err).split())[:160]}); "
                         "give the directory save_pretrained wrote") from None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UsageError(f"from_pretrained dtype={dtype!r}; expected a torch.dtype or one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype, **(chosen or {}))
    if hasattr(model, "tie_weights"):  # the tie is made by assignment, which the meta context turned into a copy
        model.tie_weights()
    return model


def _fill(model: nn.Module, root: Path, device: torch.device, names: Names) -> None:
    """Allocate this rank's share of every parameter on ``device`` and read it from the safetensors files
    (under the checkpoint's names; fused experts from their per-expert keys); the buffers keep the values
    ``__init__`` gave them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    buffers = {name: b.to(device) for name, b in model.named_buffers() if not b.is_meta}
    # Swapped in place, each parameter stays the one object its modules share (a tied head and embedding:
    # otherwise one copy each, and the one the checkpoint leaves out stays uninitialised memory).
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    from torch.distributed.tensor import empty as empty_dtensor

    state = {names.read_as[k]: v for k, v in _untied_state(model).items() if k not in names.stacked}
    strided = {k: v for k, v in state.items() if _contiguous(v) is not None}
    for k, v in strided.items():  # read into contiguous shards, then laid out as the parameter is
        state[k] = empty_dtensor(v.shape, dtype=v.dtype, device_mesh=v.device_mesh, placements=_contiguous(v))
    on = torch.distributed.is_available() and torch.distributed.is_initialized()
    # tied copies are the same tensor as the one the checkpoint names: filled with it
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(root)),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=not on)
    with torch.no_grad():
        for k, v in strided.items():
            v.to_local().copy_(state[k].redistribute(v.device_mesh, v.placements).to_local())
    names.fill_stacked(model, root)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise UsageError(f"from_pretrained left {leftover[0]} on the meta device; report this model")


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
    ``generation_config.json``; every rank calls it. Each rank writes its shards; they are consolidated
    tensor by tensor (no process gathers the model), under a temporary name renamed when complete.

    >>> mg.save_pretrained(model, "out/llama-tuned")   # AutoModelForCausalLM.from_pretrained("out/llama-tuned")
    """
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from .parallel import unwrap
    from .spreads import pipeline_of, refuse_stages

    if pipeline_of(model) is not None:
        raise UsageError("save_pretrained of a pipeline is not built yet: its stages are on other ranks; save a "
                         "checkpoint with mg.Checkpointer and load it onto a layout without pp to export")
    refuse_stages(model, "save_pretrained", "save a checkpoint with mg.Checkpointer")
    inner = unwrap(model)
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
    from .parallel.hf.lora import check_wrapped_whole, is_peft

    check_wrapped_whole(inner, "save_pretrained")
    if is_peft(inner):  # a PEFT model: its adapter only, in PEFT's own format
        return _save_adapter(inner, out, partial, rank, on)
    state = {k: v if _contiguous(v) is None else v.redistribute(v.device_mesh, _contiguous(v))
             for k, v in _untied_state(inner).items()}
    state, sizes = per_expert_state(inner, state)  # the names transformers writes
    files = _shards(sizes, max_shard_bytes)
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
            os.replace(partial, out)
        except OSError as e:
            error = _cause(e)
    return _ended(error, out, partial, rank, on)


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


def _shards(sizes: dict[str, int], limit: int) -> dict[str, int]:
    """Each tensor's output file (1-based), in order, from its bytes, a new file when the next tensor would pass
    ``limit`` bytes (a tensor larger than ``limit`` alone in its file), as transformers splits."""
    files, index, size = {}, 1, 0
    for name, nbytes in sizes.items():
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        files[name] = index
        size += nbytes
    return files


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
