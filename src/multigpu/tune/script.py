"""``multigpu tune script.py``: the fastest layout of a script that follows the layout contract, measured.

The script's model is its own, so tune does not predict it: it measures. Every ``Layout`` of N ranks
(``space.layouts``: the mesh's factorings, the micro-batches asked for, the schedules) runs the script
through the launcher for ``--steps`` steps with the layout's flags (round 1, the probe); a layout the
script refuses (heads TP does not divide, a batch that does not split, a model a pipeline cannot cut)
is left out with the script's own line (its ``UsageError``'s message, from the workers' failure
records); a layout that runs out of memory is tried again at once with ``--activation-checkpointing``
(where memory does not bind, checkpointing only adds recomputation); the ``--top`` K fastest run again
in the ``--repeats`` - 1 further rounds, interleaved (A B C A B C). The step time is the script's
``mg.StepMeter``'s (total time / steps over the measured intervals; its first interval is the warm-up), the
memory the largest rank's real peak in a step of that warm-up (``MULTIGPU_MEMORY_STEP``: the meter's
``MemoryStep``); a
run that recorded fewer steps than asked, or none after the warm-up, is left out with that line
(``study.measure.thin_evidence``).
The winner is the fastest median. The rounds, the launch, the summary and the report's files are the
recipe's tune's (``rounds.py``). Contract: docs/your-model.md.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..parallel.flags import refuse_fixed
from ..runtime.contract import MEMORY_STEP_ENV
from ..report.page import Heading, Items, Page, Table, Text
from . import rounds


def is_script(workload: str) -> bool:
    return workload.endswith(".py") or os.sep in workload


def check_script_args(cfg) -> None:
    """The refusals that need no torch, for a script."""
    if not os.path.isfile(cfg.workload):
        raise UsageError(f"tune knows the layouts of the GPT recipe (`multigpu tune gpt [its flags]`) and of a script "
                         f"that reads them with mg.layout_from_args() (docs/your-model.md), got {cfg.workload!r}: "
                         "no such file; give the script's path")
    refuse_fixed(cfg.args, "tune chooses", "(pass the script's own flags: --global-batch, ...)", extra=("--steps",))
    if cfg.memory_budget is not None:
        raise UsageError("--memory-budget prunes the recipe's predicted memory; a script's layouts are measured (one "
                         "that runs out of memory fails and is left out): drop --memory-budget")


def _measure(layout, cfg, root: Path, round_: int) -> dict:
    from ..study.measure import measure_run

    where = root / "runs" / f"{rounds.slug(layout.label)}-r{round_}"
    done, failed = rounds.launch(cfg.workload, [*cfg.args, *layout.flags, "--steps", str(cfg.steps)],
                                 module=False, cfg=cfg, where=where, env={MEMORY_STEP_ENV: "1"})
    if failed is not None:  # the script's own refusal (its UsageError's message) is the reason
        return failed
    try:
        measured = measure_run(done.run_dir, None, cfg.steps)
    except UsageError as err:
        return {"status": "failed", "exit_code": 0, "error": f"unreadable results: {err}", "wall_s": done.elapsed_s}
    if measured["thin"]:  # too short to time: no evidence for the fastest layout
        return {"status": "failed", "exit_code": 0, "error": f"too short to judge: {measured['thin']}",
                "wall_s": done.elapsed_s}
    peak = measured["step_peak_bytes"]  # a warm-up step's real peak, the largest rank's (its StepMeter's)
    return {"status": "ok", "step_time_s": measured["step_time_s"], "wall_s": done.elapsed_s} | (
        {"memory_bytes": peak} if peak is not None else {})


def _row(layout) -> dict:
    return {"candidate": layout.label, "args": layout.flags, "measured": [], "_l": layout}


def with_checkpointing(row: dict, m: dict) -> dict | None:
    """Where activation checkpointing matters: a layout that ran out of memory without it is tried with it
    (it trades recomputation for memory, so where memory does not bind it only costs time)."""
    layout = row["_l"]
    if layout.activation_checkpointing or not rounds.out_of_memory(m):
        return None
    return _row(replace(layout, activation_checkpointing=True))


def run_script_tune(cfg, say: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Tune a script; returns the results directory and the report dict (also in tune.json)."""
    from .space import layouts

    check_script_args(cfg)
    t_start = time.perf_counter()
    cfg, _ = rounds.device_of(cfg)
    found = layouts(cfg.nproc, micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None,
                    experts=cfg.experts, context=cfg.context)
    out = rounds.out_dir(cfg)
    say(f"multigpu tune: {cfg.workload} on {cfg.nproc} {'CPU workers' if cfg.cpu else 'GPUs'}: {len(found)} layouts, "
        f"each measured for {cfg.steps} steps (with activation checkpointing where one runs out of memory without), "
        f"then {f'the {cfg.top} fastest' if cfg.top else 'every one'} in {cfg.repeats - 1} more round(s) -> {out}")
    rows = [_row(layout) for layout in found]

    def pick(round_: int) -> list[dict]:
        if round_ == 0:
            return rows
        ok = sorted((r for r in rows if r["measured"][0]["status"] == "ok"),
                    key=lambda r: r["measured"][0]["step_time_s"])
        return ok if cfg.top == 0 else ok[:cfg.top]  # the fastest of the first round, again, interleaved

    def show(r: dict, m: dict) -> str:
        if m["status"] != "ok":
            return f"left out: {m['error']}"
        mem = f", {m['memory_bytes'] / 2**20:,.1f} MiB" if "memory_bytes" in m else ""
        return f"{m['step_time_s'] * 1e3:,.1f} ms/step{mem}"

    rounds.measure_rounds(rows, cfg.repeats, pick, lambda r, i: _measure(r["_l"], cfg, out, i), show, say,
                          retry=with_checkpointing)
    report = _report(cfg, rows, time.perf_counter() - t_start)
    rounds.write_report(report, _page(report), out, say)
    return out, report


