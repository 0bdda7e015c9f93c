"""On-disk layout of a checkpoint directory, and how it is checked.

No process group here: the CLI (``multigpu ckpt ls/verify/export``) uses
this module alone. A run directory holds::

    runs/x/
      step-120/            complete: COMPLETE marker present
        .metadata          DCP's index (read with an allow-list unpickler)
        __0_0.distcp ...   DCP's tensor files (read with torch.load(weights_only=True))
        rng/rank-0.pt ...  per-rank RNG states (plain tensors, weights_only=True)
        manifest.json      step, world size, versions, sizes, a checksum of every file (xxh3-128)
        COMPLETE           written last: the sha256 of manifest.json
      .tmp-step-130/       a save that never finished: never loaded

A checkpoint is written under ``.tmp-step-N``, fsynced, renamed to
``step-N``, and only then gets its ``COMPLETE`` marker; the marker holds the
manifest's hash and the manifest holds every file's hash, so a truncated
file, changed bytes or an edited manifest are all detected.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import UsageError
from ..runtime import compat

FORMAT = "multigpu-checkpoint/1"
MANIFEST = "manifest.json"
MARKER = "COMPLETE"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-(?:old-)?step-(\d+)$")  # a save in progress, or a replaced step being deleted
_HASH_CHUNK = 8 << 20


class Damaged(Exception):
    """A checkpoint that must not be loaded; ``str()`` says why, in a few words."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory found by ``scan``."""

    path: Path
    step: int
    complete: bool  # has its COMPLETE marker (not yet checked further)

    @property
    def name(self) -> str:
        return self.path.name


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step}"


def tmp_dir(directory: Path, step: int) -> Path:
    return directory / f"{TMP_PREFIX}step-{step}"


def scan(directory: Path) -> list[Entry]:
    """Checkpoints under ``directory``, newest step first (complete before incomplete at equal step)."""
    found = []
    for child in directory.iterdir():
        if not child.is_dir():
            continue
        if m := _STEP_DIR.match(child.name):
            found.append(Entry(child, int(m.group(1)), (child / MARKER).is_file()))
        elif m := _TMP_DIR.match(child.name):
            found.append(Entry(child, int(m.group(1)), False))
    return sorted(found, key=lambda e: (-e.step, not e.complete, e.name))


def resolve(directory: Path, name: str | os.PathLike) -> Path:
    """``"step-120"``, ``120`` or a path -> the checkpoint directory."""
    if isinstance(name, int):
        return step_dir(directory, name)
    p = Path(name)
    if not p.is_absolute() and not p.exists():
        return directory / p  # a name inside the run directory (also when it is missing: the error names it)
    return p


# --- writing -----------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# A file's checksum detects damage (a flipped bit, a torn write), not an attacker (the
# manifest itself is covered by the marker's sha256): xxh3-128 reads ~10 GB/s where
# sha256 read 0.5 GB/s here, 2-3.5 s of a 1.2 GB save. Manifests name their algorithm,
# so checkpoints written with sha256 by earlier versions still verify.
ALGORITHMS = ("xxh3_128", "sha256")


def _hasher(algorithm: str):
    if algorithm == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def file_digest(path: Path, algorithm: str = "xxh3_128") -> tuple[int, str]:
    """(size in bytes, hex digest) of a file, read in chunks."""
    h = _hasher(algorithm)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def sha256_file(path: Path) -> tuple[int, str]:
    return file_digest(path, "sha256")


def list_files(root: Path) -> list[str]:
    """Every file under ``root`` as a sorted relative POSIX path (the manifest's keys)."""
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            out.append(Path(dirpath, f).relative_to(root).as_posix())
    return sorted(out)


def hash_files(root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        size, digest = file_digest(root / name)
        out[name] = {"bytes": size, "xxh3_128": digest}
    return out


def finish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, rename ``tmp`` to ``final`` and write the marker last, fsyncing each step."""
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    write_durable(tmp / MANIFEST, data)
    for sub in {tmp / Path(n).parent for n in manifest["files"]} | {tmp}:
        fsync_dir(sub)
    trash = None
    if final.exists():  # the same step saved again (e.g. force=True after a resume)
        trash = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    marker = json.dumps({"format": FORMAT, "manifest_sha256": hashlib.sha256(data).hexdigest()}) + "\n"
    write_durable(final / MARKER, marker.encode())
    fsync_dir(final)
    if trash is not None:
        remove_tree(trash)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint directory: marker first, so a half-deleted one is never 'complete'."""
    import shutil

    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path)


# --- checking ----------------------------------------------------------------------

