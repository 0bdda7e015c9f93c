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

import importlib.util
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..batch import POLICIES, check_splits, policy_batch, same_samples_steps
from ..errors import UsageError
from ..meter.evidence import steps_asked
from .measure import TARGET_OPS, headline, measure_run, summarize


@dataclass(frozen=True)
class Recipe:
    """A built-in workload: its module, and the extra arguments a study passes to it."""

    module: str
    global_batch: int
    target: str | None = None
    args: tuple[str, ...] = ()
    noise_args: tuple[str, ...] = ()  # only for runs with >= 2 workers (the estimator needs ranks)
    replicate: bool = False  # DDP at every world size: W workers run --dp-replicate W (a layout that only replicates)


RECIPES = {
    "digits": Recipe("multigpu.recipes.digits", global_batch=64, target="accuracy>=0.95",
                     args=("--eval-every", "1"), noise_args=("--noise-every", "5")),
    # Byte-level tiny GPT on Python's docs: held-out loss 4.2 nats/byte (6.1 bits) after ~20 steps at batch 16.
    "gpt": Recipe("multigpu.recipes.gpt", global_batch=16, target="loss<=4.2", args=("--steps", "60", "--eval-every", "10")),
    # The demo's compute-bound case: DDP (one bucketed all-reduce per step) and micro-batches of 64 sequences at
    # every world size, so 1 and 2 workers do the same work per forward and only the hardware differs.
    "gpt-ddp": Recipe("multigpu.recipes.gpt", global_batch=512,
                      args=("--micro-batch", "64", "--steps", "16", "--log-every", "4", "--eval-every", "16"), replicate=True),
}


@dataclass(frozen=True)
class StudyConfig:
    """What to run. Each field's docstring is its flag's help in `multigpu study --help` (study/cli.py)."""

    workload: str
    args: tuple[str, ...] = ()
    workers: tuple[int, ...] = (1, 2)
    """world sizes to run, e.g. 1,2,4 (default: 1,2,4.. up to the GPUs; 1,2 on CPU)"""
    policies: tuple[str, ...] = ("keep-global",)
    """batch policies, comma-separated: keep-global, scale-global"""
    repeats: int = 1
    """rounds of interleaved runs (1, 2, 1, 2, ...); 2 or more give a 95 % interval"""
    steps: int | None = None
    """optimizer steps per run (passed as --steps; default: the workload's own)"""
    global_batch: int | None = None
    """global batch at 1 worker (passed as --global-batch)"""
    target: str | None = None
    """e.g. accuracy>=0.95 or loss<=0.1: time and samples to reach it"""
    out: str | None = None
    """results directory (default: studies/<workload>-<time>)"""
    cpu: bool = False
    """run on CPU processes (gloo) even where GPUs exist"""
    profile: str | None = "20:25"
    """profiled steps for the time breakdown, or 'off'"""
    ci: float | None = None
    """keep adding rounds until every speedup's 95 % interval is within +-FRAC (e.g. 0.1)"""
    budget_s: float = 600.0
    """with --ci: start no round after S seconds (default %(default)g)"""
    max_repeats: int = 10
    """with --ci: at most this many rounds (default %(default)s)"""
    threads: int = 1
    """CPU threads per worker on CPU runs, the same at every world size (default %(default)s: a worker stands for a device)"""
    layouts: str | None = None
    """layouts to study instead of --workers, e.g. "dp_shard=2;tp=2;pp=2" (each on the ranks it spans, against one worker; the script reads them with mg.layout_from_args)"""


@dataclass(frozen=True)
class RunSpec:
    id: str
    workers: int
    policies: tuple[str, ...]
    repeat: int
    global_batch: int
    steps: int | None
    args: tuple[str, ...] = field(repr=False)
    layout: str = ""  # the layout as --layouts spells it; "" for a plain world size (and the 1-worker baseline)


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


