"""Small sources of every kind the loaders read, written to a folder, and what identifies each sample.

Module level so spawned ranks (multigpu.testing.spawn) and the kill-and-resume
script can import it. Every sample carries an id, so a test compares the
global batches of two runs as lists of ids.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import torch

import multigpu as mg

try:
    import datasets  # the optional extra, multigpu[datasets]

    datasets.disable_progress_bars()
except ImportError:  # pragma: no cover - the hf sources are skipped
    datasets = None

TAR_SIZES = (23, 31, 9, 40)  # 103 records over 4 shards of unequal length
BLOCK = 8


def write_sources(root: str | os.PathLike) -> Path:
    """Token shards (raw, headered and .npy), tar shards, a jsonl shard and, with datasets, a saved Dataset."""
    root = Path(root)
    rng = np.random.default_rng(0)
    tok = root / "tokens"
    tok.mkdir(parents=True, exist_ok=True)
    rng.integers(0, 60000, 400, dtype=np.uint16).tofile(tok / "a_train.bin")
    body = rng.integers(0, 60000, 300, dtype=np.uint16)
    header = np.zeros(256, np.int32)
    header[:3] = (20240520, 1, len(body))
    (tok / "b_train.bin").write_bytes(header.tobytes() + body.tobytes())
    np.save(tok / "c_train.npy", rng.integers(0, 60000, 250, dtype=np.uint16))
    tars = root / "tars"
    tars.mkdir(exist_ok=True)
    n = 0
    for s, size in enumerate(TAR_SIZES):
        with tarfile.open(tars / f"shard-{s:03d}.tar", "w") as tar:
            for _ in range(size):
                x = io.BytesIO()
                np.save(x, np.full(3, n, dtype=np.float32))
                for ext, data in (("npy", x.getvalue()), ("cls", str(n % 5).encode())):
                    info = tarfile.TarInfo(f"{n:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                n += 1
    with open(root / "rows.jsonl", "w") as fp:
        for i in range(60):
            fp.write(json.dumps({"id": i, "text": "x" * (i % 7)}) + "\n")
    if datasets is not None:
        ds = datasets.Dataset.from_dict({"id": list(range(90)), "x": [[float(i)] * 3 for i in range(90)]})
        ds.save_to_disk(str(root / "hf"))
    return root


def decode(record: dict) -> dict:
    """A WebDataset sample to tensors (the transform: it runs on kept samples only)."""
    return {"id": int(record["__key__"]), "x": torch.from_numpy(np.load(io.BytesIO(record["npy"]))),
            "cls": int(record["cls"])}


def _tar_records(files: list[str]):
    from multigpu.data.sources import materialize, read_tar

    for f in files:
        yield from map(materialize, read_tar(f))


def hf_iterable(root: Path):
    """The tar shards as a datasets.IterableDataset, one data source per tar."""
    files = [str(p) for p in sorted((Path(root) / "tars").iterdir())]
    return datasets.IterableDataset.from_generator(_tar_records, gen_kwargs={"files": files})


KINDS = ["tokens", "tars", "lists", "jsonl"] + (["hf", "hf-iterable"] if datasets is not None else [])


def make_loader(kind: str, root: str | os.PathLike, plan, dist, workers: int = 0, seed: int = 0):
    root = Path(root)
    # A rank started by testing.spawn inherits its forkserver start method, and DataLoader workers
    # would each wait for a forkserver of their own (3 s); torchrun's ranks fork their workers, as here.
    extra = {"multiprocessing_context": "fork"} if workers else {}
    if kind == "tokens":
        return mg.loader(mg.TokenShards(root / "tokens", BLOCK), plan, dist, seed=seed, num_workers=workers, **extra)
    if kind == "hf":
        return mg.loader(datasets.load_from_disk(str(root / "hf")), plan, dist, seed=seed, num_workers=workers,
                         **extra)
    source = {"tars": root / "tars", "jsonl": [root / "rows.jsonl"],
              "lists": [list(range(s * 100, s * 100 + n)) for s, n in enumerate((17, 5, 30, 12, 21))],
              "hf-iterable": hf_iterable(root) if kind == "hf-iterable" else None}[kind]
    transform = decode if kind in ("tars", "hf-iterable") else None
    return mg.stream_loader(source, plan, dist, seed=seed, buffer=16, transform=transform, num_workers=workers,
                            **extra)


def ids(kind: str, micro_batch) -> list:
    """What identifies each sample of a micro-batch: its id, or a token window's first tokens."""
    if kind == "tokens":
        return [tuple(row) for row in micro_batch[0][:, :4].tolist()]
    if kind == "lists":
        return micro_batch.tolist()
    return micro_batch["id"].tolist()


def rank_steps(kind: str, loader, steps: int | None = None) -> list[list]:
    """This rank's sample ids per optimizer step, for one pass (or ``steps`` of them)."""
    out = []
    for i, micro_batches in enumerate(loader):
        out.append([x for mb in micro_batches for x in ids(kind, mb)])
        if steps is not None and i + 1 == steps:
            break
    return out


def spawned_global_batches(dist, root: str, global_batch: int, micro: int | None, kinds: list[str]) -> dict:
    """On every spawned rank: per source and worker count, this rank's ids per step of one epoch."""
    plan = mg.BatchPlan(global_batch, dist.world_size, micro_batch=micro)
    return {(kind, workers): rank_steps(kind, make_loader(kind, root, plan, dist, workers))
            for kind in kinds for workers in (0, 2)}