_REQUIRED = {"format": str, "step": int, "world_size": int, "files": dict, "strategy": str, "state_keys": list}


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint, after checking it against the marker; raises ``Damaged``."""
    if not path.is_dir():
        raise Damaged("not a directory" if path.exists() else "does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise Damaged("incomplete: no COMPLETE marker (the save was interrupted)")
    try:
        expected = json.loads(marker.read_text())["manifest_sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise Damaged(f"unreadable {MARKER} marker") from None
    try:
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise Damaged(f"{MANIFEST} is missing") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise Damaged(f"{MANIFEST} does not match the hash in its {MARKER} marker (changed or truncated)")
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise Damaged(f"{MANIFEST} is not valid JSON ({err})") from None
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise Damaged(f"{MANIFEST} has no valid {key!r}")
    if manifest["format"] != FORMAT:
        raise Damaged(f"unknown format {manifest['format']!r}; expected {FORMAT!r}")
    return manifest


def check_sizes(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Cheap checks: every listed file exists with its listed size."""
    problems = []
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != info["bytes"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, expected {info['bytes']} (truncated or overwritten)")
    return problems


def check_hashes(path: Path, manifest: dict[str, Any], names: Iterable[str]) -> list[str]:
    """Full check of some of the files: each one's checksum (the algorithm its manifest entry names)."""
    problems = []
    for name in names:
        info = manifest["files"][name]
        f = path / name
        algorithm = next((a for a in ALGORITHMS if a in info), None)
        if algorithm is None:
            problems.append(f"{f} has no checksum in the manifest (expected one of {', '.join(ALGORITHMS)})")
            continue
        try:
            size, digest = file_digest(f, algorithm)
        except OSError as err:
            problems.append(f"{f} cannot be read ({err.strerror or err})")
            continue
        if size != info["bytes"]:
            problems.append(f"{f} has {size} bytes, expected {info['bytes']} (truncated or overwritten)")
        elif digest != info[algorithm]:
            problems.append(f"{f} has changed bytes ({algorithm} mismatch)")
    return problems


def verify(path: Path, full: bool = True) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest or None, problems) for one checkpoint directory, in one process."""
    try:
        manifest = read_manifest(path)
    except Damaged as err:
        return None, [str(err)]
    problems = check_sizes(path, manifest)
    if full and not problems:
        problems = check_hashes(path, manifest, sorted(manifest["files"]))
    return manifest, problems


# --- reading DCP without unpickling arbitrary objects -----------------------------------

_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes ``.metadata`` with plain pickle; read it with an allow-list instead.

    Only DCP's own metadata dataclasses, ``torch.Size``, dtypes/layouts and
    paths are accepted: a planted ``.metadata`` cannot run code.
    """

    def find_class(self, module: str, name: str) -> Any:
        ok = (
            (module, name) in _SAFE_GLOBALS
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "pathlib" or module.startswith("pathlib.")) and name.endswith("Path")
            or module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        )
        if not ok:
            raise Damaged(f".metadata refers to {module}.{name}, which a DCP checkpoint never contains")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Damaged:
                raise
            except Exception as err:  # noqa: BLE001 - any decoding failure means damage
                raise Damaged(f".metadata cannot be read ({type(err).__name__}: {err})") from None
        if not isinstance(metadata, Metadata):
            raise Damaged(".metadata does not hold DCP metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_plain(value) -> Any:
    # DCP stores non-tensor leaves (lr, betas, scheduler counters) with
    # torch.save; weights_only=True accepts plain Python values and tensors only.
    return torch.load(value, weights_only=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            compat.set_nested(self.original_state_dict, self.mappings[fqn], _load_plain(value))
        else:
            self.state_dict[fqn] = _load_plain(value)


class SafeEmptyLoadPlanner(compat.empty_load_planner()):
    """Rebuilds a state dict from the metadata (for export), reading plain values safely."""

    load_bytes = SafeLoadPlanner.load_bytes


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        yield


def read_metadata(path: Path) -> Metadata:
    return SafeReader(path).read_metadata()


def verified_model(src: Path) -> dict:
    """The manifest of checkpoint ``src``, fully verified and holding a model's state, or one line why not."""
    if not src.exists():
        raise UsageError(f"checkpoint {src} does not exist; list them with `multigpu ckpt ls DIR`")
    manifest, problems = verify(src, full=True)
    if problems:
        raise UsageError(f"checkpoint {src} cannot be exported: {problems[0]}; pick a valid one from `multigpu ckpt ls`")
    if "model" not in manifest["state_keys"]:
        raise UsageError(f"checkpoint {src} holds no model state (it has: {', '.join(manifest['state_keys'])})")
    return manifest


def provenance() -> dict[str, Any]:
    """When and by which versions a checkpoint was written: the manifest's ``time`` and ``versions``."""
    import platform

    import numpy as np

    from .. import __version__

    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"multigpu": __version__, "torch": torch.__version__, "numpy": np.__version__,
                         "python": platform.python_version()}}