def series(cfg: StudyConfig) -> list[tuple[int, str, int, list[str]]]:
    """(workers, layout label, data-parallel ranks, the script's layout flags) of every group: the world
    sizes, or with ``layouts`` one worker and then each layout on the processes it spans."""
    if cfg.layouts is None:
        return [(w, "", w, []) for w in sorted(set(cfg.workers))]
    from ..parallel.flags import distinct, parse_layouts

    layouts = distinct(parse_layouts(cfg.layouts), cfg.layouts)
    return [(1, "", 1, [])] + [(layout.world_size, layout.label, layout.dp_size, layout.flags) for layout in layouts]


def check(cfg: StudyConfig) -> None:
    if not cfg.workers or any(w < 1 for w in cfg.workers):
        raise UsageError(f"--workers must be positive integers, got {','.join(map(str, cfg.workers)) or 'nothing'}; use e.g. --workers 1,2,4")
    bad = [p for p in cfg.policies if p not in POLICIES]
    if bad or not cfg.policies:
        raise UsageError(f"unknown policy {','.join(bad) or '(none)'}; expected {' or '.join(POLICIES)}")
    if cfg.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {cfg.repeats}; use e.g. --repeats 3 for a mean and spread")
    if cfg.steps is not None and cfg.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {cfg.steps}; omit it to train for the workload's own length")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise UsageError(f"--global-batch must be >= 1, got {cfg.global_batch}; use e.g. --global-batch 64")
    if cfg.ci is not None and not 0 < cfg.ci < 1:
        raise UsageError(f"--ci is the relative half-width of the speedup's interval, in (0, 1), got {cfg.ci}; use e.g. --ci 0.1")
    if not cfg.budget_s >= 0:  # NaN too; 0: the --repeats rounds, none added
        raise UsageError(f"--budget is the seconds after which no round starts, 0 or more, got {cfg.budget_s:g}; "
                         "use e.g. --budget 600")
    if cfg.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {cfg.threads}; use --threads 1 for one core per worker")
    if cfg.ci is not None and cfg.max_repeats < max(cfg.repeats, 1):  # it bounds only --ci's extra rounds
        raise UsageError(f"--max-repeats {cfg.max_repeats} is below --repeats {cfg.repeats}; raise it or lower --repeats")
    parse_target(cfg.target)
    if cfg.layouts is not None:
        from ..parallel.flags import refuse_fixed

        refuse_fixed(cfg.args, "--layouts sets", "from the workload's arguments (or put it in the layouts)")
    series(cfg)


def check_batches(cfg: StudyConfig, base: int) -> None:
    """Refuse, before any run, a global batch that some group's data-parallel ranks cannot split into equal
    shares (under a layout only the data-parallel ranks take a share; TP and pipeline ranks share theirs)."""
    groups = series(cfg)
    if "keep-global" in cfg.policies:  # scale-global gives each data-parallel rank the base batch: it always splits
        check_splits(base, [(f"{dp} data-parallel ranks (layout {label})" if label else
                             f"{w} worker{'s' if w > 1 else ''}", dp) for w, label, dp, _ in groups],
                     why=f" (keep-global keeps it at {base} at every world size)")


def base_batch(cfg: StudyConfig, recipe: Recipe | None) -> int:
    return cfg.global_batch or (recipe.global_batch if recipe else 64)


