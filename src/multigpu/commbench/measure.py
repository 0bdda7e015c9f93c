"""The measurement itself, as each rank runs it.

For every op, size and placement: fill known patterns, run the collective
once and count wrong elements, warm up, then time ``iters`` back-to-back
calls (CUDA events on GPU; wall clock after a barrier on CPU) and keep the
max over ranks, as the slowest rank is when the collective is done.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as tdist

from ..errors import UsageError
from ..runtime.values import DTYPES, dtype_name
from .spec import NCCL_TYPE, PLACES, REDOP, ROOT, BenchConfig, algbw, bus_factor

# Largest integer each dtype holds exactly (bf16 has 8 significant bits, fp16 11).
_EXACT = {torch.int8: 127, torch.uint8: 255, torch.bfloat16: 256, torch.float16: 2048}

# torch 2.11+ renamed the single-tensor collectives; keep the old names working.
_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def pattern(rank: int, count: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rank ``rank``'s known input: small integers, so any sum over ``n`` ranks is exact in ``dtype``."""
    m = max(1, min(13, _EXACT.get(dtype, 2**24) // n - 1))
    idx = torch.arange(count, dtype=torch.int64, device=device)
    return ((idx * 3 + rank * 7) % m + 1).to(dtype)


class _Case:
    """Buffers, the call and the expected result for one op / placement / count on one rank.

    ``call`` is a ``functools.partial`` of the torch.distributed function on
    the buffers: no closure over ``self``, so no reference cycle keeps the
    buffers alive until a garbage collection (which could then run inside a
    timed loop), and the timed call costs what a hand-written one does.
    """

    def __init__(self, op: str, place: str, count: int, rank: int, n: int, dtype, device, group=None, root: int = 0):
        """``rank`` of ``n``: this rank's place in ``group`` (None: the world's); ``root``: the global rank of the
        group's first, broadcast's source."""
        self.op, self.place = op, place
        on = {"group": group} if group is not None else {}
        per = count // n
        pat = lambda r, c: pattern(r, c, n, dtype, device)  # noqa: E731
        if op == "all_reduce":
            self.out = pat(rank, count)
            self.expected = sum(pat(r, count).to(torch.float64) for r in range(n)).to(dtype)
            self.call = partial(tdist.all_reduce, self.out, **on)
        elif op == "broadcast":
            self.out = pat(rank, count)
            self.expected = pat(0, count)
            self.call = partial(tdist.broadcast, self.out, src=root, **on)
        elif op == "all_gather":
            self.out = torch.empty(count, dtype=dtype, device=device)
            mine = pat(rank, per)
            if place == "in":
                self.out[rank * per:(rank + 1) * per] = mine
                mine = self.out[rank * per:(rank + 1) * per]
            self.expected = torch.cat([pat(r, per) for r in range(n)])
            self.call = partial(_all_gather, self.out, mine, **on)
        elif op == "reduce_scatter":
            inp = pat(rank, count)
            self.out = inp[rank * per:(rank + 1) * per] if place == "in" else torch.empty(per, dtype=dtype, device=device)
            self.expected = sum(pat(r, count)[rank * per:(rank + 1) * per].to(torch.float64) for r in range(n)).to(dtype)
            self.call = partial(_reduce_scatter, self.out, inp, **on)
        elif op == "all_to_all":
            inp = pat(rank, count)
            self.out = torch.empty(count, dtype=dtype, device=device)
            self.expected = torch.cat([pat(s, count)[rank * per:(rank + 1) * per] for s in range(n)])
            self.call = partial(tdist.all_to_all_single, self.out, inp, **on)
        else:  # pragma: no cover - ops are validated by BenchConfig
            raise AssertionError(op)

    def wrong(self) -> int:
        return int((self.out != self.expected).sum())


SPLIT = ("all_gather", "reduce_scatter", "all_to_all")


def counts_for(op: str, size: int, elt: int, n: int) -> int:
    """Total elements for a requested size: a multiple of n for the split ops (at least one per rank)."""
    count = max(1, size // elt)
    if op in SPLIT:
        count = max(1, count // n) * n
    return count


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call, iters: int, device) -> float:
    """Seconds per call of ``iters`` back-to-back calls on this rank, started together after a barrier."""
    _sync(device)
    tdist.barrier(device_ids=[device.index]) if device.type == "cuda" else tdist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def max_over_ranks(value: float, device, op=tdist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=op)
    return float(t.item())


def supported(op: str, dtype, device, n: int, rank: int, within: dict) -> bool:
    """Whether this backend runs ``op`` (gloo/mpi lack some); every rank gets the same answer."""
    try:
        _Case(op, PLACES[op][0], n, rank, n, dtype, device, **within).call()
        _sync(device)
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def measure(cfg: BenchConfig, device, rank: int, world: int) -> list[dict]:
    """All rows of ``cfg`` on this rank (every rank returns the same, max-over-ranks figures). With
    ``cfg.group``, each collective runs among that many consecutive ranks, every group at once."""
    n = cfg.group or world
    if world % n:
        raise UsageError(f"--group-size {n} does not divide the {world} ranks into groups")
    within = {}  # this rank's group and its first rank (``_Case``'s), where groups split the world
    if n < world:  # every rank creates every group (new_group is collective over the world)
        groups = [tdist.new_group(list(range(s, s + n))) for s in range(0, world, n)]
        within = {"group": groups[rank // n], "root": rank // n * n}
    rank = rank % n
    short = dtype_name(cfg.dtype)
    dtype, type_name = DTYPES[short], NCCL_TYPE[short]
    elt = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for op in cfg.ops:
        if not supported(op, dtype, device, n, rank, within):
            rows.append({"op": op, "unsupported": True})
            continue
        for size in cfg.sizes:
            count = counts_for(op, size, elt, n)
            # nccl-tests: size is the total (count x n for the split ops), count is per rank.
            per_rank = count // n if op in SPLIT else count
            row = {"op": op, "size": count * elt, "count": per_rank, "type": type_name, "redop": REDOP.get(op, "none"),
                   "root": ROOT.get(op, -1), "out": None, "in": None}
            for place in PLACES[op]:
                case = _Case(op, place, count, rank, n, dtype, device, **within)
                case.call()
                _sync(device)
                wrong = case.wrong() if cfg.check else 0
                for _ in range(max(0, cfg.warmup - 1)):
                    case.call()
                t = max_over_ranks(time_calls(case.call, cfg.iters, device), device)
                wrong = int(max_over_ranks(float(wrong), device, tdist.ReduceOp.SUM)) if cfg.check else None
                alg = algbw(row["size"], t)
                row[place] = {"time_us": t * 1e6, "algbw": alg, "busbw": alg * bus_factor(op, n), "wrong": wrong}
                del case
            rows.append(row)
    return rows
