"""This machine as ``multigpu forecast`` describes a cluster, from tune's probe: one cost model for both.

The forecast's model (``forecast/cost.py``) predicts every candidate; what it would read from a GPU's spec
sheet it reads here from measurement (``probe.py``):

- the rate: the forecast's own count of a micro-batch's training FLOPs (recompute included) over the
  probe's time of that micro-batch on one process, per micro-batch size and checkpointing, divided by the
  busy ranks' slowdown (on CPU the workers share the cores) and used as achieved (efficiency 1);
- the collectives: the probe's links (each op timed at 4 KiB..16 MiB on each group size), interpolated;
- the optimizer: AdamW's and clipping's measured time as a memory bandwidth (the forecast's 36 bytes per
  parameter);
- the overheads: what each wrapper and the recipe's loop add per micro-batch and per step, and what one
  collective waits in a busy step beyond its own transfer (``forecast.cost.Overheads``).

Assumed (named in the report): no overlap of communication and compute (on CPU gloo competes with the
backward for the cores), no CUDA runtime or allocator overhead beyond the tensors.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

from ..errors import UsageError
from ..forecast.cost import WORK, Assumptions, Overheads, Run
from ..forecast.compute import micro_flops
from ..forecast.counts import Counts
from ..forecast.hardware import Cluster, Gpu
from ..parallel.layout import Layout

# The peak tune measures is the live tensors' (CPU: the profiler's running total; CUDA: max_memory_allocated).
ASSUMPTIONS = Assumptions(efficiency=1.0, dp_overlap=0.0, runtime_gib=0.0, allocator_overhead=0.0, reserved=False,
                          calibration="measured on this machine (tune's probe)")


def family(layout: Layout) -> str:
    """Which wrapper a layout puts around the model (the key of the measured fixed costs): none, ddp, fsdp
    (HSDP too), tp or fsdp+tp."""
    kind = layout.strategy
    if kind == "ddp":
        return "ddp"
    sharded = kind in ("fsdp", "hsdp")
    if layout.tp > 1:
        return "fsdp+tp" if sharded else "tp"
    return "fsdp" if sharded else "none"


def count_recipe(model_cfg, precision: str = "fp32") -> Counts:
    """The forecast's count of the GPT recipe's model, its activations in the recipe's compute dtype."""
    import torch

    from ..forecast.counts import count
    from ..recipes.gpt.model import GPT

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return count(lambda: GPT(model_cfg), model_cfg.block_size, name="gpt", dtype=dtype)


def parts_of(report: dict) -> dict:
    """The measured parts a tune run recorded in its tune.json (``probe_record``: its ``probe``; a script's
    tune.json from before the one path kept it in ``prediction``), as ``measure_parts`` returned them."""
    from .probe import links_of

    probe = report.get("probe") or report["prediction"]
    rows = probe["links"]
    for n, kept in rows.items():
        if isinstance(kept, str):  # a tune.json from before the links were kept in it: "cached <the file>"
            where = Path(kept.split()[-1])
            if not where.is_file():
                raise UsageError(f"this tune.json's links on {n} ranks were kept in {where}, which is gone; "
                                 "run the tune again")
            rows = rows | {n: json.loads(where.read_text())}
    measured = links_of(rows)
    return {"compute": {(int(k.removesuffix("+ac")), k.endswith("+ac")): v for k, v in probe["compute"].items()},
            "links": measured, "slowdown": probe["busy"]["slowdown"], "fixed": probe["fixed"],
            "wrappers": probe["wrappers"], "sync": {int(n): waits(w) for n, w in probe["busy"]["wait_s"].items()},
            "idle": {int(n): w for n, w in probe["busy"].get("idle_s", {}).items()}}


def waits(measured) -> list[tuple[float, float]]:
    """A busy probe's waits for one group size as [(work before it, wait)] (``probe.sync``); a tune.json from
    before the probe timed several stretches of work kept one wait, after about half a millisecond."""
    if isinstance(measured, (int, float)):
        return [(0.0, float(measured))]
    return sorted((float(g), float(w)) for g, w in measured)


def measured_cluster(counts: Counts, parts: dict, nproc: int, memory: float | None) -> Cluster:
    """This machine's ``nproc`` ranks as a forecast cluster: the probe's rates and links (``parts``:
    ``measure_parts``), ``memory`` per rank (None: no limit)."""
    slowdown = parts["slowdown"]
    rates = {}
    for (mb, ac), got in parts["compute"].items():
        recompute = "full" if ac else "none"
        flops = sum(micro_flops(counts, range(counts.layers), mb * counts.seq_len, 1, recompute))
        rates[(mb, recompute)] = flops / (got["time_s"] * slowdown)
    optimizer_s = next(iter(parts["compute"].values()))["optimizer_s"] * slowdown
    gpu = Gpu("measured", "this machine (measured)", math.inf if memory is None else memory,
              ASSUMPTIONS.optimizer_bytes * counts.params / optimizer_s, max(rates.values()), None, 0.0, 0.0)
    return Cluster(gpu, nproc, nproc, rates=rates, links=parts["links"], slowdown=slowdown)