def _report(cfg, rows: list[dict], wall_s: float) -> dict:
    for r in rows:
        r.pop("_l", None)
        r["result"] = rounds.summary(r["measured"])
    ran = sorted((r for r in rows if r["result"]), key=lambda r: r["result"]["step_time_s"])
    left_out = [{"layout": r["candidate"], "reason": r["measured"][0]["error"]} for r in rows if not r["result"]]
    winner = ran[0] if ran else None
    base = f"multigpu run -n {cfg.nproc}{' --cpu' if cfg.cpu else ''} {cfg.workload} {' '.join(cfg.args)}".rstrip()
    if winner:
        cmd = f"{base} {' '.join(winner['args'])}".rstrip()
        verdict = (f"multigpu tune: fastest measured: {winner['candidate']}: {winner['result']['step_time_s'] * 1e3:,.1f} "
                   f"ms/step (median of {winner['result']['runs']}); run it with: {cmd}")
    else:
        first = f" ({left_out[0]['layout']}: {left_out[0]['reason']})" if left_out else ""
        cmd, verdict = None, f"multigpu tune: no layout was measured{first}; every reason is in the report"
    return {"workload": cfg.workload, "world_size": cfg.nproc, "device": "cpu" if cfg.cpu else "cuda",
            "threads_per_worker": cfg.threads if cfg.cpu else None, "steps": cfg.steps, "repeats": cfg.repeats,
            "top": cfg.top, "candidates": ran + [r for r in rows if not r["result"]], "left_out": left_out,
            "winner": winner["candidate"] if winner else None, "command": cmd, "verdict": verdict, "wall_s": wall_s}


def _page(report: dict) -> Page:
    def cells(r: dict) -> list[str]:
        res = r["result"]
        mem = f"{res['memory_bytes'] / 2**20:,.1f}" if "memory_bytes" in res else "-"
        return [r["candidate"], f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})",
                mem, str(res["runs"]), " ".join(r["args"]) or "(none)"]

    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"Every layout of {report['world_size']} ranks ran the script for {report['steps']} steps; the "
                         f"fastest again in {report['repeats'] - 1} more round(s). Step time: the script's StepMeter; peak "
                         "memory: the largest rank's in a warm-up step (its StepMeter's MemoryStep). "
                         f"Tune took {report['wall_s']:.0f} s."),
                    Table(["layout", "measured ms/step (min-max)", "peak MiB", "runs", "flags"],
                          [cells(r) for r in report["candidates"] if r["result"]])]
    if report["left_out"]:
        blocks += [Heading("Left out (the script's own refusal or failure)"),
                   Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
