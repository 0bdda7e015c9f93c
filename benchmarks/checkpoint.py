"""Checkpointer save/load time and bytes against a plain ``torch.save`` of the same state.

One model of about ``--params`` parameters (a stack of square Linear layers)
with Adam state after one step, wrapped in DDP on ``-n`` gloo ranks. Trials
alternate, inside one job, so that machine noise hits both alike:

(a) ``torch.save({"model", "optimizer"})`` on rank 0, flushed and fsynced
    (the plain way: one file, rank 0 writes everything), then
    ``torch.load(weights_only=True)`` + ``load_state_dict`` on every rank;
(b) plain DCP: ``dcp.save`` / ``dcp.load`` of ``get_state_dict`` (what the
    Checkpointer builds on), then ``set_state_dict``;
(c) ``mg.Checkpointer.save(step, force=True)``: DCP files, per-rank RNG,
    sha256 of every file, manifest, rename, marker; then ``resume()``:
    checksum verification (split over ranks), DCP load, ``set_state_dict``;
(d) ``mg.Checkpointer(async_save=True)``: the blocking part of ``save``
    (staging a host copy) and the total until ``finish()`` has completed it.

Printed: per-trial seconds, the median and spread, bytes on disk, the
ratio b/a, and the environment fingerprint.

    python benchmarks/checkpoint.py                    # ~100M parameters, 1 rank, 3 trials
    python benchmarks/checkpoint.py -n 2 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import multigpu as mg
from multigpu.runtime.fingerprint import format_fingerprint
from multigpu.checkpoint import storage
from multigpu.testing import spawn

LAYERS = 6


def _model(params: float) -> nn.Module:
    width = int(math.sqrt(params / LAYERS))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _trial(dist, params: float, repeats: int, root: str):
    model = mg.wrap(_model(params), "ddp")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, model.module[0].in_features)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    root = Path(root)
    plain = root / "plain.pt"
    ckpt = mg.Checkpointer(root / "run", keep=1, model=model, optimizer=opt)
    background = mg.Checkpointer(root / "run-async", keep=1, model=model, optimizer=opt, async_save=True)
    rows = []
    for trial in range(repeats + 1):  # trial 0 warms up page cache and allocators
        row = {}
        tdist.barrier()
        t0 = time.perf_counter()
        if dist.rank == 0:
            state = {"model": mg.unwrap(model).state_dict(), "optimizer": opt.state_dict()}
            with open(plain, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        tdist.barrier()
        row["plain_save"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = torch.load(plain, weights_only=True)
        mg.unwrap(model).load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        del loaded
        tdist.barrier()
        row["plain_load"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        msd, osd = get_state_dict(mg.unwrap(model), [opt])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=root / f"dcp-{trial}")
        tdist.barrier()
        row["dcp_save"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        msd, osd = get_state_dict(mg.unwrap(model), [opt])
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=root / f"dcp-{trial}")
        set_state_dict(mg.unwrap(model), [opt], model_state_dict=msd, optim_state_dict=osd)
        tdist.barrier()
        row["dcp_load"] = time.perf_counter() - t0
        if dist.rank == 0:
            shutil.rmtree(root / f"dcp-{trial}")

        t0 = time.perf_counter()
        background.save(trial, force=True)
        row["async_blocking"] = time.perf_counter() - t0
        background.finish()
        row["async_total"] = time.perf_counter() - t0

        tdist.barrier()
        t0 = time.perf_counter()
        path = ckpt.save(trial, force=True)
        row["ckpt_save"] = time.perf_counter() - t0
        tdist.barrier()
        t0 = time.perf_counter()
        ckpt.resume()
        row["ckpt_load"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        storage.hash_files(path, storage.list_files(path))
        row["checksum_all_files"] = time.perf_counter() - t0
        row["plain_bytes"] = plain.stat().st_size
        row["ckpt_bytes"] = _dir_bytes(path)
        if trial:
            rows.append(row)
    n = sum(p.numel() for p in model.parameters())
    return {"rows": rows, "parameters": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="model size in parameters (default 100e6)")
    ap.add_argument("-n", "--world-size", type=int, default=1, help="gloo ranks (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed trials after one warm-up (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="mg-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = spawn(_trial, args.world_size, args.params, args.repeats, str(root), timeout=3600)[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = result["rows"]
    print(f"checkpoint benchmark: {result['parameters'] / 1e6:.1f}M parameters + Adam state, "
          f"{args.world_size} gloo rank(s), DDP, {len(rows)} trials after 1 warm-up")
    print(f"{'':18}{'median s':>10}{'min s':>8}{'max s':>8}   per-trial seconds")
    for key in ("plain_save", "dcp_save", "ckpt_save", "async_blocking", "async_total", "plain_load", "dcp_load",
                "ckpt_load", "checksum_all_files"):
        v = [r[key] for r in rows]
        print(f"{key:18}{statistics.median(v):10.2f}{min(v):8.2f}{max(v):8.2f}   " + " ".join(f"{x:.2f}" for x in v))
    pb, cb = rows[-1]["plain_bytes"], rows[-1]["ckpt_bytes"]
    ratio = lambda a, b: statistics.median([r[b] / r[a] for r in rows])  # noqa: E731 - paired per trial
    print(f"bytes: torch.save {pb / 1e6:.1f} MB, Checkpointer {cb / 1e6:.1f} MB (ratio {cb / pb:.3f})")
    print(f"ratio Checkpointer / torch.save (median of per-trial ratios): save {ratio('plain_save', 'ckpt_save'):.2f}x, "
          f"load {ratio('plain_load', 'ckpt_load'):.2f}x; plain DCP / torch.save: save "
          f"{ratio('plain_save', 'dcp_save'):.2f}x, load {ratio('plain_load', 'dcp_load'):.2f}x; async blocking / sync "
          f"save {ratio('ckpt_save', 'async_blocking'):.2f}x, async total / sync save {ratio('ckpt_save', 'async_total'):.2f}x")
    load = os.getloadavg()
    print("env:", format_fingerprint(mg.fingerprint(None, world_size=args.world_size, backend="gloo")),
          f"| load average {load[0]:.1f}")


if __name__ == "__main__":
    main()
