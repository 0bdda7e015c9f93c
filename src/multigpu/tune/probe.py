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


def compute(cfg, keys, threads: int, rounds: int = 7) -> dict:
    """For each (micro_batch, activation_checkpointing) in ``keys``: {"time_s": median forward+backward of
    one micro-batch, "optimizer_s": clipping and AdamW's step of the whole model, "activation_bytes": saved
    for its backward}. The keys are timed in turn (A B C A B C ...), ``rounds`` times, after a warm-up
    each, so machine noise falls on all alike."""
    from ..recipes.gpt.model import GPT

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, cfg.vocab_size, (max(m for m, _ in keys), cfg.block_size + 1))
        out: dict = {}
        times: dict = {key: [] for key in keys}
        opt_times = []

        def step(m: int, ac: bool) -> None:
            for block in model.blocks.values():
                block.checkpointed = ac
            loss = F.cross_entropy(model(x[:m, :-1]).flatten(0, 1), x[:m, 1:].flatten())
            loss.backward()

        for m, ac in keys:
            acts = LiveActivations(model.parameters())
            with acts.hooks():
                step(m, ac)  # warm-up, and the count of saved bytes
            out[(m, ac)] = {"activation_bytes": acts.peak}
        for _ in range(rounds):
            for key in keys:
                t0 = time.perf_counter()
                step(*key)
                times[key].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
            opt_times.append(time.perf_counter() - t0)
        for key in keys:
            out[key] |= {"time_s": statistics.median(times[key]), "optimizer_s": statistics.median(opt_times),
                         "rounds": rounds}
        return out
    finally:
        torch.set_num_threads(before)


def cache_path(n: int, device: str, threads: int) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "multigpu", f"links-{socket.gethostname()}-{device}-n{n}-t{threads}.json")


def links(group_sizes: set[int], device: str, threads: int, say=print) -> tuple[Links, dict]:
    """The links' measured points for every group size (cached); (Links, where each came from)."""
    from ..commbench.run import run_bench
    from ..commbench.spec import BenchConfig
    from ..runtime.contract import environ

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
