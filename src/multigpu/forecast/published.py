"""The published runs a forecast is checked against (``tables/published.json``), the calibration fitted on
some of them (``tables/calibration.json``), and the held-out error on the rest.

The calibration set names the rows it was fitted on; ``fit`` reproduces it (each constant solved on its
row by bisection, in order: the eager bf16 row gives the achieved fraction of peak, the compiled row the
compile speedup, the fp8 row fp8's), ``fit_by_gpu`` the achieved fraction of the GPU kinds that have their
own (``by_gpu``: one row each, of the same source); ``check`` predicts every row and splits the errors into
fitted and held out. A pair is two rows of one table, model, GPU count and kernel options (precision, compile, async TP,
recompute) and different layouts, whose published speeds differ by more than 5 %: the forecast ranks it right when it predicts the faster one faster.
A row whose layout multigpu does not run is said to be so (``outside``: the library's own refusal of its degrees, or
Megatron-LM's distributed optimizer, a ZeRO-1 whose parameter gather overlaps the next forward); each entry carries it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from functools import cache

from ..errors import UsageError
from ..parallel.layout import Layout
from .cost import GiB, Assumptions, Run, predict
from .hardware import DATA, cluster, table
from .models import count_many, counted


@cache
def rows() -> list[dict]:
    return json.loads((DATA / "published.json").read_text())["rows"]


@cache
def calibration() -> dict:
    return json.loads((DATA / "calibration.json").read_text())


def assumptions(kind: str | None = None) -> Assumptions:
    """The stored calibration's constants, the rest at their defaults; for a GPU ``kind`` the calibration has an
    achieved fraction of its own (``by_gpu``), that one."""
    cal = calibration()
    return for_gpu(Assumptions(**cal["constants"], calibration=cal["name"]), kind, by_gpu())


def by_gpu() -> dict[str, float]:
    """The stored achieved fraction of peak of each GPU kind that has its own: {kind: efficiency}."""
    return {k: g["efficiency"] for g in calibration()["by_gpu"] for k in g["kinds"]}


def for_gpu(a: Assumptions, kind: str | None, efficiency: dict[str, float]) -> Assumptions:
    """``a`` with ``kind``'s own achieved fraction of peak where ``efficiency`` has one."""
    if kind not in efficiency:
        return a
    return dataclasses.replace(a, efficiency=efficiency[kind], calibration=f"{a.calibration}, {kind}'s efficiency")


def forecast(row: dict, a: Assumptions) -> dict:
    _count_published()
    layout = _layout(row)
    run = Run(row["global_batch"], row["seq_len"], row["recompute"], row["compile"], row["precision"], row["async_tp"],
              loss_parallel=True, compile_loss=row.get("compile_loss", False),  # torchtitan's and Megatron's
              fp8_all_gather=row.get("fp8_all_gather", False), fp8_tp_all_gather=row.get("fp8_tp_all_gather", False),
              overlap_param_gather=row.get("overlap_param_gather", False))
    machine = cluster(row["gpu"], row["gpus"], row["gpus_per_node"], hbm_gib=row.get("hbm_gb"))
    return predict(counted(row["model"], row["seq_len"], fp8_choice(row)), machine, layout, run, a)


def _layout(row: dict) -> Layout:
    """The row's layout as the library describes it, built by multigpu or not (``Layout.unbuilt``); the published
    runs (torchtitan's, Megatron's) run sequence parallelism beside tp."""
    return Layout(dp_replicate=row["dp_replicate"], dp_shard=row["dp_shard"], tp=row["tp"], pp=row["pp"], cp=row["cp"],
                  micro_batch=row["micro_batch"], schedule=row["schedule"], zero1=row.get("zero1", False),
                  sequence_parallel=row["tp"] > 1).resolve(row["gpus"])


@cache
def _count_published() -> None:
    """Every published row's model counted before the first row is forecast, the counts spread over the cores."""
    count_many((r["model"], r["seq_len"], fp8_choice(r)) for r in rows())


def fp8_choice(row: dict) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """The layers a row's run converted to float8, as (recipe, include, exclude) for ``counted``: each fp8 row says
    which (torchtitan's runs: every block Linear, the head ``output`` left out, in ``assumed``)."""
    if row["precision"] != "fp8":
        return None
    return row.get("fp8_recipe", "tensorwise"), tuple(row.get("fp8_include", ())), tuple(row.get("fp8_exclude", ()))


