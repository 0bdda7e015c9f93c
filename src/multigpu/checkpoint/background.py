"""A checkpoint written in the background: the host copy of the state, and the thread that writes it.

``Checkpointer(async_save=True)`` stages the state into host buffers (reused
from the previous save when the layout matches), then hands it to a
``BackgroundWrite``: DCP's write of the copy and this rank's share of the
checksums, on a daemon thread. Completing it (manifest, rename, marker) is
collective and stays with the Checkpointer.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from . import rng, storage


class NewLayout(Exception):
    """The state does not fit the staged buffers (other keys, shapes, dtypes, or DTensors)."""


def copy_into(buffer: Any, value: Any) -> Any:
    """``value`` with its plain tensors copied into ``buffer``'s, which has the same structure."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor or not isinstance(buffer, torch.Tensor) or buffer.shape != value.shape \
                or buffer.dtype != value.dtype:
            raise NewLayout
        return buffer.copy_(value)
    if isinstance(value, dict):
        if not isinstance(buffer, dict) or buffer.keys() != value.keys():
            raise NewLayout
        return {k: copy_into(buffer[k], v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if type(buffer) is not type(value) or len(buffer) != len(value) or hasattr(value, "_fields"):
            raise NewLayout
        return type(value)(copy_into(b, v) for b, v in zip(buffer, value))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value  # immutable
    return copy.deepcopy(value)  # anything else a state_dict() holds may change before the write


class BackgroundWrite:
    """One save in flight: DCP's write of the staged copy, then this rank's share of the hashes, on a thread."""

    def __init__(self, final: Path, tmp: Path, manifest: dict[str, Any], t0: float, rank: int, no_dist: bool) -> None:
        self.final, self.tmp, self.manifest, self.t0, self.rank, self.no_dist = final, tmp, manifest, t0, rank, no_dist
        self.blocked = 0.0
        self.hashes: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, staged: dict[str, Any], writer: Any, group: Any) -> None:
        # A daemon: a killed or crashing run must not wait for it (the previous checkpoint stays valid).
        self.thread = threading.Thread(target=self._run, args=(staged, writer, group), daemon=True,
                                       name=f"multigpu-save-{self.final.name}")
        self.thread.start()

    def _run(self, staged: dict[str, Any], writer: Any, group: Any) -> None:
        try:
            # The warnings filter is process-wide: touched only where DCP warns (no process group).
            with storage.single_process_ok() if self.no_dist else contextlib.nullcontext():
                dcp.save(staged, storage_writer=writer, process_group=group, no_dist=self.no_dist)
            self.hashes = storage.hash_files(self.tmp, self._own_files())
        except BaseException as err:  # noqa: BLE001 - CheckpointException too; raised by result()
            self.error = err

    def _own_files(self) -> list[str]:
        """What this rank wrote: its DCP file(s), its RNG state, and (rank 0) DCP's metadata."""
        mine = f"__{self.rank}_"
        return [n for n in storage.list_files(self.tmp)
                if n.startswith(mine) or n == rng.file_name(self.rank) or (self.rank == 0 and n == ".metadata")]

    def result(self) -> dict[str, Any]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.hashes
