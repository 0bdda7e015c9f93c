"""`multigpu study`: run one workload at several world sizes and batch policies, measure, judge.

Every run goes through ``multigpu run`` (the launcher's Python API) with the
step meter on and a short profiler window; the study reads back each run's
``metrics.jsonl`` and profile summary, groups the runs by (workers, policy),
derives speedup, efficiency, time breakdown, accuracy, time to target and the
noise scale, and writes one results directory:

    <out>/study.json          the summary (schema below, read by `multigpu report`)
    <out>/fingerprint.json    the environment
    <out>/runs/<run id>/...   every run's launcher folder: metrics.jsonl, logs, profile

Batch policies: ``keep-global`` keeps the global batch (each worker gets a
smaller share); ``scale-global`` keeps the per-worker batch (the global batch
grows with the workers; the workload scales its LR from ``--global-batch``).
Both see the same number of samples: with ``--steps``, scale-global runs
``steps / workers`` steps.

The contract for a workload (built-in recipe or user script): it uses
``mg.StepMeter`` (which writes ``metrics.jsonl`` into the launcher's run
folder), accepts ``--global-batch N`` and, if ``--steps`` is given to the
study, ``--steps N``; it logs evaluation metrics with ``meter.log_eval(...)``
(``accuracy`` and/or ``loss``) and, optionally, ``noise/b_simple`` with
``meter.log(noise.metrics())``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import UsageError
from .verdict import findings, verdict

POLICIES = ("keep-global", "scale-global")
TARGET_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}


@dataclass(frozen=True)
class Recipe:
    """A built-in workload: its module, and the extra arguments a study passes to it."""

    module: str
    global_batch: int
    target: str | None = None
    args: tuple[str, ...] = ()
    noise_args: tuple[str, ...] = ()  # only for runs with >= 2 workers (the estimator needs ranks)


RECIPES = {
    "digits": Recipe("multigpu.recipes.digits", global_batch=64, target="accuracy>=0.95",
                     args=("--eval-every", "1"), noise_args=("--noise-every", "5")),
}


@dataclass(frozen=True)
class StudyConfig:
    """What to run. Field comments are the CLI's help."""

    workload: str
    args: tuple[str, ...] = ()
    workers: tuple[int, ...] = (1, 2)
    policies: tuple[str, ...] = ("keep-global",)
    repeats: int = 1
    steps: int | None = None
    global_batch: int | None = None
    target: str | None = None
    out: str | None = None
    cpu: bool = False
    profile: str | None = "20:25"


@dataclass(frozen=True)
class RunSpec:
    id: str
    workers: int
    policies: tuple[str, ...]
    repeat: int
    global_batch: int
    steps: int | None
    args: tuple[str, ...] = field(repr=False)


def resolve_workload(name: str) -> tuple[str, bool, str, Recipe | None]:
    """(launch target, is module, display name, recipe or None) for a recipe name, script path or module."""
    if name in RECIPES:
        return RECIPES[name].module, True, name, RECIPES[name]
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise UsageError(f"script {name!r} does not exist; pass a recipe ({', '.join(RECIPES)}), a script path or a module")
        return os.path.abspath(name), False, Path(name).stem, None
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPES)}, a script path (.py) or an importable module")
    return name, True, name.rsplit(".", 1)[-1], None


def parse_target(text: str | None) -> tuple[str, str, float] | None:
    """``"accuracy>=0.95"`` -> ("accuracy", ">=", 0.95)."""
    if not text:
        return None
    for op in TARGET_OPS:
        if op in text:
            metric, _, value = text.partition(op)
            try:
                return metric.strip(), op, float(value)
            except ValueError:
                break
    raise UsageError(f"--target must look like accuracy>=0.95 or loss<=0.1, got {text!r}")


