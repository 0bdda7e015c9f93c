"""mg.loader / mg.stream_loader against torch's DataLoader over the same shards; memory per reader; the data wait.

    .venv/bin/python benchmarks/data_loading.py [--repeats 3] [--out results.json]

1. Token shards (8 nanoGPT .bin files, 32M uint16 tokens, block 256):
   ``mg.loader(mg.TokenShards(...))`` vs ``DataLoader(same TokenShards, RandomSampler, batch_size)``.
2. WebDataset-style tars (8 x 500 samples of 16 KiB, decoded by the transform):
   ``mg.stream_loader`` vs a DataLoader over an IterableDataset that gives each
   worker whole tars and shuffles in a buffer of the same size (the usual
   split, which is neither world-size invariant nor resumable).
   Samples/s = samples / seconds over the measured steps after a warm-up,
   interleaved A B A B, ``--repeats`` times: the median and the range.
3. Memory: the unique resident memory (USS: pages no other process shares)
   of the reading processes (main + workers, psutil) at two buffer sizes,
   against the data size.
4. The GPT recipe's data-wait share of a step (the step meter's data_wait_frac
   in metrics.jsonl) over token shards.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, get_worker_info

import multigpu as mg
from multigpu.data.sources import materialize, read_tar

BLOCK, GLOBAL, WORKERS = 256, 64, 2
SAMPLE_BYTES = 16384


def dist1():
    return mg.Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def write_tokens(root: Path, name="tokens", shards=8, tokens=4_000_000, vocab=50257) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(shards):
        rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(d / f"fineweb_train_{i:06d}.bin")
    rng.integers(0, vocab, 400_000, dtype=np.uint16).tofile(d / "fineweb_val_000000.bin")
    return d


def write_tars(root: Path, shards=8, per=500) -> Path:
    d = root / "tars"
    d.mkdir(parents=True, exist_ok=True)
    n = 0
    for s in range(shards):
        with tarfile.open(d / f"train-{s:04d}.tar", "w") as tar:
            for _ in range(per):
                buf = io.BytesIO()
                np.save(buf, np.random.default_rng(n).integers(0, 255, SAMPLE_BYTES, dtype=np.uint8))
                for ext, data in (("npy", buf.getvalue()), ("cls", str(n % 10).encode())):
                    info = tarfile.TarInfo(f"{n:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                n += 1
    return d


def decode(record):
    x = torch.from_numpy(np.load(io.BytesIO(record["npy"]))).float().div_(255)
    return x, int(record["cls"])


class TarShuffle(IterableDataset):
    """The common baseline: each worker reads whole tars (file i goes to worker i % W) through a shuffle buffer."""

    def __init__(self, files, buffer, seed=0):
        self.files, self.buffer, self.seed = files, buffer, seed

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        rng, buf = random.Random(self.seed + w), []
        for f in self.files[w::n]:
            for rec in read_tar(f):
                buf.append(rec)
                if len(buf) >= self.buffer:
                    yield decode(materialize(buf.pop(rng.randrange(len(buf)))))
        rng.shuffle(buf)
        for rec in buf:
            yield decode(materialize(rec))


def _memory(proc: psutil.Process) -> int:
    """Unique resident bytes (USS) of ``proc`` and its children: no page shared with another process counts
    (the memory-mapped shards in the page cache, torch's pages a forked worker shares with its parent)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().uss
        except psutil.Error:
            pass
    return total


def timed(batches, steps: int, warmup: int, samples_per_step: int, watch_memory=False):
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    me = psutil.Process()
    peak = _memory(me) if watch_memory else 0
    t0 = time.perf_counter()
    for i in range(steps):
        next(it)
        if watch_memory and i % 10 == 0:
            peak = max(peak, _memory(me))
    dt = time.perf_counter() - t0
    del it
    return steps * samples_per_step / dt, peak


def forever(loader):
    while True:
        yield from loader


def compare(name, make_a, make_b, steps, warmup, repeats, samples):
    a, b = [], []
    for _ in range(repeats):  # interleaved: A B A B, so drift on a shared machine hits both
        a.append(timed(forever(make_a()), steps, warmup, samples)[0])
        b.append(timed(forever(make_b()), steps, warmup, samples)[0])
    row = {"mg": statistics.median(a), "mg_range": [min(a), max(a)], "torch": statistics.median(b),
           "torch_range": [min(b), max(b)], "ratio": statistics.median(a) / statistics.median(b)}
    print(f"{name}: mg {row['mg']:,.0f} samples/s ({min(a):,.0f}-{max(a):,.0f}), DataLoader {row['torch']:,.0f} "
          f"({min(b):,.0f}-{max(b):,.0f}); ratio {row['ratio']:.2f}", flush=True)
    return row


def data_wait(tokens: Path, root: Path, size: str, steps: int) -> dict:
    log = root / f"gpt-{size}"
    cmd = [sys.executable, "-m", "multigpu.recipes.gpt", "--size", size, "--data", str(tokens), "--steps", str(steps),
           "--global-batch", "16", "--log-every", "10", "--eval-every", str(steps), "--eval-batches", "1",
           "--log-dir", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=1200)
    recs = [json.loads(line) for f in log.rglob("metrics.jsonl") for line in f.read_text().splitlines()]
    steps_recs = [r for r in recs if "data_wait_frac" in r and not r.get("warmup")]
    fracs = [r["data_wait_frac"] for r in steps_recs]
    step_time = statistics.median(r["step_time"] for r in steps_recs)
    out = {"size": size, "data_wait_frac": statistics.mean(fracs), "data_wait_frac_max": max(fracs),
           "step_time_s": step_time, "records": len(fracs)}
    print(f"gpt {size}: data wait {100 * out['data_wait_frac']:.2f} % of a {1000 * step_time:.1f} ms step "
          f"(max {100 * out['data_wait_frac_max']:.2f} % over {len(fracs)} log intervals)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="mg-data-bench-"))
    tokens, tars = write_tokens(root), write_tars(root)
    files = sorted(str(f) for f in tars.iterdir())
    result = {"cpus": os.cpu_count(), "workers": WORKERS, "global_batch": GLOBAL}
    shards = mg.TokenShards(sorted(tokens.glob("*train*.bin")), BLOCK)
    plan = mg.BatchPlan(GLOBAL, 1)
    result["tokens"] = compare(
        f"token shards ({shards.tokens / 1e6:.0f}M tokens, {len(shards):,} windows)",
        lambda: mg.loader(shards, plan, dist1(), num_workers=WORKERS, multiprocessing_context="fork"),
        lambda: DataLoader(shards, sampler=RandomSampler(shards), batch_size=GLOBAL, num_workers=WORKERS,
                           multiprocessing_context="fork"),
        args.steps, 10, args.repeats, GLOBAL)
    buffer = 1024
    result["tars"] = compare(
        f"tar shards ({len(files) * 500} samples of {SAMPLE_BYTES // 1024} KiB, buffer {buffer})",
        lambda: mg.stream_loader(tars, plan, dist1(), buffer=buffer, transform=decode, num_workers=WORKERS,
                                 multiprocessing_context="fork"),
        lambda: DataLoader(TarShuffle(files, buffer), batch_size=GLOBAL, num_workers=WORKERS,
                           multiprocessing_context="fork"),
        min(args.steps, 40), 5, args.repeats, GLOBAL)
    data_bytes = sum(os.path.getsize(f) for f in files)
    mem = {"data_bytes": data_bytes}
    for buf in (256, 2048):
        _, peak = timed(forever(mg.stream_loader(tars, plan, dist1(), buffer=buf, transform=decode,
                                                 num_workers=WORKERS, multiprocessing_context="fork")),
                        50, 5, GLOBAL, watch_memory=True)
        mem[f"stream_buffer_{buf}_private_bytes"] = peak
        print(f"stream_loader, buffer {buf}: unique memory (USS) of main + {WORKERS} workers {peak / 2**20:.0f} MiB "
              f"(data {data_bytes / 2**20:.0f} MiB)",
              flush=True)
    _, peak = timed(forever(mg.loader(shards, plan, dist1(), num_workers=WORKERS, multiprocessing_context="fork")),
                    100, 5, GLOBAL, watch_memory=True)
    mem["token_shards_private_bytes"] = peak
    mem["token_shards_bytes"] = sum(s.nbytes for s in shards.shards)
    print(f"loader over token shards: unique memory (USS) {peak / 2**20:.0f} MiB for "
          f"{mem['token_shards_bytes'] / 2**20:.0f} "
          f"MiB of shards (the permutation: {8 * len(shards) / 2**20:.1f} MiB)", flush=True)
    result["memory"] = mem
    byte_tokens = write_tokens(root, "byte-tokens", shards=4, tokens=1_000_000, vocab=256)  # the recipe's vocabulary
    result["data_wait"] = [data_wait(byte_tokens, root, size, steps) for size, steps in (("tiny", 60), ("small", 30))]
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