def plan_runs(cfg: StudyConfig, recipe: Recipe | None, repeats: range | None = None) -> list[RunSpec]:
    """One spec per distinct (workers, global batch, steps, repeat): policies that coincide share a run.

    Interleaved: every world size once per repeat (1, 2, 1, 2, ...), so a machine
    that slows down during the study slows every world size alike.
    """
    base = base_batch(cfg, recipe)
    runs: dict[tuple, RunSpec] = {}
    for rep in repeats if repeats is not None else range(cfg.repeats):
        for w, label, dp, flags in series(cfg):
            for pol in cfg.policies:
                gb = policy_batch(pol, base, dp)
                steps = same_samples_steps(cfg.steps, base, gb)
                key = (w, label, gb, steps, rep)
                if key in runs:
                    runs[key] = RunSpec(**{**asdict(runs[key]), "policies": runs[key].policies + (pol,)})
                    continue
                args = (list(cfg.args) + flags + ["--global-batch", str(gb)]
                        + (["--steps", str(steps)] if steps else []))
                if recipe:
                    ddp = ["--dp-replicate", str(w)] if recipe.replicate and w > 1 and not label else []
                    args = list(recipe.args) + (list(recipe.noise_args) if w > 1 else []) + ddp + args
                slug = "".join(c if c.isalnum() else "-" for c in label.replace("=", "")) + "-" if label else ""
                runs[key] = RunSpec(f"w{w}-{slug}gb{gb}-r{rep}", w, (pol,), rep, gb, steps, tuple(args), label)
    return list(runs.values())


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


def execute(spec: RunSpec, target: str, module: bool, cfg: StudyConfig, out: Path,
            goal: tuple[str, str, float] | None) -> dict[str, Any]:
    """Run one spec through the launcher, with its console output captured in a file."""
    from ..launch.once import run_once

    record: dict[str, Any] = {"id": spec.id, "workers": spec.workers, "policies": list(spec.policies),
                              "policy": spec.policies[0], "repeat": spec.repeat, "global_batch": spec.global_batch,
                              "steps": spec.steps, "args": list(spec.args), "layout": spec.layout}
    done = run_once(target, spec.args, module=module, log_dir=out / "runs" / spec.id, nproc=spec.workers,
                    cpu=cfg.cpu, profile=cfg.profile,
                    env={"OMP_NUM_THREADS": str(cfg.threads) if on_cpu(cfg) else None})
    record["elapsed_s"] = done.elapsed_s
    record["run_dir"] = str(done.run_dir) if done.run_dir else None
    if done.exit_code != 0:
        # The launcher's summary (or an error line) says more than whatever the workers printed last.
        return record | {"status": "failed", "exit_code": done.exit_code,
                         "error": done.failure() or f"exit code {done.exit_code}; see {done.console}"}
    if done.run_dir is None:
        return record | {"status": "failed", "exit_code": 0, "error": f"unreadable metrics: no run directory in {done.console.parent}"}
    try:
        measured = measure_run(done.run_dir, goal, steps_asked(spec.args))
    except (UsageError, IndexError, KeyError, ValueError) as err:
        return record | {"status": "failed", "exit_code": 0, "error": f"unreadable metrics: {err}"}
    if measured["thin"]:  # finished, but too short to judge: kept, and left out of every verdict
        return record | {"status": "short", "exit_code": 0, "error": measured["thin"]} | measured
    return record | {"status": "ok", "exit_code": 0} | measured


def on_cpu(cfg: StudyConfig) -> bool:
    import torch

    return cfg.cpu or not torch.cuda.is_available()


def _eta(done: list[float], left: int) -> str:
    if not done:
        return "ETA unknown"
    s = statistics.fmean(done) * left
    return f"ETA {int(s // 60)}m{int(s % 60):02d}s"