OVERLAPPED = ("ZeRO-1 whose parameter all-gather overlaps the next forward (Megatron's distributed optimizer with "
              "--overlap-param-gather): multigpu's (mg.wrap's 'zero1', ZeroRedundancyOptimizer) all-reduces the "
              "gradients and broadcasts the parameters after the optimizer step, exposed")


def outside(row: dict) -> str | None:
    """Why multigpu does not run ``row``'s layout, or None where it does: Megatron's overlapped ZeRO-1, and the line
    the library refuses to build its layout with (``Layout.unbuilt``: context parallelism beside a pipeline or
    sequence parallelism; ZeRO-1 beside TP or PP)."""
    why = [OVERLAPPED] if row.get("overlap_param_gather") else []
    return "; ".join(why + [x for x in [_layout(row).unbuilt()] if x]) or None


def key(row: dict) -> str:
    return f"{row['table']} / {row['model']} {row['gpus']} GPUs dp_shard {row['dp_shard']} tp {row['tp']} pp " \
           f"{row['pp']} cp {row['cp']} {row['schedule'] if row['pp'] > 1 else ''}{' zero1' if row.get('zero1') else ''} " \
           f"{row['precision']}" \
           f"{' compile' if row['compile'] else ''}{' async-tp' if row['async_tp'] else ''}" \
           f"{' fp8-tp-gather' if row.get('fp8_tp_all_gather') else ''}" \
           f"{' rowwise' if row.get('fp8_recipe') == 'rowwise' else ''} s {row['seq_len']}"


# How far each constant may go: the achieved fraction of peak cannot pass the peak; a speedup or an overhead of 5 x
# is already beyond what any kernel option or allocator gives.
LIMITS = {"efficiency": 1.0}


def _solve(row: dict, a: Assumptions, field: str) -> Assumptions | None:
    """``a`` with ``field`` set so that ``row``'s forecast meets its published figure (tokens/s, or memory for the
    allocator's overhead: each grows with the constant, so bisection finds it); None where no value within the
    constant's limits meets it (a row the rest of the forecast holds too slow, or too small, whatever the constant:
    it says nothing of this one; so one whose forecast tops the figure with the constant at 0)."""
    lo, top = 0.0, LIMITS.get(field, 5.0)
    hi = top
    for _ in range(60):
        mid = (lo + hi) / 2
        got = forecast(row, dataclasses.replace(a, **{field: mid}))
        low = got[MEMORY_KINDS[row.get("memory_kind")]] / GiB < row["peak_memory_gib"] if field == "allocator_overhead" \
            else got["tokens_per_s_per_gpu"] < row["tokens_per_s_per_gpu"]
        lo, hi = (mid, hi) if low else (lo, mid)
    if hi >= top * (1 - 1e-9) or lo <= top * 1e-9:  # pinned at an end: the figure lies beyond it
        return None
    return dataclasses.replace(a, **{field: round((lo + hi) / 2, 4)})


def fit(base: Assumptions | None = None) -> Assumptions:
    """The calibration's constants solved on its named rows (in the order efficiency, compile, fp8)."""
    cal = calibration()
    a = base or Assumptions(calibration=cal["name"])
    by_key = {key(r): r for r in rows()}
    for field, k in cal["fitted_on"].items():
        a = _solve(by_key[k], a, field) or _unreachable(k, field)
    return a


def _unreachable(key: str, field: str):
    raise UsageError(f"the calibration row {key!r} cannot be met by any {field} within its limit "
                     f"({LIMITS.get(field, 5.0)}): the calibration names a row the forecast cannot fit")


def fit_by_gpu(a: Assumptions) -> dict[str, float]:
    """Each GPU kind's own achieved fraction of peak (``by_gpu``), solved on its named row with ``a``'s other
    constants: {kind: efficiency}."""
    by_key = {key(r): r for r in rows()}
    return {kind: (_solve(by_key[g["fitted_on"]], a, "efficiency") or _unreachable(g["fitted_on"], "efficiency"))
            .efficiency for g in calibration()["by_gpu"] for kind in g["kinds"]}


