"""``mg.from_pretrained``: a Hugging Face checkpoint read onto any layout, each rank reading only its shards."""


from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .experts import Names
from .save import _contiguous, _expected, _untied_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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


def check_names(model: nn.Module, tensors: dict[str, tuple[tuple[int, ...], str]], where: Path) -> None:
    """Refuse in one line a checkpoint whose names or shapes are not the model's (as built from its config)."""
    expected = _expected(model)
    missing = [n for n, (_, tied) in expected.items() if n not in tensors and not tied]
    unexpected = [n for n in tensors if n not in expected]
    name = type(model).__name__
    if missing or unexpected:
        from ..checkpoint.hf_files import name_mismatch

        raise UsageError(f"{where} does not hold {name}'s tensors by the names transformers gives them: "
                         f"{name_mismatch(missing, unexpected)}; load it once with transformers' from_pretrained and "
                         "save_pretrained it again")
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
    from ..parallel import Layout, parallelize, pipeline
    from ..parallel.context_probe import check_loaded
    from ..parallel.spread import _world

    root = Path(path)
    tensors = checkpoint_tensors(root)
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
        raise UsageError(f"from_pretrained takes a mg.parallel.Layout, got {type(layout).__name__}")
    if layout.pp > 1 and not ("loss_fn" in options and "plan" in options):
        raise UsageError(f"from_pretrained onto layout {layout.label} builds a pipeline (mg.parallel.pipeline), which "
                         "takes the loss and the batch plan: pass loss_fn= and plan= as mg.parallel.pipeline takes them")
    layout = layout.resolve(_world()[1]).built()
    device = torch.device(device) if device is not None else _device()
    chosen = {k: v for k, v in (("attn_implementation", attn_implementation),
                                ("experts_implementation", experts_implementation)) if v is not None}

    def built() -> tuple[nn.Module, Names]:
        """The model on the meta device and how it reads the checkpoint (transformers' names), checked."""
        model = _empty(root, dtype, model_class, chosen)
        names = Names(model, tensors, root)
        check_names(model, names.tensors, root)
        return model, names

    def reference() -> nn.Module:
        """The same checkpoint loaded by FSDP over every rank (one unit gathered at a time): what a layout
        whose probe needs the whole model (a pipeline's cut, EP, TP) is checked against, no process holding it."""
        whole, names = built()
        world = _world()[1]
        try:
            whole = parallelize(whole, Layout(dp_shard=world).resolve(world), _empty=device, verbose=False)
        except UsageError as e:  # FSDP's own refusal (a module holding two dtypes), said as the check's
            raise UsageError(f"from_pretrained onto layout {layout.label} checks it against an FSDP load of {root}, "
                             f"which is refused: {e}") from None
        _fill(whole, root, device, names)
        return whole.eval()

    model, names = built()
    if layout.pp > 1:  # this rank's stages, spread on meta, then each one's tensors read
        loss_fn, plan = options.pop("loss_fn"), options.pop("plan")
        pipe = pipeline(model, layout, loss_fn, plan, _empty=device, **options)
        for stage in pipe.modules:
            _fill(stage, root, device, names)
            stage.eval()
        _check_cut(pipe, reference(), device, type(model).__name__)
        return pipe
    if layout.tp == 1 and layout.dp_shard == 1 and layout.cp == 1:  # nothing sharded: every rank holds it whole
        _fill(model, root, device, names)
        model = parallelize(model, layout, **options)
    else:
        name = type(model).__name__  # FSDP renames its class
        model = parallelize(model, layout, _empty=device, **options)
        _fill(model, root, device, names)
        if layout.tp > 1 or layout.ep > 1:  # the probes mg.parallelize runs on a whole model, against an FSDP load
            _check_spread(model, layout, reference, name, options.get("verbose", True))
        if layout.cp > 1:  # the probe mg.parallelize runs on a whole model, run on the loaded one
            check_loaded(model)
    return model.eval()  # as transformers' from_pretrained returns it: model.train() before training


def _check_spread(model: nn.Module, layout: Any, reference: Any, name: str, verbose: bool) -> None:
    """mg.parallelize checks TP and EP on a probe batch of the whole model before and after the split; loaded,
    no process holds it, so the split model's output and every parameter's gradient (cp, if any, suspended:
    ``check_loaded`` checks it next) are compared with ``reference()``'s, an FSDP load of the same checkpoint:
    exact or refused, alike on every rank (``probe.same_training``). That checks a TP plan found in the blocks
    as mg.parallelize checks one on the whole model. A model that takes no probe batch, or whose forward fails
    on one, is not checked, as mg.parallelize takes it, and the line says so."""
    import contextlib

    from ..dist import print0
    from ..parallel import context, probe
    from ..spreads import spread_of

    ctx = spread_of(model).context if layout.cp > 1 else None
    split = [k for k in ("tp", "ep") if getattr(layout, k) > 1]
    what = ", ".join(f"{k}={getattr(layout, k)}" for k in split)
    whole = reference()
    batch = probe.probe_input(whole, layout.tp)
    expected, why = probe.attempt(whole, batch)
    device = next(model.parameters()).device
    if expected is not None:
        with context.suspended(model, ctx) if ctx is not None else contextlib.nullcontext():
            probe.same_training(model, whole, batch, f"from_pretrained onto layout {layout.label} ({what})",
                                f"use {' and '.join(f'{k}=1' for k in split)} for this model (FSDP and HSDP spread "
                                "any model)", device, name)
    del whole  # its shards: the check's only, dropped before training
    found = (spread_of(model).tp_plan or "").startswith("found")
    if expected is None and found:  # as mg.parallelize refuses a found plan it cannot check
        raise UsageError(f"tensor parallelism found a plan in {name}'s blocks but cannot check it on a probe batch "
                         f"against an FSDP load: {why}; pass tp_plan={{'<module name>': 'colwise' | 'rowwise', ...}} "
                         "(a plan you give is taken unchecked) or use tp=1")
    if verbose:
        print0(f"mg.from_pretrained: {what} checked against an FSDP load on a probe batch (output and gradients)"
               if expected is not None else f"mg.from_pretrained: {what} not checked on a probe batch ({why})")


