"""The measured parts of the cost model: one micro-batch on one process, and the links.

``compute`` times a micro-batch's forward and backward of the GPT recipe's
model in this process (with the threads one worker gets) and counts the bytes
autograd saves for it. ``links`` measures all-reduce, all-gather,
reduce-scatter and broadcast at sizes 4 KiB..16 MiB on each group size the
candidates use, through ``multigpu bench``'s measurement, and keeps the result
in a cache file per machine, device kind, group size and thread count.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time

import torch
import torch.nn.functional as F

from ..parallel.footprint import LiveActivations
from .model import Links

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
SIZES = tuple(4096 * 4 ** k for k in range(7))  # 4 KiB .. 16 MiB


def compute(cfg, micro_batch: int, activation_checkpointing: bool, threads: int, reps: int = 3) -> dict:
    """{"time_s": median forward+backward of one micro-batch, "optimizer_s": clipping and AdamW's step of the
    whole model, "activation_bytes": saved for its backward}."""
    from ..recipes.gpt.model import GPT

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in model.blocks.values():
            block.checkpointed = activation_checkpointing
        x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size + 1))
        inp, target = x[:, :-1], x[:, 1:]
        acts = LiveActivations(model.parameters())

        def step():
            loss = F.cross_entropy(model(inp).flatten(0, 1), target.flatten())
            loss.backward()

        with acts.hooks():
            step()  # warm-up, and the count of saved bytes
        times, opt_times = [], []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(t1 - t0)
            opt_times.append(time.perf_counter() - t1)
        return {"time_s": statistics.median(times), "optimizer_s": statistics.median(opt_times),
                "activation_bytes": acts.peak, "reps": reps}
    finally:
        torch.set_num_threads(before)


def cache_path(n: int, device: str, threads: int) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "multigpu", f"links-{socket.gethostname()}-{device}-n{n}-t{threads}.json")


def links(group_sizes: set[int], device: str, threads: int, say=print) -> tuple[Links, dict]:
    """The links' measured points for every group size (cached); (Links, where each came from)."""
    from ..commbench.run import run_bench
    from ..commbench.spec import BenchConfig
    from ..launch.contract import environ

    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    sources = {}
    for n in sorted(s for s in group_sizes if s > 1):
        path = cache_path(n, device, threads)
        rows = None
        if os.path.isfile(path):
            with open(path) as fp:
                rows = json.load(fp)
            sources[n] = f"cached {path}"
        else:
            say(f"multigpu tune: measuring the links on {n} ranks (once per machine; cached in {path})")
            cfg = BenchConfig(ops=OPS, sizes=SIZES, warmup=3, iters=10, check=False,
                              backend="gloo" if device == "cpu" else None)
            with environ(OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="" if device == "cpu" else None):
                result = run_bench(cfg, nproc=n)
            rows = [{"op": r["op"], "size": r["size"], "time_s": (r["out"] or r["in"])["time_us"] / 1e6}
                    for r in result["rows"] if not r.get("unsupported")]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.tmp", "w") as fp:
                json.dump(rows, fp)
            os.replace(f"{path}.tmp", path)
            sources[n] = f"measured, {path}"
        for r in rows:
            points.setdefault((r["op"], n), []).append((r["size"], r["time_s"]))
    return Links(points), sources