def check(a: Assumptions | None = None, kinds: dict[str, float] | None = None) -> dict:
    """Every row predicted: {"rows": [...], "held_out": summary, "fitted": summary, "pairs": ...}; ``a`` (default:
    the stored constants) with each GPU kind's own efficiency from ``kinds`` (default: the stored ``by_gpu``).
    A row with the key of a row fitted on counts as fitted (the forecast cannot tell them apart)."""
    cal = calibration()
    a = a or assumptions()
    kinds = by_gpu() if kinds is None else kinds
    fitted = set(cal["fitted_on"].values()) | {g["fitted_on"] for g in cal["by_gpu"]}
    out = [dict(_entry(row, a, kinds), fitted=key(row) in fitted) for row in rows()]
    held = [e for e in out if not e["fitted"]]
    return {"rows": out, "held_out": _summary(held), "fitted": _summary([e for e in out if e["fitted"]]),
            "by_source": {s: _summary([e for e in held if source(e["row"]) == s]) for s in
                          dict.fromkeys(source(e["row"]) for e in held)},
            # The rows of sources no constant was fitted on: what a forecast does on runs from elsewhere.
            "unseen_sources": _summary([e for e in held if source(e["row"]) not in
                                        {source(f["row"]) for f in out if f["fitted"]}]),
            "pairs": _pairs(held), "assumptions": dataclasses.asdict(a), "by_gpu": kinds}


# What a row's published peak is, and the forecast it is compared with: the caching allocator's reserved bytes
# (torchtitan's log line prints max_reserved), the tensors' allocated peak, or unstated (compared as reserved, what a
# run's console shows; both forecasts are in the entry).
MEMORY_KINDS = {"reserved": "memory_bytes", "allocated": "allocated_bytes", "unstated": "memory_bytes", None: "memory_bytes"}


def _entry(row: dict, a: Assumptions, kinds: dict[str, float]) -> dict:
    """One row forecast with ``a`` (its GPU kind's own efficiency from ``kinds``), and its errors."""
    got = forecast(row, for_gpu(a, row["gpu"], kinds))
    entry = {"key": key(row), "source": row["source"],
             "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"], "predicted_tokens": got["tokens_per_s_per_gpu"],
             "peak_memory_gib": row["peak_memory_gib"], "memory_kind": row.get("memory_kind"),
             "predicted_memory_gib": got[MEMORY_KINDS[row.get("memory_kind")]] / GiB,
             "predicted_reserved_gib": got["memory_bytes"] / GiB, "predicted_allocated_gib": got["allocated_bytes"] / GiB,
             "mfu": row["mfu"], "predicted_mfu": got["mfu"], "row": row,
             "outside": outside(row)}
    # Speed: tokens/s per GPU, or the MFU where only that is published (the same ratio when both count
    # FLOPs alike: 6 x parameters + attention, no recompute).
    entry["tokens_error"] = got["tokens_per_s_per_gpu"] / row["tokens_per_s_per_gpu"] - 1 \
        if row["tokens_per_s_per_gpu"] else (got["mfu"] / row["mfu"] - 1 if row["mfu"] else None)
    entry["memory_error"] = entry["predicted_memory_gib"] / row["peak_memory_gib"] - 1 \
        if row["peak_memory_gib"] else None
    return entry


# The rows each constant is solved on when fitting on any set of rows (``fit_on``): the achieved fraction of
# peak on eager bf16 runs, compile's speedup on compiled bf16 ones, fp8's on fp8 ones (none of them async TP,
# which the forecast models apart), the allocator's overhead on every row with a published peak.
def _plain(r: dict) -> bool:
    return bool(r["tokens_per_s_per_gpu"]) and not r["async_tp"]


ELIGIBLE = {
    "efficiency": lambda r: _plain(r) and r["precision"] == "bf16" and not r["compile"],
    "compile_speedup": lambda r: _plain(r) and r["precision"] == "bf16" and r["compile"],
    "fp8_speedup": lambda r: _plain(r) and r["precision"] == "fp8",
    "allocator_overhead": lambda r: bool(r["peak_memory_gib"]),
}