def check(cfg: StudyConfig) -> None:
    if not cfg.workers or any(w < 1 for w in cfg.workers):
        raise UsageError(f"--workers must be positive integers, got {','.join(map(str, cfg.workers)) or 'nothing'}; use e.g. --workers 1,2,4")
    bad = [p for p in cfg.policies if p not in POLICIES]
    if bad or not cfg.policies:
        raise UsageError(f"unknown policy {','.join(bad) or '(none)'}; expected {' or '.join(POLICIES)}")
    if cfg.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {cfg.repeats}")
    if cfg.steps is not None and cfg.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise UsageError(f"--global-batch must be >= 1, got {cfg.global_batch}")
    parse_target(cfg.target)


def plan_runs(cfg: StudyConfig, recipe: Recipe | None) -> list[RunSpec]:
    """One spec per distinct (workers, global batch, steps, repeat): policies that coincide share a run."""
    base = cfg.global_batch or (recipe.global_batch if recipe else 64)
    runs: dict[tuple, RunSpec] = {}
    for w in sorted(set(cfg.workers)):
        for pol in cfg.policies:
            gb = base if pol == "keep-global" else base * w
            steps = cfg.steps if cfg.steps is None or pol == "keep-global" else max(1, math.ceil(cfg.steps / w))
            for rep in range(cfg.repeats):
                key = (w, gb, steps, rep)
                if key in runs:
                    runs[key] = RunSpec(**{**asdict(runs[key]), "policies": runs[key].policies + (pol,)})
                    continue
                args = list(cfg.args) + ["--global-batch", str(gb)] + (["--steps", str(steps)] if steps else [])
                if recipe:
                    args = list(recipe.args) + (list(recipe.noise_args) if w > 1 else []) + args
                runs[key] = RunSpec(f"w{w}-gb{gb}-r{rep}", w, (pol,), rep, gb, steps, tuple(args))
    return list(runs.values())


# --- reading one run back ---------------------------------------------------------

def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash; the rest still counts
    return out


def _reached(evals: list[dict], steps: list[dict], target: tuple[str, str, float] | None) -> dict | None:
    if target is None:
        return None
    metric, op, value = target
    for rec in evals + ([] if any(metric in e for e in evals) else steps):
        v = rec.get(metric)
        if v is not None and TARGET_OPS[op](v, value):
            return {"samples": rec.get("samples_seen"), "wall_s": rec.get("time")}
    return None


