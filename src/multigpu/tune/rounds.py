"""The pieces of tune's one path (``run.py``) that stand alone.

What tune runs (``Workload``: the recipe's and a script's differences, as data), a candidate's row, the
device and its check, the results directory, one launch of a layout through the launcher and why it
failed (the workers' own failure records first: a script's refusal is its ``UsageError``'s message, not a
console line), the interleaved rounds (A B C A B C), the summary of a layout's runs, a run directory's
name, and the report's files.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..parallel.layout import Layout


def device_of(cfg):
    """(cfg, "cpu" | "cuda"): CPU workers when asked or when no GPU is visible (``cfg.cpu`` then set);
    more ranks than visible GPUs is refused in one line."""
    import torch

    device = "cpu" if cfg.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise UsageError(f"-n {cfg.nproc} is more than the {torch.cuda.device_count()} visible GPUs; use -n "
                         f"{torch.cuda.device_count()} or fewer, or --cpu")
    return (replace(cfg, cpu=True) if device == "cpu" and not cfg.cpu else cfg), device


def out_dir(cfg) -> Path:
    out = Path(cfg.out or f"studies/tune-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def slug(label: str) -> str:
    """A run directory's name from a layout's label: ``HSDP 2x2, micro-batch 4`` -> ``hsdp-2x2-micro-batch-4``."""
    return "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-").replace("--", "-")


@dataclass
class Workload:
    """What tune runs and what it knows of it: the differences between the recipe and a script, as data."""

    name: str  # the report's "workload": "gpt tiny", or the script's path
    target: str  # what the launcher runs: the recipe's module, or the script
    module: bool
    found: list[Layout]  # the candidates
    left_out: list[dict]  # layouts that are no candidate, with the workload's reason (space.candidates)
    flags: tuple[str, ...] = ()  # launch flags tune adds beside the layout's and --steps
    counts: object = None  # forecast's count of the model (forecast.counts.Counts): predicted where given
    subject: object = None  # the model the probes time (wrappers.Subject)
    global_batch: int | None = None
    retry: Callable[[dict, dict], dict | None] | None = None  # measured alone: a run out of memory tried again


def row(layout) -> dict:
    """A candidate's row of the report (``_l``: its Layout, dropped when the report is written)."""
    return {"candidate": layout.label, "args": layout.flags, "measured": [], "pruned": None, "predicted": None,
            "_l": layout}


def first_failure(run_dir: Path | None, nproc: int) -> dict | None:
    """The earliest failure record a worker left (``runtime.contract``: type, message, time) in the run's
    last attempt, a ``UsageError`` before any other (the refusal is the cause; a peer's lost connection
    its symptom); None when no worker left one."""
    from ..runtime.contract import read_failure

    if run_dir is None:
        return None
    attempts = sorted((p for p in Path(run_dir).glob("attempt_*") if p.name.split("_")[-1].isdigit()),
                      key=lambda p: int(p.name.split("_")[-1]))
    if not attempts:
        return None
    records = [r for r in (read_failure(str(attempts[-1]), rank) for rank in range(nproc)) if r]
    if not records:
        return None
    return min(records, key=lambda r: (r.get("type") != "UsageError", r.get("time", 0.0)))


def launch(target: str, argv: list[str], *, module: bool, cfg, where: Path, env: dict | None = None):
    """Run one layout (``env``: more variables for the workers): (the launch, None) when it ran to the end, else
    (the launch, its failure for the report: the launcher's refusal, a worker's UsageError, else the launcher's
    summary line)."""
    from ..launch.once import run_once

    done = run_once(target, argv, module=module, log_dir=where, nproc=cfg.nproc, cpu=cfg.cpu,
                    env={"OMP_NUM_THREADS": str(cfg.threads) if cfg.cpu else None, **(env or {})})
    if done.refusal is not None:
        return done, {"status": "failed", "error": str(done.refusal)}
    if done.exit_code != 0 or done.run_dir is None:
        record = first_failure(done.run_dir, cfg.nproc)
        refused = record["message"] if record and record.get("type") == "UsageError" else None
        why = refused or done.failure() or "no output"
        out = {"status": "failed", "exit_code": done.exit_code, "error": why[:400], "wall_s": done.elapsed_s}
        if record and not refused:
            out["error_type"] = record.get("type")
        return done, out
    return done, None


def out_of_memory(m: dict) -> bool:
    """Did a run fail by running out of memory (CUDA's OutOfMemoryError, or killed by the kernel's OOM killer)?"""
    return m["status"] != "ok" and (m.get("error_type") == "OutOfMemoryError" or "out of memory" in m["error"].lower()
                                    or m.get("exit_code") == 137)


def measure_rounds(rows: list[dict], repeats: int, pick: Callable[[int], list[dict]],
                   measure: Callable[[dict, int], dict], show: Callable[[dict, dict], str], say: Callable[[str], None],
                   retry: Callable[[dict, dict], dict | None] | None = None) -> None:
    """``repeats`` interleaved rounds: in each, every row ``pick(round)`` names is measured in turn (A B C A
    B C), its measurement appended to ``row["measured"]`` and shown as ``[round.i] label: show(...)``. In
    the first round ``retry(row, measurement)`` may give a new row (added to ``rows``) to measure next."""
    for round_ in range(repeats):
        chosen = list(pick(round_))
        i = 0
        while i < len(chosen):
            r = chosen[i]
            m = measure(r, round_)
            r["measured"].append(m)
            say(f"[{round_ + 1}.{i + 1}] {r['candidate']}: {show(r, m)}")
            again = retry(r, m) if retry is not None and round_ == 0 else None
            if again is not None:
                rows.append(again)
                chosen.insert(i + 1, again)
            i += 1


def summary(ms: list[dict]) -> dict | None:
    """A layout's runs: the median step time (and min, max, how many ran), the largest memory if counted."""
    ok = [m for m in ms if m["status"] == "ok"]
    if not ok:
        return None
    steps = [m["step_time_s"] for m in ok]
    out = {"step_time_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps), "runs": len(ok)}
    if all("memory_bytes" in m for m in ok):
        out["memory_bytes"] = max(m["memory_bytes"] for m in ok)
    return out


def errors(rows: list[dict]) -> dict:
    """The prediction's error over the measured rows (each row's ``error``: predicted / measured - 1): median
    and worst absolute, step time and memory (None where none was measured)."""
    def of(kind):
        return sorted(abs(r["error"][kind]) for r in rows if r.get("error") and kind in r["error"])

    steps, mems = of("step_time"), of("memory")
    return {"step_time_median": statistics.median(steps) if steps else None, "step_time_worst": max(steps, default=None),
            "memory_median": statistics.median(mems) if mems else None, "memory_worst": max(mems, default=None)}


def error_line(e: dict) -> str:
    """``errors``' summary as the reports say it."""
    if e["step_time_median"] is None:
        return "No candidate was measured."
    mem = (f"; memory median {e['memory_median']:.0%}, worst {e['memory_worst']:.0%}" if e["memory_median"] is not None
           else "")
    return (f"Prediction error over the measured candidates: step time median {e['step_time_median']:.0%}, worst "
            f"{e['step_time_worst']:.0%}{mem}.")


def write_report(report: dict, page, out: Path, say: Callable[[str], None]) -> None:
    from ..report.page import write

    (out / "tune.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write(page, out / "report.md", out / "report.html")
    say(report["verdict"])
    say(f"multigpu tune: report {out / 'report.html'} (and report.md); data {out / 'tune.json'}")