def fit_on(train: list[dict]) -> tuple[Assumptions, dict[str, float]]:
    """Constants fitted on ``train`` alone: each solved on every eligible row (``ELIGIBLE``, in that order, each
    with the ones before it), the median taken; the achieved fraction of peak also per GPU kind, the shared one
    the median over every kind's rows. A row no value within the constant's limits fits (``_solve``: None) does not
    vote; a constant no row of ``train`` informs keeps its default."""
    a, kinds = Assumptions(calibration="fitted on other sources"), {}
    for field, eligible in ELIGIBLE.items():
        solved = [(r, _solve(r, for_gpu(a, r["gpu"], kinds), field)) for r in train if eligible(r)]
        solved = [(r, getattr(got, field)) for r, got in solved if got is not None]
        if not solved:
            continue
        a = dataclasses.replace(a, **{field: statistics.median([v for _, v in solved])})
        if field == "efficiency":
            kinds = _by_kind([(r["gpu"], v) for r, v in solved])
    return a, kinds


def _by_kind(solved: list[tuple[str, float]]) -> dict[str, float]:
    """Every GPU kind's achieved fraction of peak from ``(kind, fraction)`` pairs: the median of its own, else of
    its architecture's kinds (the same tensor cores and kernels: an H200 as the H100s), else none (the shared)."""
    arch = {k: g["arch"] for k, g in table().items()}
    out = {}
    for kind in table():
        own = [v for g, v in solved if g == kind] or [v for g, v in solved if arch.get(g) == arch[kind]]
        if own:
            out[kind] = statistics.median(own)
    return out


def leave_one_source_out() -> dict:
    """Each source's rows forecast with constants fitted on the other sources' rows only (``fit_on``): per
    source its summary, pairs and the constants it was forecast with; over every source the same summary."""
    by, every = {}, []
    for held in dict.fromkeys(source(r) for r in rows()):
        a, kinds = fit_on([r for r in rows() if source(r) != held])
        entries = [_entry(r, a, kinds) for r in rows() if source(r) == held]
        every += entries
        by[held] = {"summary": _summary(entries), "pairs": _pairs(entries), "shared_efficiency": a.efficiency,
                    **{f: getattr(a, f) for f in ELIGIBLE}, "efficiency": kinds}
    return {"by_source": by, "overall": _summary(every), "pairs": _pairs(every)}


def source(row: dict) -> str:
    """The document a row comes from, its commit left out: the unit a forecast is held out by."""
    return row["source"].split("@")[0]


def _summary(entries: list[dict]) -> dict:
    tok = sorted(abs(e["tokens_error"]) for e in entries if e["tokens_error"] is not None)
    mem = sorted(abs(e["memory_error"]) for e in entries if e["memory_error"] is not None)

    def share(errs, bound):
        return sum(x <= bound for x in errs) / len(errs) if errs else None

    def median(errs):
        return errs[len(errs) // 2] if errs else None

    return {"tokens_rows": len(tok), "tokens_within_25": share(tok, 0.25), "tokens_median": median(tok),
            "tokens_worst": tok[-1] if tok else None, "memory_rows": len(mem), "memory_within_15": share(mem, 0.15),
            "memory_median": median(mem), "memory_worst": mem[-1] if mem else None}


# A pair differs in its layout only (degrees, schedule, the sequence cp makes possible): same run otherwise.
_SAME = ("source", "table", "model", "gpus", "precision", "compile", "async_tp", "recompute", "fp8_all_gather",
         "fp8_tp_all_gather", "compile_loss", "fp8_recipe", "fp8_include", "fp8_exclude")
_LAYOUT = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "schedule", "micro_batch", "seq_len")


def _pairs(entries: list[dict]) -> dict:
    right, pairs = 0, []
    for i, x in enumerate(entries):
        for y in entries[i + 1:]:
            same = all(x["row"].get(k) == y["row"].get(k) for k in _SAME) and \
                any(x["row"][k] != y["row"][k] for k in _LAYOUT)
            tx, ty = x["tokens_per_s_per_gpu"], y["tokens_per_s_per_gpu"]
            if not same or not tx or not ty or abs(tx / ty - 1) <= 0.05:
                continue
            ok = (tx > ty) == (x["predicted_tokens"] > y["predicted_tokens"])
            right += ok
            pairs.append({"faster": x["key"] if tx > ty else y["key"], "slower": y["key"] if tx > ty else x["key"],
                          "ranked_right": ok})
    return {"count": len(pairs), "ranked_right": right, "share": right / len(pairs) if pairs else None, "pairs": pairs}
