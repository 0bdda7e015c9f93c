"""Resume: pick the newest valid checkpoint (checked by all ranks together) and load it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_state_dict

from ..dist import print0
from ..errors import UsageError
from ..parallel.zero import is_zero_optimizer
from . import rng, storage
from .group import Group
from .state import OPTIONS, TrainingObjects, is_stateful, without_optimizer_state
from .storage import Damaged
from .zero_state import load_state as load_zero_state


def _warn(group: Group, msg: str) -> None:
    if group.rank == 0:
        print(f"multigpu: warning: {msg}", file=sys.stderr, flush=True)


def _listing(group: Group, directory: Path) -> list[tuple[str, int, bool]]:
    """Rank 0 scans; every rank gets the same list (a shared filesystem may lag)."""
    entries = None
    if group.rank == 0:
        entries = [(str(e.path), e.step, e.complete) for e in storage.scan(directory)] if directory.is_dir() else []
    return group.broadcast(entries)


def check(path: Path, group: Group) -> tuple[dict[str, Any] | None, list[str]]:
    """Manifest and problems of one checkpoint; the hashing is split over the ranks."""
    outcome = None
    if group.rank == 0:
        try:
            manifest = storage.read_manifest(path)
            problems = storage.check_sizes(path, manifest)
            outcome = (manifest, problems)
        except Damaged as err:
            outcome = (None, [str(err)])
    manifest, problems = group.broadcast(outcome)
    if problems:
        return manifest, problems
    names = sorted(manifest["files"])
    parts = group.gather(storage.check_hashes(path, manifest, names[group.rank::group.world]))
    problems = [p for part in parts for p in part]
    if not problems and group.rank == 0:
        try:
            storage.read_metadata(path)
        except Damaged as err:
            problems = [f"{path / '.metadata'}: {err}"]
    return manifest, group.broadcast(problems)


def _short(items: list[str], n: int = 6) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _check_model_fits(path: Path, model_state: dict[str, Any], metadata, group: Group) -> None:
    """Name the mismatching keys and shapes before DCP reports a bare 'Missing key' (collective).

    Every rank's names are gathered: pipeline stages each hold a part of the model, so a
    checkpoint entry fits if some rank holds it, and every rank raises the same error.
    """
    saved = {k[len("model."):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    shapes_of = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in model_state.items()}
    held: dict[str, tuple | None] = {}
    for ranks_keys in group.gather(shapes_of):
        held.update(ranks_keys)
    missing = sorted(set(held) - set(saved))
    unexpected = sorted(set(saved) - set(held))
    shapes = []
    for k in sorted(set(held) & set(saved)):
        shape, md = held[k], saved[k]
        if shape is not None and isinstance(md, TensorStorageMetadata) and shape != tuple(md.size):
            shapes.append(f"{k} checkpoint {tuple(md.size)} vs model {shape}")
    parts = []
    if missing:
        parts.append(f"not in checkpoint: {_short(missing)}")
    if unexpected:
        parts.append(f"not in model: {_short(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch: {_short(shapes, 4)}")
    if parts:
        raise UsageError(
            f"checkpoint {path} does not fit this model ({'; '.join(parts)}); "
            "build the model with the architecture the checkpoint was saved with, or use another --dir"
        )


def load(objects: TrainingObjects, path: Path, manifest: dict[str, Any], group: Group) -> None:
    """Load ``path`` into the training objects (collective)."""
    if manifest.get("imported"):  # `multigpu ckpt import`: weights only, everything else as the run built it
        objects = TrainingObjects(objects.model, None, None, None, None, {})
        if objects.model is None:
            raise UsageError(f"checkpoint {path} was imported from {manifest['imported'].get('from')} and holds "
                             "model weights only; pass model= to the Checkpointer")
    saved_keys = set(manifest["state_keys"])
    want = set(objects.keys())
    for key in sorted(want - saved_keys):
        raise UsageError(
            f"checkpoint {path} holds no {key!r} state but this Checkpointer was given one; "
            f"resume with the same objects it was saved with (it has: {', '.join(sorted(saved_keys)) or 'nothing'})"
        )
    zero = is_zero_optimizer(objects.optimizer)
    state = objects.state_dict(for_load=True)
    fresh = bool(manifest.get("optimizer_fresh")) and "optim" in state
    unsaved = {}
    if fresh:  # saved before the first optimizer step: there is no optimizer state to load
        unsaved = {k: v for k, v in state["optim"].items() if k.startswith("state.")}
        state["optim"] = without_optimizer_state(state["optim"])
    if "model" in state:
        _check_model_fits(path, state["model"], storage.read_metadata(path), group)
    for key in sorted(saved_keys - want):
        _warn(group, f"{path} also holds {key!r} state, which this Checkpointer was not given; it is not restored")
    try:
        with storage.single_process_ok():
            dcp.load(state, storage_reader=storage.SafeReader(path), planner=storage.SafeLoadPlanner(),
                     no_dist=not group.on)
    except CheckpointException as err:  # DCP gathers every rank's failure; the first one says it
        _, (cause, _) = min(err.failures.items())
        text = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        if isinstance(cause, pickle.UnpicklingError):  # weights_only refused a value: damage, not a bug
            raise Damaged(f"a value in its tensor files is not plain data ({text})") from None
        if "Missing key" in text or "ize mismatch" in text:
            raise UsageError(f"checkpoint {path} does not match this run's state ({text}); resume with the same "
                             "model, optimizer, scheduler and extras types it was saved with") from None
        raise
    if objects.model is not None:
        objects.respread(state)  # the placements state_dict() replicated for DCP, back as the parameters have them
        opts = [objects.optimizer] if objects.optimizer is not None and not zero else []
        if fresh:  # the flattened form wants an entry per parameter: the template's own (cleared below)
            state["optim"] |= unsaved
        set_state_dict(objects.module(), opts, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=OPTIONS)
        if fresh:
            objects.optimizer.state.clear()
        if zero:
            load_zero_state(path, objects.module(), objects.optimizer, no_dist=not group.on)
    if objects.scheduler is not None:
        objects.scheduler.load_state_dict(state["scheduler"])
    if objects.scaler is not None:
        objects.scaler.load_state_dict(state["scaler"])
    for name, obj in objects.extra.items():
        if is_stateful(obj):
            obj.load_state_dict(state["extra"][name])
        elif name in manifest.get("extra", {}):
            objects.extra[name] = manifest["extra"][name]
    if manifest.get("imported"):  # the run's own random states, as a fresh run has them
        return
    if objects.loader is not None:
        if manifest.get("loader") is None:
            _warn(group, f"{path} holds no loader position; the loader starts at epoch 0, batch 0")
        else:
            objects.loader.load_state_dict(manifest["loader"])
    _restore_rng(path, manifest, group)


def _restore_rng(path: Path, manifest: dict[str, Any], group: Group) -> None:
    saved_world = int(manifest["world_size"])
    states, problem = None, None
    if group.rank < saved_world:
        name = rng.file_name(group.rank)
        try:
            states = rng.load(path / name)
        except Exception as err:  # noqa: BLE001 - weights_only's refusal or a decoding error: damage
            problem = f"{name} cannot be read safely ({' '.join(f'{type(err).__name__}: {err}'.split())[:200]})"
    problems = [p for p in group.gather(problem) if p]  # every rank skips this checkpoint, or none
    if problems:
        raise Damaged(problems[0])
    if states is not None:
        rng.restore(states)
    else:
        rng.reseed(int(manifest["step"]), group.rank)
    if saved_world != group.world:
        if group.world > saved_world:
            policy = (f"{_span(0, saved_world - 1)}: saved RNG states restored, "
                      f"{_span(saved_world, group.world - 1)}: reseeded from (step, rank)")
        else:
            policy = (f"{_span(0, group.world - 1)}: saved RNG states restored, "
                      f"saved states of {_span(group.world, saved_world - 1)}: dropped")
        print0(f"multigpu: world size changed {saved_world} -> {group.world}: {policy}; random draws (dropout, "
               "augmentation) differ from an uninterrupted run, the data order and model state do not")


def resume(directory: Path, checkpoint: str | Path | int | None, objects: TrainingObjects, group: Group,
           strategy: str) -> int:
    """See ``Checkpointer.resume``; ``strategy`` is this run's (``strategy_of``), named when it changed."""
    explicit = checkpoint is not None
    if explicit:
        candidates = [storage.resolve(directory, checkpoint)]
    else:
        listing = _listing(group, directory)
        for p, _, complete in listing:
            if not complete:
                _warn(group, f"skipping {p}: incomplete (its save was interrupted before the COMPLETE marker); "
                             "it is never loaded and is removed by the next save")
        candidates = [Path(p) for p, _, complete in listing if complete]
    damaged = []
    for path in candidates:
        manifest, problems = check(path, group)
        if not problems:
            try:
                load(objects, path, manifest, group)
            except Damaged as err:  # checksums match, yet a file holds what a safe load refuses
                problems = [str(err)]
        if problems:
            reason = problems[0] + (f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else "")
            if explicit:
                raise UsageError(f"checkpoint {path} cannot be loaded: {reason}; list the valid ones with "
                                 f"`multigpu ckpt ls {directory}` or call resume() to use the newest valid one")
            _warn(group, f"skipping damaged checkpoint {path}: {reason}")
            damaged.append(path)
            continue
        if manifest.get("imported"):  # no step was trained: the loop starts at 0, as a fresh run's
            print0(f"multigpu: resumed from an imported checkpoint {path} ({manifest['imported'].get('from')}'s "
                   f"weights, loaded onto {_ranks(group.world)}, {strategy}): the optimizer starts fresh, the data at "
                   "its start; continuing at step 0")
            return 0
        step = int(manifest["step"])
        changed = f", {manifest['strategy']} -> {strategy}" if manifest["strategy"] != strategy else ""
        print0(f"multigpu: resumed from {path} (step {step}, written by {_ranks(manifest['world_size'])}, "
               f"now {group.world}{changed}); continuing at step {step + 1}")
        return step + 1
    if damaged:
        raise UsageError(
            f"no valid checkpoint in {directory}: all {len(damaged)} complete ones are damaged "
            f"({', '.join(p.name for p in damaged)}); see `multigpu ckpt verify {directory}`, "
            "and move them away to start again from step 0"
        )
    print0(f"multigpu: no checkpoint in {directory}; starting at step 0")
    return 0


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _span(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
