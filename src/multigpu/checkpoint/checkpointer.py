"""``mg.Checkpointer``: every rank calls ``resume()`` and ``save(step)``; no rank conditions.

Model and optimizer go through ``get_state_dict``/``set_state_dict`` and
``torch.distributed.checkpoint`` (DCP), so replicated (DDP) and sharded
(FSDP2) state take one path and a checkpoint written by W ranks loads on
W' ranks. Scheduler, loss scaler and stateful extras are DCP entries too;
the loader position, the step and plain extras live in the JSON manifest.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn

from ..dist import at_teardown, print0
from ..errors import UsageError
from ..parallel import strategy_of
from ..parallel.zero import is_zero_optimizer
from ..runtime.values import is_positive_int
from . import loading, rng, storage
from .background import BackgroundWrite, NewLayout, copy_into
from .group import Group
from .state import TrainingObjects, is_stateful, without_optimizer_state


class Checkpointer:
    """Save and resume a training run; every rank calls every method.

    ``every``: ``save(step)`` writes only when ``step % every == 0``.
    ``keep``: keep the newest ``keep`` complete checkpoints (``None``: all).
    ``scaler`` may be a ``torch.amp.GradScaler`` or an ``mg.Precision``;
    ``optimizer`` may be a ``ZeroRedundancyOptimizer`` (strategy ``zero1``).
    ``async_save``: ``save`` blocks only while the state is copied to host
    memory; the files are written and hashed in the background, and the
    checkpoint is completed (manifest, marker) by the next ``save``,
    ``resume`` or ``finish()``, or when the ``mg.init`` block ends. At most
    one save is in flight; a background failure is raised there, on every rank.
    Extra keyword arguments are extras: an object with
    ``state_dict``/``load_state_dict`` is saved through DCP; anything else
    must be a plain JSON value, read back from ``ckpt.extra[name]``.
    The directory must be shared by all ranks (one filesystem).

    >>> ckpt = mg.Checkpointer("runs/x", every=100, keep=3, model=model, optimizer=opt,
    ...                        scheduler=sched, loader=train, best_acc=0.0)
    >>> step = ckpt.resume()                      # 0 when there is nothing to resume
    >>> for micro_batches in train:               # continues mid-epoch after a resume
    ...     ...                                   # forward, backward, opt.step()
    ...     ckpt.save(step)                       # writes after steps 0, 100, 200, ...
    ...     step += 1
    """

    def __init__(self, directory: str | Path, every: int = 1, keep: int | None = None, *,
                 model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, scaler: Any = None, loader: Any = None, async_save: bool = False,
                 **extra: Any) -> None:
        if not is_positive_int(every):
            raise UsageError(f"Checkpointer every= must be a positive integer number of steps, got {every!r}; use e.g. every=100")
        if keep is not None and not is_positive_int(keep):
            raise UsageError(f"Checkpointer keep= must be a positive integer or None (keep all), got {keep!r}; use e.g. keep=3")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise UsageError(f"checkpoint directory {self.directory} exists but is a file; pass a directory path")
        model = _whole(model)
        if model is not None and not isinstance(model, nn.Module):
            raise UsageError(f"Checkpointer model= expects a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise UsageError(f"Checkpointer optimizer= expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
            if model is None:
                raise UsageError("Checkpointer got optimizer= without model=; pass the model too (its parameter names key the optimizer state)")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
            if obj is not None and not is_stateful(obj):
                raise UsageError(f"Checkpointer {name}= needs state_dict()/load_state_dict(), got {type(obj).__name__}")
        self.every, self.keep = every, keep
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler, self.loader = scheduler, scaler, loader
        self.extra: dict[str, Any] = {}
        for name, value in extra.items():
            if not is_stateful(value):
                self._check_plain(name, value)
            self.extra[name] = value
        self.last_saved: Path | None = None
        self.async_save = bool(async_save)
        self._pending: BackgroundWrite | None = None
        self._group: Any = None  # the background writes' own gloo group (training keeps the default one)
        self._at_exit = False
        self._staged: dict[str, Any] | None = None  # the host copy of the last background save

    @staticmethod
    def _check_plain(name: str, value: Any) -> None:
        try:
            ok = json.loads(json.dumps(value, allow_nan=True)) == value
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UsageError(
                f"Checkpointer extra {name}= must be a plain value (number, string, bool, None, list, dict of those) "
                f"or have state_dict()/load_state_dict(), got {type(value).__name__}; convert it, e.g. {name}=float(x)"
            )

    # --- what is saved (the DCP part is built in state.py) ------------------------------

    def _objects(self) -> TrainingObjects:
        return TrainingObjects(self.model, self.optimizer, self.scheduler, self.scaler, self.loader, self.extra)

    def _manifest(self, step: int, group: Group) -> dict[str, Any]:
        objects = self._objects()
        msd = objects.module().state_dict() if self.model is not None else {}
        return {
            "format": storage.FORMAT,
            "step": step,
            "world_size": group.world,
            "strategy": strategy_of(self.model, self.optimizer),
            **storage.provenance(),
            "state_keys": sorted(objects.keys()),
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "extra": {k: v for k, v in self.extra.items() if not is_stateful(v)},
            "model_parameters": sum(p.numel() for p in objects.module().parameters()) if self.model is not None else 0,
            "model_tensors": len(msd),
            "rng": {"world_size": group.world, "cuda": torch.cuda.is_available() and torch.cuda.is_initialized()},
        }

    # --- resume ---------------------------------------------------------------------

    def resume(self, checkpoint: str | Path | int | None = None) -> int:
        """Load the newest valid checkpoint and return the next step (0 when there is none).

        Incomplete saves are skipped, damaged checkpoints (checksums, manifest)
        are skipped with a warning naming them; the newest valid one is used.
        ``checkpoint`` (``"step-120"``, ``120`` or a path) asks for one
        checkpoint: if it is damaged, a ``UsageError`` says why. Prints
        ``multigpu: resumed from runs/x/step-120 (step 120, written by 2 ranks, now 4)``.

        >>> step = ckpt.resume()
        """
        self.finish()
        return loading.resume(self.directory, checkpoint, self._objects(), Group(),
                              strategy_of(self.model, self.optimizer))

    # --- save -----------------------------------------------------------------------

    def save(self, step: int, force: bool = False) -> Path | None:
        """Write a checkpoint of the state after ``step`` if ``step % every == 0`` (or ``force``).

        Returns the checkpoint directory, or None when nothing was written.
        A failure on any rank (disk full, permissions) raises the same
        ``UsageError`` on every rank; the previous checkpoint stays intact.

        >>> ckpt.save(step)                # at the end of each step, on every rank
        >>> ckpt.save(step, force=True)    # e.g. before a planned stop
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UsageError(f"Checkpointer.save(step) expects a non-negative integer step, got {step!r}")
        if not force and step % self.every != 0:
            return None
        self.finish()  # at most one save in flight
        group = Group()
        t0 = time.perf_counter()
        final = storage.step_dir(self.directory, step)
        tmp = storage.tmp_dir(self.directory, step)
        ctx = (final, group)

        def prepare() -> None:
            if group.rank == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a save that was killed: never loaded, safe to replace
                    storage.remove_tree(tmp)
                tmp.mkdir()

        self._agree("creating the directory", prepare, ctx)
        try:
            # An optimizer that has not stepped yet gets state from get_state_dict
            # (a zero-lr step). That is not training state: save none, and undo
            # it, so saving never changes the run (Adam would count an extra step).
            fresh = self.optimizer is not None and not is_zero_optimizer(self.optimizer) and not self.optimizer.state
            state = self._objects().state_dict(rank=group.rank)
            if fresh:
                state["optim"] = without_optimizer_state(state["optim"])
                self.optimizer.state.clear()
            if self.async_save:
                return self._save_in_background(state, step, fresh, group, t0, ctx)
            with storage.single_process_ok():
                self._agree("writing tensors (DCP)", lambda: dcp.save(
                    state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True),
                    no_dist=not group.on), ctx)
            self._agree("writing RNG states", lambda: rng.save(tmp / rng.file_name(group.rank), rng.capture()), ctx)
            names = group.broadcast(storage.list_files(tmp) if group.rank == 0 else None)
            # Every rank hashes a share of the files: the check costs 1/W of the bytes per rank.
            hashes = self._agree("hashing files", lambda: storage.hash_files(tmp, names[group.rank::group.world]), ctx,
                                 gather=True)
            manifest = self._manifest(step, group)
            manifest["optimizer_fresh"] = fresh
            manifest["files"] = {k: v for part in hashes for k, v in part.items()}
            manifest["bytes"] = sum(v["bytes"] for v in manifest["files"].values())
            manifest["save_seconds"] = round(time.perf_counter() - t0, 3)
            self._agree("finishing (manifest, rename, marker)",
                        lambda: storage.finish(tmp, final, manifest) if group.rank == 0 else None, ctx)
        except BaseException:
            _discard(tmp, group)
            raise
        self.last_saved = final
        self._agree("removing old checkpoints", lambda: self._prune(final) if group.rank == 0 else None, ctx)
        print0(f"multigpu: saved {final} ({manifest['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.2f} s)")
        return final

    def _save_in_background(self, state: dict[str, Any], step: int, fresh: bool, group: Group, t0: float,
                            ctx: tuple[Path, Group]) -> Path:
        """Stage ``state`` in host memory (the only blocking part), then write and hash it on a thread."""
        final, tmp = ctx[0], storage.tmp_dir(self.directory, step)
        writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True)
        # A copy in host memory: training may change the parameters as soon as this returns.
        staged = self._agree("staging the state in host memory", lambda: self._stage(writer, state), ctx)
        self._agree("writing RNG states", lambda: rng.save(tmp / rng.file_name(group.rank), rng.capture()), ctx)
        manifest = self._manifest(step, group)  # the loader's position and extras now, not at completion
        manifest["optimizer_fresh"] = fresh
        if group.on and self._group is None:
            # DCP's planning collectives run on the writer thread: on the training group they could
            # interleave with the loop's own collectives (a hang or a wrong reduction).
            self._group = tdist.new_group(backend="gloo")
        pending = BackgroundWrite(final, tmp, manifest, t0, group.rank, no_dist=not group.on)
        pending.start(staged, writer, self._group)
        pending.blocked = time.perf_counter() - t0
        self._pending = pending
        at_teardown(self.finish)
        if not self._at_exit:
            atexit.register(self._finish_at_exit)
            self._at_exit = True
        print0(f"multigpu: saving {final} in the background (the loop blocked {pending.blocked:.2f} s)")
        return final

    def _stage(self, writer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """The host copy: into the last save's buffers when the state has the same layout (the previous
        write has finished: one save in flight), else a new one from DCP's writer. Fresh buffers cost
        page faults: 1.2 GB staged in 1.1 s new, 0.23 s reused (benchmarks/checkpoint.py)."""
        try:
            if self._pending is not None:  # its writer may still read the buffers
                raise NewLayout
            self._staged = copy_into(self._staged, state)
        except NewLayout:
            self._staged = writer.stage(state)
        return self._staged

    def finish(self) -> Path | None:
        """Complete the save in flight (collective): wait for its writes, then manifest, rename, marker.

        Returns the checkpoint, or None when none was in flight. A failure of the background
        write raises here, on every rank, and the previous checkpoint stays the newest valid one.

        >>> ckpt.finish()                   # e.g. before reading the checkpoint from another program
        """
        pending = self._pending
        if pending is None:
            return None
        group = Group()
        ctx = (pending.final, group)
        try:
            try:
                hashes = self._agree("writing tensors in the background (DCP)", pending.result, ctx, gather=True)
            finally:
                if not pending.thread.is_alive():  # an interrupted join keeps it: its buffers are still read
                    self._pending = None
            manifest = pending.manifest
            manifest["files"] = {k: v for part in hashes for k, v in part.items()}
            manifest["bytes"] = sum(v["bytes"] for v in manifest["files"].values())
            manifest["save_seconds"] = round(time.perf_counter() - pending.t0, 3)
            manifest["blocking_seconds"] = round(pending.blocked, 3)
            self._agree("finishing (manifest, rename, marker)",
                        lambda: storage.finish(pending.tmp, pending.final, manifest) if group.rank == 0 else None, ctx)
        except BaseException:
            _discard(pending.tmp, group)
            raise
        self.last_saved = pending.final
        self._agree("removing old checkpoints", lambda: self._prune(pending.final) if group.rank == 0 else None, ctx)
        print0(f"multigpu: saved {pending.final} ({manifest['bytes'] / 1e6:.1f} MB; the loop blocked "
               f"{pending.blocked:.2f} s of {manifest['save_seconds']:.2f} s)")
        return pending.final

    def _finish_at_exit(self) -> None:
        """The interpreter is exiting with a save in flight and no ``mg.init`` block ended: one process
        completes it; several do not (their peers may be inside a collective: a crash would become a
        hang), and say so."""
        if self._pending is None:
            return
        if self._pending.no_dist:
            try:
                self.finish()
            except Exception as err:  # noqa: BLE001 - at exit: one line, not a traceback
                print(f"multigpu: error: {' '.join(str(err).split())}", file=sys.stderr)
            return
        print(f"multigpu: warning: the background save of {self._pending.final} was not completed (no mg.init "
              "block ended); the previous checkpoint is the newest valid one; call ckpt.finish() before exit",
              file=sys.stderr)

    def _prune(self, newest: Path) -> None:
        """Delete older complete checkpoints beyond ``keep``, and leftovers of killed saves."""
        entries = storage.scan(self.directory)
        if self.keep is not None:
            complete = [e for e in entries if e.complete and e.path != newest]
            for e in complete[self.keep - 1:]:
                storage.remove_tree(e.path)
        for e in entries:  # leftovers of killed saves (.tmp-step-N, or step-N without its marker)
            if not e.complete and e.path != newest and e.path.exists():
                storage.remove_tree(e.path)

    def _agree(self, what: str, fn: Callable[[], Any], ctx: tuple[Path, Group], gather: bool = False) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, raise the same error everywhere.

        Returns ``fn``'s result, or the list of every rank's results with ``gather=True``.
        """
        final, group = ctx
        result, error = None, None
        try:
            result = fn()
        except CheckpointException as err:  # DCP's own (a BaseException) already gathered every rank's cause
            origin, (cause, _) = min(err.failures.items())
            error = (origin, f"{type(cause).__name__}: {cause}")
        except Exception as err:  # noqa: BLE001 - reported below, on every rank
            error = (group.rank, f"{type(err).__name__}: {err}")
        outcomes = group.gather((error, result if gather else None))
        bad = [e for e, _ in outcomes if e]
        if bad:
            rank, err = min(bad)
            err = " ".join(err.split())[:400]
            prev = self._previous(final)
            raise UsageError(
                f"could not save checkpoint {final}: {what} failed on rank {rank}: {err}; "
                f"the previous checkpoint {prev or '(none)'} is intact; free disk space or fix the permissions of "
                f"{self.directory} and restart (the run resumes from the previous checkpoint)"
            )
        return [r for _, r in outcomes] if gather else result

    def _previous(self, final: Path) -> Path | None:
        try:
            for e in storage.scan(self.directory):
                if e.complete and e.path != final:
                    return e.path
        except OSError:
            pass
        return None


def _discard(tmp: Path, group: Group) -> None:
    """Remove a save's unfinished directory after a failure (rank 0; the error that follows says why)."""
    if group.rank == 0 and tmp.exists():
        try:
            storage.remove_tree(tmp)
        except OSError:
            pass


def _whole(model: Any) -> Any:
    """What saves this rank's share of the whole model: a pipeline's stages' union (``pipe.model``) for the
    ``Pipeline`` or itself; one stage of a rank that holds several is refused (the others would be missing)."""
    from ..spreads import pipeline_of, refuse_stages

    if (pipe := pipeline_of(model)) is not None:
        return pipe.model
    refuse_stages(model, "Checkpointer(model=)", "pass model=pipe.model, every stage this rank holds")
    return model