def overheads(layout: Layout, parts: dict) -> Overheads:
    """The measured fixed costs of ``layout``'s wrapper (x the busy ranks' slowdown: they are CPU work) and each
    collective's wait in a busy step after each stretch of work measured, less its own transfer (the links
    count it): the same all-reduce's time back to back, measured beside it (``probe.sync``'s ``idle_s``; a
    tune.json from before it: the links' 1 KiB all-reduce, measured on another day)."""
    fixed = parts["fixed"][family(layout) + ("+ac" if layout.activation_checkpointing else "")]
    links, slowdown = parts["links"], parts["slowdown"]
    idle = parts.get("idle") or {}
    floor = {n: idle[n] if n in idle else links.time("all_reduce", n, 1024) if ("all_reduce", n) in links.points
             else 0.0 for n in parts["sync"]}
    return Overheads(fixed["micro_s"] * slowdown, fixed["step_s"] * slowdown,
                     {n: tuple((g, max(0.0, w - floor[n])) for g, w in points) for n, points in parts["sync"].items()})


def predict(layout: Layout, counts: Counts, cluster: Cluster, parts: dict, global_batch: int) -> dict:
    """The forecast of one candidate on this machine, in tune's terms: memory per rank, step time and its
    parts (compute: micro-batches, bubble, optimizer; communication; fixed costs), the forecast's own parts."""
    from ..forecast.cost import predict as forecast

    # The logits gathered; a script's loop holds them through the backward (the recipe's and examples' do, as most do).
    run = Run(global_batch, counts.seq_len, "full" if layout.activation_checkpointing else "none", logits_held=True)
    got = forecast(counts, cluster, layout, run, ASSUMPTIONS, overheads(layout, parts))
    compute = sum(v for k, v in got["time"].items() if k in WORK)
    fixed = got["time"].get("fixed costs", 0.0)
    return {"step_time_s": got["step_s"], "memory_bytes": got["memory_bytes"], "compute_s": compute,
            "comm_s": got["step_s"] - compute - fixed, "overhead_s": fixed, "time": got["time"],
            "memory": got["memory"], "collectives": got["collectives"], "fits": got["fits"]}


def pruned(p: dict, cluster: Cluster) -> str | None:
    """Why a prediction is pruned: forecast's ``fits`` (its memory within the cluster's, the budget), else None."""
    return None if p["fits"] else (f"predicted {p['memory_bytes'] / 2**20:,.1f} MiB > budget "
                                   f"{cluster.gpu.hbm_bytes / 2**20:,.1f} MiB")


def budget_of(cfg, device: str) -> tuple[int | None, str]:
    """The most memory a rank may use (``cfg.memory_budget``, else 90 % of the GPU's; None on CPU) and how the
    report says it."""
    if cfg.memory_budget is not None:
        return cfg.memory_budget, f"--memory-budget {cfg.memory_budget / 2**20:,.0f} MiB"
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return int(0.9 * total), f"90 % of the GPU's {total / 2**30:.0f} GiB"
    return None, "none (CPU: pass --memory-budget to prune by memory)"


def measure_parts(subject, found: list[Layout], nproc: int, device: str, threads: int, say=print, *,
                  workload: str, module: bool, recipe_args: tuple[str, ...] = (), root: Path | None = None) -> dict:
    """The cost model's measured parts for ``found``: the micro-batches' compute of ``subject``'s model
    (``wrappers.Subject``), the links, the loop of ``workload`` (the recipe's module, or with ``module=False``
    a script's path) on one rank with ``recipe_args`` and the wrappers' fixed costs (one process), the
    collectives' waits and the compute's slowdown in a busy step (the real ranks), with the time each took."""
    from . import probe, wrappers

    t0 = time.perf_counter()
    compute = probe.compute(subject, sorted({(c.micro_batch, c.activation_checkpointing) for c in found}), threads)
    probe_s = time.perf_counter() - t0
    shapes = [c.resolve(nproc) for c in found]
    groups = {n for s in shapes for n in (s.dp_size, s.dp_shard, s.dp_replicate, s.tp)}
    groups |= {2} if any(s.pp > 1 for s in shapes) else set()
    links, rows = probe.links(groups, nproc, device, threads, say=say)
    t0 = time.perf_counter()
    micro = min(c.micro_batch for c in found)
    say("multigpu tune: measuring the training loop on one rank and the wrappers' fixed costs on one process")
    # The user's model flags; the loop probe's --global-batch comes after theirs (the last one counts).
    loop = probe.loop(workload, list(recipe_args), compute, micro, device == "cpu", threads,
                      root or Path(tempfile.mkdtemp(prefix="multigpu-tune-")), module=module)
    fixed_costs = wrappers.overheads(subject, micro, threads, acs=tuple(sorted({c.activation_checkpointing for c in found})),
                                     families=tuple({family(s) for s in shapes}))  # those the candidates use
    fixed = wrappers.plus_loop(fixed_costs, loop)
    fixed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    busy = probe.sync(groups | {nproc}, nproc, device, threads, say=say)
    return {"compute": compute, "probe_s": probe_s, "links": links, "link_rows": rows, "fixed": fixed,
            "loop": loop, "wrappers": fixed_costs, "fixed_s": fixed_s, "idle": busy["idle_s"],
            "sync": {n: waits(w) for n, w in busy["wait_s"].items()}, "slowdown": busy["slowdown"],
            "busy": busy | {"measure_s": time.perf_counter() - t0}}


def probe_record(parts: dict) -> dict:
    """What a tune.json keeps of ``measure_parts``' parts (``parts_of`` reads it back): the compute per
    micro-batch (keys "4", "4+ac"), the links' measured rows, the fixed costs, the busy step, each probe's time."""
    return {"compute": {f"{m}{'+ac' if ac else ''}": v for (m, ac), v in parts["compute"].items()},
            "probe_s": parts["probe_s"], "links": parts["link_rows"], "fixed": parts["fixed"], "loop": parts["loop"],
            "wrappers": parts["wrappers"], "fixed_s": parts["fixed_s"], "busy": parts["busy"]}