def measure_run(run_dir: Path, target: tuple[str, str, float] | None) -> dict[str, Any]:
    """The figures of one finished run, from its metrics.jsonl and profile summary."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl: the workload must use mg.StepMeter (see docs/study.md)")
    recs = _records(metrics)
    steps = [r for r in recs if r.get("type") == "step"]
    evals = [r for r in recs if r.get("type") == "eval"]
    summary = next((r for r in reversed(recs) if r.get("type") == "summary"), None)
    if summary is None:
        raise UsageError(f"{metrics} has no summary record: the run ended before meter.close()")
    out: dict[str, Any] = {
        "samples_per_s": (summary.get("samples_per_s") or {}).get("mean"),
        "step_time_s": (summary.get("step_time") or {}).get("mean"),
        "wall_s": summary.get("wall_time"),
        "samples_seen": summary.get("samples_seen"),
        "curve": {"samples": [r["samples_seen"] for r in steps if r.get("loss") is not None],
                  "loss": [r["loss"] for r in steps if r.get("loss") is not None],
                  "wall_s": [r["time"] for r in steps if r.get("loss") is not None]},
        "evals": [{k: e.get(k) for k in ("samples_seen", "time", "accuracy", "loss")} for e in evals],
        "final": {k: v for k, v in (evals[-1] if evals else {}).items() if k in ("accuracy", "loss")},
        "to_target": _reached(evals, steps, target),
    }
    noise = [r for r in steps if r.get("noise/b_simple") is not None]
    out["noise"] = {"samples": [r["samples_seen"] for r in noise], "b_simple": [r["noise/b_simple"] for r in noise]}
    out["noise_scale"] = noise[-1]["noise/b_simple"] if noise else None
    out["breakdown"] = breakdown(summary.get("fractions") or {}, run_dir / "profile" / "summary.json")
    return out


def breakdown(fractions: dict[str, float], profile_summary: Path) -> dict[str, Any]:
    """Fractions of step time: compute, exposed communication, data wait, idle.

    Data wait comes from the meter (every unprofiled step; the profiler slows
    the Python loader and would overstate it). The rest of the step, which the
    meter cannot split, is divided in the proportions the profiler measured
    over its window: compute (with communication it overlaps), exposed
    communication, and idle. Without a profile, exposed communication is unknown.
    """
    wait = fractions.get("data_wait")
    rest = (fractions.get("compute") or 0.0) + (fractions.get("other") or 0.0)
    if not profile_summary.is_file():
        return {"compute": fractions.get("compute"), "comm_exposed": None, "data_wait": wait,
                "idle": fractions.get("other"), "source": "meter"}
    ranks = json.loads(profile_summary.read_text())
    parts = {"compute": ("compute", "overlapped_comm"), "comm_exposed": ("exposed_comm",), "idle": ("idle",)}
    share = {k: statistics.fmean(sum(r[p] for p in ps) for r in ranks) for k, ps in parts.items()}
    total = sum(share.values()) or 1.0
    return {k: rest * v / total for k, v in share.items()} | {"data_wait": wait, "source": "meter+profiler"}


# --- grouping and judging ---------------------------------------------------------

def _stat(values: Iterable[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def summarize(runs: list[dict[str, Any]], workers: Iterable[int], policies: Iterable[str]) -> list[dict[str, Any]]:
    """One group per (workers, policy): means and spreads over repeats, speedup, efficiency, verdict."""
    groups = []
    for pol in policies:
        for w in sorted(set(workers)):
            mine = [r for r in runs if r["workers"] == w and pol in r["policies"]]
            ok = [r for r in mine if r["status"] == "ok"]
            g: dict[str, Any] = {
                "workers": w, "policy": pol, "global_batch": mine[0]["global_batch"] if mine else None,
                "n_ok": len(ok), "n_failed": len(mine) - len(ok),
                "errors": [r["error"] for r in mine if r["status"] != "ok"],
                "samples_per_s": _stat(r["samples_per_s"] for r in ok),
                "step_time_s": _stat(r["step_time_s"] for r in ok),
                "accuracy": _stat(r["final"].get("accuracy") for r in ok),
                "loss": _stat(r["final"].get("loss") for r in ok),
                "to_target_s": _stat((r["to_target"] or {}).get("wall_s") for r in ok),
                "to_target_samples": _stat((r["to_target"] or {}).get("samples") for r in ok),
                "noise_scale": (_stat(r["noise_scale"] for r in ok) or {}).get("mean"),
                "breakdown": {k: (_stat(r["breakdown"].get(k) for r in ok) or {}).get("mean")
                              for k in ("compute", "comm_exposed", "data_wait", "idle")} if ok else {},
            }
            groups.append(g)
    for g in groups:
        base = next((b for b in groups if b["policy"] == g["policy"] and b["workers"] == 1), None)
        g["speedup"] = g["efficiency"] = None
        if base and g["workers"] > 1 and base["samples_per_s"] and g["samples_per_s"]:
            s, b = g["samples_per_s"], base["samples_per_s"]
            ratio = s["mean"] / b["mean"]
            rel = math.hypot(s["std"] / s["mean"], b["std"] / b["mean"])
            g["speedup"] = {"mean": ratio, "std": ratio * rel}
            g["efficiency"] = {"mean": ratio / g["workers"], "std": ratio * rel / g["workers"]}
        g["findings"] = [f.text for f in findings(g, base)]
        g["verdict"] = verdict(g, base)
    return groups


def headline(groups: list[dict[str, Any]]) -> str:
    parts, seen_baseline = [], False
    for g in groups:
        if g["workers"] == 1:
            if seen_baseline:
                continue  # every policy shares the 1-worker run
            seen_baseline = True
        acc = g["accuracy"]["mean"] if g.get("accuracy") else None
        label = "1 worker" if g["workers"] == 1 else f"{g['workers']} workers {g['policy']}"
        if g["n_ok"] == 0:
            parts.append(f"{label}: failed")
            continue
        speed = f"{g['speedup']['mean']:.2f}x, {100 * g['efficiency']['mean']:.0f} % efficiency" if g["speedup"] else \
            f"{g['samples_per_s']['mean']:,.0f} samples/s"
        parts.append(f"{label}: {speed}" + (f", accuracy {100 * acc:.2f} %" if acc is not None else ""))
    return "; ".join(parts)


# --- running ----------------------------------------------------------------------

def _out_dir(cfg: StudyConfig, name: str) -> Path:
    out = Path(cfg.out or os.path.join("studies", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"results directory {out} is not writable ({err.strerror}); pass --out to a writable directory") from None
    if (out / "study.json").exists():
        raise UsageError(f"{out} already holds a study.json; pass a new --out (or delete the old study)")
    return out


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    summary = [ln for ln in lines if ln.startswith("multigpu run:") or "error:" in ln]
    return (summary or lines or [""])[-1].strip()


def execute(spec: RunSpec, target: str, module: bool, cfg: StudyConfig, out: Path,
            goal: tuple[str, str, float] | None) -> dict[str, Any]:
    """Run one spec through the launcher, with its console output captured in a file."""
    from .launch import run as launch_run

    root = out / "runs" / spec.id
    root.mkdir(parents=True, exist_ok=True)
    console = root / "console.log"
    record: dict[str, Any] = {"id": spec.id, "workers": spec.workers, "policies": list(spec.policies),
                              "policy": spec.policies[0], "repeat": spec.repeat, "global_batch": spec.global_batch,
                              "steps": spec.steps, "args": list(spec.args)}
    t0 = time.perf_counter()
    try:
        with open(console, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            code = launch_run(target, spec.args, module=module, nproc=spec.workers, cpu=cfg.cpu,
                              log_dir=str(root), profile=cfg.profile)
    except UsageError as err:
        code, message = 2, str(err)
    else:
        message = _last_line(console)
    record["elapsed_s"] = time.perf_counter() - t0
    run_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    record["run_dir"] = str(run_dirs[-1]) if run_dirs else None
    if code != 0:
        return record | {"status": "failed", "exit_code": code,
                         "error": message or f"exit code {code}; see {console}"}
    try:
        return record | {"status": "ok", "exit_code": 0} | measure_run(run_dirs[-1], goal)
    except (UsageError, IndexError, KeyError, ValueError) as err:
        return record | {"status": "failed", "exit_code": 0, "error": f"unreadable metrics: {err}"}


def _eta(done: list[float], left: int) -> str:
    if not done:
        return "ETA unknown"
    s = statistics.fmean(done) * left
    return f"ETA {int(s // 60)}m{int(s % 60):02d}s"


def run_study(cfg: StudyConfig, say: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Run the study; returns the results directory and the study dict (also in study.json).

    >>> out, study = run_study(StudyConfig("digits", workers=(1, 2), policies=("keep-global",)))
    """
    check(cfg)
    target, module, name, recipe = resolve_workload(cfg.workload)
    goal = parse_target(cfg.target or (recipe.target if recipe else None))
    specs = plan_runs(cfg, recipe)
    out = _out_dir(cfg, name)
    from .fingerprint import fingerprint

    fp = fingerprint(workload=name)
    (out / "fingerprint.json").write_text(json.dumps(fp, indent=1, default=str))
    say(f"multigpu study: {name}, {len(specs)} runs ({', '.join(s.id for s in specs)}) -> {out}")
    runs, durations = [], []
    for i, spec in enumerate(specs, 1):
        say(f"[{i}/{len(specs)}] {spec.workers} worker{'s' if spec.workers > 1 else ''}, "
            f"{'/'.join(spec.policies)}, global batch {spec.global_batch}"
            + (f", repeat {spec.repeat + 1}/{cfg.repeats}" if cfg.repeats > 1 else "") + f" ... {_eta(durations, len(specs) - i + 1)}")
        rec = execute(spec, target, module, cfg, out, goal)
        durations.append(rec["elapsed_s"])
        runs.append(rec)
        if rec["status"] == "ok":
            acc = rec["final"].get("accuracy")
            say(f"      done in {rec['elapsed_s']:.0f} s: {rec['samples_per_s'] or 0:,.0f} samples/s"
                + (f", accuracy {100 * acc:.2f} %" if acc is not None else ""))
        else:
            say(f"      FAILED in {rec['elapsed_s']:.0f} s: {rec['error']} (the study goes on)")
    groups = summarize(runs, cfg.workers, cfg.policies)
    study = {"schema": 1, "workload": {"name": name, "target": target, "module": module, "args": list(cfg.args)},
             "config": asdict(cfg) | {"target": cfg.target or (recipe.target if recipe else None)},
             "fingerprint": fp, "headline": headline(groups), "groups": groups, "runs": runs}
    (out / "study.json").write_text(json.dumps(study, indent=1, default=str))
    return out, study