def _check_cut(pipe: Any, reference: nn.Module, device: torch.device, name: str) -> None:
    """mg.parallel.pipeline checks its cut on a probe batch of the whole model, composing the stages in one
    process (the stages composed must give its output); loaded, no process holds it, so the stages run where they
    are, one after the other on a probe batch, each stage's output broadcast over the pipeline group to the
    next, and the last one's logits are compared with those of the same checkpoint loaded by FSDP over every
    rank (one unit gathered at a time): exact or refused, alike on every rank. Not in the pipeline's schedule:
    a stage that fails (a block handing the next more than the hidden states) would raise on its own ranks and
    leave the others waiting for its output; here its failure is broadcast with it. The reference is dropped
    after."""
    import torch.distributed as tdist

    from ..parallel.probe import TOLERANCE, cause, probe_input, relative_error, run

    batch = probe_input(reference, 1)["input_ids"]
    with torch.no_grad():
        expected = run(reference, {"input_ids": batch}, backward=False)
    holders: list = [None] * tdist.get_world_size(pipe.group)
    tdist.all_gather_object(holders, pipe.ids, group=pipe.group)
    x, error, failed = batch.to(device), 0.0, None
    for i in range(pipe.n_stages):
        holder = next(r for r, ids in enumerate(holders) if i in ids)
        failed, x = _stage_output(pipe, i, x, holder, name, cause)
        if failed is not None:  # the same line on every rank of this pipeline group; the other groups' below
            break
    if failed is None and pipe.has_last:
        error = relative_error(x, expected)
    tol = TOLERANCE.get(next(reference.parameters()).dtype, 1e-4)
    verdict = torch.tensor([float(failed is not None), error], dtype=torch.float64, device=device)
    tdist.all_reduce(verdict, op=tdist.ReduceOp.MAX)  # every pipeline group's, on every rank
    if failed is not None or verdict[0].item():
        raise UsageError(failed or f"{name} cut into {pipe.n_stages} pipeline stages fails on a probe batch in "
                                   "another pipeline group; use pp=1 for this model")
    if not verdict[1].item() <= tol:
        raise UsageError(f"{name} cut into {pipe.n_stages} pipeline stages gives another output than the model on a "
                         f"probe batch (relative error {verdict[1].item():.1e}, {tol:.0e} allowed): its forward does "
                         "more than the stages run; use pp=1 for this model")


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _stage_output(pipe: Any, i: int, x: torch.Tensor, holder: int, name: str, cause: Any) -> tuple[str | None, Any]:
    """Stage ``i`` run on ``x`` by the pipeline rank ``holder`` (its data-parallel and tensor-parallel peers
    running it alongside), its output (or the line its failure is refused by) broadcast over the pipeline
    group: (the line or None, the output)."""
    import torch.distributed as tdist

    me = tdist.get_rank(pipe.group)
    said: list = [None, None]
    if me == holder:
        stage = pipe.modules[pipe.ids.index(i)]
        try:
            with torch.no_grad():
                x = _plain(stage(x))
            said = [None, (tuple(x.shape), x.dtype)]
        except UsageError as e:
            said = [str(e), None]
        except Exception as e:  # noqa: BLE001 - the failure is the refusal's reason
            said = [f"{name} cut into {pipe.n_stages} pipeline stages fails on a probe batch ({cause(e)}); use pp=1 "
                    "for this model (DDP, FSDP and TP apply)", None]
    src = tdist.get_global_rank(pipe.group, holder)
    tdist.broadcast_object_list(said, src=src, group=pipe.group)
    if said[0] is not None:
        return said[0], None
    if me != holder:
        x = torch.empty(said[1][0], dtype=said[1][1], device=x.device)
    tdist.broadcast(x, src=src, group=pipe.group)
    return None, x


def _device() -> torch.device:
    """This rank's device by ``mg.init``'s own rule (a GPU by local rank under nccl, else the CPU)."""
    import torch.distributed as tdist

    from ..dist import _device as rank_device, read_env

    on = tdist.is_available() and tdist.is_initialized()
    backend = tdist.get_backend() if on else ("nccl" if torch.cuda.is_available() else "gloo")
    return rank_device(None, backend, read_env()[1])


def _empty(root: Path, dtype: Any, model_class: Any, chosen: dict[str, str] | None = None) -> nn.Module:
    """The model of ``root``'s config with its parameters on the meta device and its buffers as its
    ``__init__`` computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..runtime.values import DTYPES

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
