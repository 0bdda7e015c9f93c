"""``multigpu tune script.py``: the fastest layout of a script that follows the layout contract, measured.

The script's model is its own, so tune does not predict it: it measures. Every ``Layout`` of N ranks
(``space.layouts``: the mesh's factorings, the micro-batches asked for, the schedules) runs the script
through the launcher for ``--steps`` steps with the layout's flags (round 1, the probe); a layout the
script refuses (heads TP does not divide, a batch that does not split, a model a pipeline cannot cut)
is left out with the script's own line; the ``--top`` K fastest run again in the ``--repeats`` - 1
further rounds, interleaved (A B C A B C). The step time is the script's ``mg.StepMeter``'s (total time
/ steps over the measured intervals; its first interval is the warm-up). The winner is the fastest
median. Contract: docs/your-model.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..parallel.flags import FLAGS, describe, layout_flags
from ..report.page import Heading, Items, Page, Table, Text, write

SCRIPT_FLAGS = (*FLAGS, "--steps")  # tune sets them; the user's command line may not


def is_script(workload: str) -> bool:
    return workload.endswith(".py") or os.sep in workload


def check_script_args(cfg) -> None:
    """The refusals that need no torch, for a script."""
    if not os.path.isfile(cfg.workload):
        raise UsageError(f"tune knows the layouts of the GPT recipe (`multigpu tune gpt [its flags]`) and of a script "
                         f"that reads them with mg.layout_from_args() (docs/your-model.md), got {cfg.workload!r}: "
                         "no such file; give the script's path")
    fixed = sorted({a.split("=")[0] for a in cfg.args if a.split("=")[0] in SCRIPT_FLAGS})
    if fixed:
        raise UsageError(f"tune chooses {', '.join(fixed)} itself; drop them (pass the script's own flags: "
                         "--global-batch, ...)")
    if cfg.memory_budget is not None:
        raise UsageError("--memory-budget prunes the recipe's predicted memory; a script's layouts are measured (one "
                         "that runs out of memory fails and is left out): drop --memory-budget")


def _measure(layout, cfg, root: Path, round_: int) -> dict:
    from ..launch.once import run_once
    from ..study.measure import measure_run

    where = root / "runs" / f"{_slug(layout)}-r{round_}"
    done = run_once(cfg.workload, [*cfg.args, *layout_flags(layout), "--steps", str(cfg.steps)], module=False,
                    log_dir=where, nproc=cfg.nproc, cpu=cfg.cpu,
                    env={"OMP_NUM_THREADS": str(cfg.threads) if cfg.cpu else None})
    if done.refusal is not None:
        return {"status": "failed", "error": str(done.refusal)}
    if done.exit_code != 0 or done.run_dir is None:
        why = done.failure() or "no output"
        # The script's own refusal (its UsageError line) is the reason; the launcher's frame around it is not.
        refused = re.search(r"multigpu: error: (.*?);? *(?:; also failed:.*)?$", why)
        return {"status": "failed", "exit_code": done.exit_code, "error": (refused.group(1) if refused else why)[:400],
                "wall_s": done.elapsed_s}
    try:
        step = measure_run(done.run_dir, None)["step_time_s"]
    except UsageError as err:
        return {"status": "failed", "exit_code": 0, "error": f"unreadable results: {err}", "wall_s": done.elapsed_s}
    if not step:
        return {"status": "failed", "exit_code": 0, "wall_s": done.elapsed_s,
                "error": f"the script's StepMeter measured no interval after its warm-up in {cfg.steps} steps: "
                         "pass --steps more than twice its log_every"}
    return {"status": "ok", "step_time_s": step, "wall_s": done.elapsed_s}


def _slug(layout) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in describe(layout))


def _summary(ms: list[dict]) -> dict | None:
    steps = [m["step_time_s"] for m in ms if m["status"] == "ok"]
    return {"step_time_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps),
            "runs": len(steps)} if steps else None


def run_script_tune(cfg, say: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Tune a script; returns the results directory and the report dict (also in tune.json)."""
    import torch

    from .space import layouts

    check_script_args(cfg)
    t_start = time.perf_counter()
    device = "cpu" if cfg.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise UsageError(f"-n {cfg.nproc} is more than the {torch.cuda.device_count()} visible GPUs; use -n "
                         f"{torch.cuda.device_count()} or fewer, or --cpu")
    cpu = cfg.cpu or device == "cpu"
    cfg = replace(cfg, cpu=cpu)
    found = layouts(cfg.nproc, micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None)
    out = Path(cfg.out or f"studies/tune-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say(f"multigpu tune: {cfg.workload} on {cfg.nproc} {'CPU workers' if cpu else 'GPUs'}: {len(found)} layouts, each "
        f"measured for {cfg.steps} steps, then {f'the {cfg.top} fastest' if cfg.top else 'every one'} in "
        f"{cfg.repeats - 1} more round(s) -> {out}")
    rows = [{"candidate": describe(layout), "args": layout_flags(layout), "measured": [], "_l": layout}
            for layout in found]
    for round_ in range(cfg.repeats):
        if round_ == 0:
            chosen = rows
        else:  # the fastest of the first round, again, interleaved
            ok = sorted((r for r in rows if r["measured"][0]["status"] == "ok"),
                        key=lambda r: r["measured"][0]["step_time_s"])
            chosen = ok if cfg.top == 0 else ok[:cfg.top]
        for i, r in enumerate(chosen):
            m = _measure(r["_l"], cfg, out, round_)
            r["measured"].append(m)
            shown = f"{m['step_time_s'] * 1e3:,.1f} ms/step" if m["status"] == "ok" else f"left out: {m['error']}"
            say(f"[{round_ + 1}.{i + 1}] {r['candidate']}: {shown}")
    report = _report(cfg, rows, time.perf_counter() - t_start)
    (out / "tune.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write(_page(report), out / "report.md", out / "report.html")
    say(report["verdict"])
    say(f"multigpu tune: report {out / 'report.html'} (and report.md); data {out / 'tune.json'}")
    return out, report


def _report(cfg, rows: list[dict], wall_s: float) -> dict:
    for r in rows:
        r.pop("_l", None)
        r["result"] = _summary(r["measured"])
    ran = sorted((r for r in rows if r["result"]), key=lambda r: r["result"]["step_time_s"])
    left_out = [{"layout": r["candidate"], "reason": r["measured"][0]["error"]} for r in rows if not r["result"]]
    winner = ran[0] if ran else None
    base = f"multigpu run -n {cfg.nproc}{' --cpu' if cfg.cpu else ''} {cfg.workload} {' '.join(cfg.args)}".rstrip()
    if winner:
        cmd = f"{base} {' '.join(winner['args'])}".rstrip()
        verdict = (f"multigpu tune: fastest measured: {winner['candidate']}: {winner['result']['step_time_s'] * 1e3:,.1f} "
                   f"ms/step (median of {winner['result']['runs']}); run it with: {cmd}")
    else:
        cmd, verdict = None, "multigpu tune: no layout ran to the end; see the reasons in the report"
    return {"workload": cfg.workload, "world_size": cfg.nproc, "device": "cpu" if cfg.cpu else "cuda",
            "threads_per_worker": cfg.threads if cfg.cpu else None, "steps": cfg.steps, "repeats": cfg.repeats,
            "top": cfg.top, "candidates": ran + [r for r in rows if not r["result"]], "left_out": left_out,
            "winner": winner["candidate"] if winner else None, "command": cmd, "verdict": verdict, "wall_s": wall_s}


def _page(report: dict) -> Page:
    def cells(r: dict) -> list[str]:
        res = r["result"]
        return [r["candidate"], f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})",
                str(res["runs"]), " ".join(r["args"]) or "(none)"]

    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"Every layout of {report['world_size']} ranks ran the script for {report['steps']} steps; the "
                         f"fastest again in {report['repeats'] - 1} more round(s). Step time: the script's StepMeter. "
                         f"Tune took {report['wall_s']:.0f} s."),
                    Table(["layout", "measured ms/step (min-max)", "runs", "flags"],
                          [cells(r) for r in report["candidates"] if r["result"]])]
    if report["left_out"]:
        blocks += [Heading("Left out (the script's own refusal or failure)"),
                   Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