# --- CLI --------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--workers must be a comma-separated list of integers, got {text!r}; use e.g. --workers 1,2,4") from None


def default_workers() -> str:
    """1, 2, 4, ... up to the visible GPUs; 1,2 on a machine without GPUs."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return "1,2"
    ws, w = [], 1
    while w < n:
        ws.append(w)
        w *= 2
    return ",".join(map(str, ws + [n]))


def add_study_arguments(parser) -> None:
    import argparse

    parser.add_argument("--workers", default=None, help="world sizes to run, e.g. 1,2,4 (default: 1,2,4.. up to the GPUs; 1,2 on CPU)")
    parser.add_argument("--policy", default="keep-global", help="batch policies, comma-separated: keep-global, scale-global")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting, for mean and spread")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (passed as --steps; default: the workload's own)")
    parser.add_argument("--global-batch", type=int, default=None, help="global batch at 1 worker (passed as --global-batch)")
    parser.add_argument("--target", default=None, help="e.g. accuracy>=0.95 or loss<=0.1: time and samples to reach it")
    parser.add_argument("--out", default=None, help="results directory (default: studies/<workload>-<time>)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes (gloo) even where GPUs exist")
    parser.add_argument("--profile", default="20:25", help="profiled steps for the time breakdown, or 'off'")
    parser.add_argument("--no-report", action="store_true", help="skip writing report.html / report.md")
    parser.add_argument("workload", help=f"a recipe ({', '.join(RECIPES)}), a script path or a module")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the workload")


def main(args) -> int:
    cfg = StudyConfig(
        workload=args.workload, args=tuple(args.args), workers=_ints(args.workers or default_workers()),
        policies=tuple(p.strip() for p in args.policy.split(",") if p.strip()), repeats=args.repeats,
        steps=args.steps, global_batch=args.global_batch, target=args.target, out=args.out, cpu=args.cpu,
        profile=None if args.profile in ("off", "none", "") else args.profile,
    )
    out, study = run_study(cfg, say=lambda s: print(s, flush=True))
    print(f"multigpu study: {study['headline']}")
    for g in study["groups"]:
        if g["workers"] > 1:
            print(f"  {g['workers']} workers {g['policy']}: {g['verdict']}")
    if not args.no_report:
        from .report import write_report

        html_path, md_path = write_report(out)
        print(f"multigpu study: report {html_path} (and {md_path.name}); data {out / 'study.json'}")
    failed = sum(g["n_failed"] for g in study["groups"])
    return 1 if failed and all(g["n_ok"] == 0 for g in study["groups"]) else 0