def run_study(cfg: StudyConfig, say: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Run the study; returns the results directory and the study dict (also in study.json).

    Rounds of interleaved runs (every world size once per round): ``repeats``
    rounds, then, with ``ci``, more until every speedup's 95 % interval is
    within +-ci, ``max_repeats`` rounds are done or ``budget_s`` has gone.

    >>> out, study = run_study(StudyConfig("digits", workers=(1, 2), policies=("keep-global",)))
    """
    check(cfg)
    target, module, name, recipe = resolve_workload(cfg.workload)
    check_batches(cfg, base_batch(cfg, recipe))
    goal = parse_target(cfg.target or (recipe.target if recipe else None))
    out = _out_dir(cfg, name)
    from ..runtime.fingerprint import fingerprint

    cpu = on_cpu(cfg)
    fp = fingerprint(workload=name, threads_per_worker=cfg.threads if cpu else None)
    (out / "fingerprint.json").write_text(json.dumps(fp, indent=1, default=str))
    first = plan_runs(cfg, recipe)
    say(f"multigpu study: {name}, {len(first)} runs ({', '.join(s.id for s in first)})"
        + (f", then more rounds until the speedups are within +-{100 * cfg.ci:.0f} % (95 % interval; at most "
           f"{cfg.max_repeats} rounds, {cfg.budget_s:.0f} s)" if cfg.ci else "")
        + (f"; {cfg.threads} CPU thread{'s' if cfg.threads > 1 else ''} per worker" if cpu else "") + f" -> {out}")
    runs: list[dict[str, Any]] = []
    durations: list[float] = []
    t_start = time.perf_counter()
    rounds, specs = cfg.repeats, first
    while True:
        for i, spec in enumerate(specs, 1):
            say(f"[{len(runs) + 1}] {spec.workers} worker{'s' if spec.workers > 1 else ''}"
                f"{', layout ' + spec.layout if spec.layout else ''}, {'/'.join(spec.policies)}, "
                f"global batch {spec.global_batch}, round {spec.repeat + 1}"
                + (f" ... {_eta(durations, len(specs) - i + 1)}" if not cfg.ci else ""))
            rec = execute(spec, target, module, cfg, out, goal)
            durations.append(rec["elapsed_s"])
            runs.append(rec)
            _say_run(rec, say)
            if rec["status"] != "ok" and rec["exit_code"] == 2:
                # The workload rejected its arguments: every other run would too.
                raise UsageError(f"run {spec.id} rejected its arguments ({rec['error']}); the study stopped. Study "
                                 f"options go before the workload (multigpu study --workers 1,2 {name} [its args])")
        groups = summarize(runs, [(w, label) for w, label, _, _ in series(cfg)], cfg.policies)
        wide = _too_wide(groups, cfg.ci)
        round_s = sum(durations[-len(specs):])
        if not wide or rounds >= cfg.max_repeats or time.perf_counter() - t_start + round_s > cfg.budget_s:
            break
        say(f"      speedup interval wider than +-{100 * cfg.ci:.0f} % for {', '.join(wide)}: round {rounds + 1}")
        specs = plan_runs(cfg, recipe, range(rounds, rounds + 1))
        rounds += 1
    study = {"schema": 2, "workload": {"name": name, "target": target, "module": module, "args": list(cfg.args)},
             "config": asdict(cfg) | {"target": cfg.target or (recipe.target if recipe else None)},
             "rounds": rounds, "elapsed_s": time.perf_counter() - t_start,
             "fingerprint": fp, "headline": headline(groups), "groups": groups, "runs": runs}
    (out / "study.json").write_text(json.dumps(study, indent=1, default=str))
    return out, study


def _say_run(rec: dict[str, Any], say: Callable[[str], None]) -> None:
    if rec["status"] == "ok":
        acc = rec["final"].get("accuracy")
        say(f"      done in {rec['elapsed_s']:.0f} s: {rec['samples_per_s'] or 0:,.0f} samples/s"
            + (f", accuracy {100 * acc:.2f} %" if acc is not None else ""))
    elif rec["status"] == "short":
        say(f"      NO EVIDENCE in {rec['elapsed_s']:.0f} s: {rec['error']} (left out of the verdicts; the study goes on)")
    else:
        say(f"      FAILED in {rec['elapsed_s']:.0f} s: {rec['error']} (the study goes on)")


def _too_wide(groups: list[dict[str, Any]], ci: float | None) -> list[str]:
    """Groups whose speedup interval is missing or wider than +-ci (none when ci is None)."""
    if ci is None:
        return []
    wide = []
    for g in groups:
        sp = g.get("speedup")
        if g["workers"] > 1 and g["n_ok"]:
            if sp is None or sp.get("low") is None or sp["high"] / sp["mean"] - 1 > ci or 1 - sp["low"] / sp["mean"] > ci:
                wide.append(f"{g['workers']} workers {g['policy']}")
    return wide
