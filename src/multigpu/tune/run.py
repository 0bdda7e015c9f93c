"""``multigpu tune``: predict every layout, measure the most promising, pick the fastest that fits.

1. the candidates (``space.py``) and the measured parts (``probe.py``);
2. each candidate's predicted memory and step time (``model.py``); those over
   the memory budget (``--memory-budget``, or the GPU's memory) are pruned;
3. the ``top`` fastest predicted are run through the launcher for ``steps``
   steps each, in ``repeats`` interleaved rounds (A B C A B C): the step time is
   the StepMeter's (total time / steps over the measured intervals), the memory
   the recipe's count (``--result-json``: training state and peak saved
   activations, the largest rank); a run that fails is recorded and skipped;
4. the winner is the fastest median measured step time that fits, and the
   report (tune.json, report.md, report.html) lists every candidate with its
   prediction and measurement, every pruned one with its reason, and the
   command to use.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..report.page import Heading, Items, Page, Table, Text, write
from . import model as cost
from .space import Candidate, candidates

RECIPE = "multigpu.recipes.gpt"
# The flags tune chooses; the user's command line may not fix them.
LAYOUT_FLAGS = ("--tp", "--pp", "--dp-replicate", "--dp-shard", "--ddp", "--micro-batch", "--activation-checkpointing",
                "--schedule", "--pp-splits", "--steps", "--result-json", "--log-dir")


@dataclass(frozen=True)
class TuneConfig:
    """What to tune. Each field's docstring is its flag's help in `multigpu tune --help` (tune/__init__.py)."""

    workload: str = "gpt"
    args: tuple[str, ...] = ()
    nproc: int = 2
    """ranks to tune for (default: the visible GPUs, or 2 on CPU)"""
    cpu: bool = False
    """CPU workers (gloo) even where GPUs exist"""
    memory_budget: int | None = None
    """the most memory a rank may use, e.g. 2GiB (default: 90 % of the GPU's; none on CPU)"""
    top: int = 3
    """measure the K fastest predicted candidates that fit (default %(default)s; 'all': every one)"""
    repeats: int = 2
    """interleaved rounds of measurement (default %(default)s)"""
    steps: int = 8
    """steps per measured run (default %(default)s; the first 2 are warm-up)"""
    out: str | None = None
    """results directory (default: studies/tune-<time>)"""
    threads: int = 1
    """CPU threads per worker on CPU (default %(default)s: a worker stands for a device)"""
    micro_batches: tuple[int, ...] | None = None
    """micro-batch sizes to consider (default: powers of 2 that divide a rank's share)"""


def check_args(cfg: TuneConfig) -> None:
    """The refusals that need no torch (a typo fails at once)."""
    from .script import check_script_args, is_script

    if is_script(cfg.workload):  # a script of the user's that follows the layout contract
        return check_script_args(cfg)
    if cfg.workload not in ("gpt", RECIPE):
        raise UsageError(f"tune knows the layouts of the GPT recipe (`multigpu tune gpt [its flags]`), got {cfg.workload!r}; "
                         "a script of your own cannot be re-laid-out from outside: port its model to the recipe's flags")
    fixed = [a for a in cfg.args if a.split("=")[0] in LAYOUT_FLAGS]
    if fixed:
        raise UsageError(f"tune chooses {', '.join(sorted(set(a.split('=')[0] for a in fixed)))} itself; drop them "
                         "(pass the model and batch flags: --size, --block-size, --global-batch, --untied, ...)")


def _recipe_args(cfg: TuneConfig):
    check_args(cfg)
    from ..recipes.gpt.model import config
    from ..recipes.gpt.train import parse_args

    args = parse_args(list(cfg.args))
    model_cfg = config(args.size, **({"block_size": args.block_size} if args.block_size else {}),
                       **({"tie_embeddings": False} if args.untied else {}))
    return args, model_cfg


def _budget(cfg: TuneConfig, device: str) -> tuple[int | None, str]:
    if cfg.memory_budget is not None:
        return cfg.memory_budget, f"--memory-budget {cfg.memory_budget / 2**20:,.0f} MiB"
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return int(0.9 * total), f"90 % of the GPU's {total / 2**30:.0f} GiB"
    return None, "none (CPU: pass --memory-budget to prune by memory)"


def _cpu_slowdown(cfg: TuneConfig) -> float:
    from ..launch.config import cpu_count

    return max(1.0, cfg.nproc * cfg.threads / cpu_count())


def _measure(c: Candidate, cfg: TuneConfig, root: Path, round_: int) -> dict:
    from ..launch.once import run_once
    from ..study.measure import measure_run

    where = root / "runs" / f"{_slug(c)}-r{round_}"
    result = where / "result.json"
    argv = [*cfg.args, *c.args(), "--steps", str(cfg.steps), "--log-every", "2", "--eval-every", str(10 * cfg.steps),
            "--eval-batches", "1", "--result-json", str(result)]
    done = run_once(RECIPE, argv, module=True, log_dir=where, nproc=cfg.nproc, cpu=cfg.cpu,
                    env={"OMP_NUM_THREADS": str(cfg.threads) if cfg.cpu else None})
    if done.refusal is not None:
        return {"status": "failed", "error": str(done.refusal)}
    code, wall = done.exit_code, done.elapsed_s
    if code != 0 or not result.is_file() or done.run_dir is None:
        # The launcher's summary or an error line, as study and a script's tune report it, not the last line.
        return {"status": "failed", "exit_code": code, "error": (done.failure() or "no output")[:300], "wall_s": wall}
    try:
        step = measure_run(done.run_dir, None)["step_time_s"]
        mem = json.loads(result.read_text())["memory"]
    except (UsageError, KeyError, ValueError) as err:
        return {"status": "failed", "exit_code": 0, "error": f"unreadable results: {err}", "wall_s": wall}
    return {"status": "ok", "step_time_s": step, "memory_bytes": mem["total_bytes"], "wall_s": wall}


def _slug(c: Candidate) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in c.name.lower()).strip("-").replace("--", "-")


def run_tune(cfg: TuneConfig, say: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Tune; returns the results directory and the report dict (also in tune.json)."""
    from .script import is_script, run_script_tune

    if is_script(cfg.workload):  # a script measures itself: no torch or probe needed here
        return run_script_tune(cfg, say)
    import torch

    from . import probe

    t_start = time.perf_counter()
    args, model_cfg = _recipe_args(cfg)
    device = "cpu" if cfg.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise UsageError(f"-n {cfg.nproc} is more than the {torch.cuda.device_count()} visible GPUs; use -n "
                         f"{torch.cuda.device_count()} or fewer, or --cpu")
    if device == "cpu" and not cfg.cpu:
        cfg = replace(cfg, cpu=True)
    found, left_out = candidates(cfg.nproc, model_cfg, args.global_batch,
                                 micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None)
    out = Path(cfg.out or f"studies/tune-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say(f"multigpu tune: gpt {args.size} on {cfg.nproc} {'CPU workers' if device == 'cpu' else 'GPUs'}, global batch "
        f"{args.global_batch}: {len(found)} candidates ({len(left_out)} layouts left out) -> {out}")
    shape = cost.Shape.of(model_cfg)
    t0 = time.perf_counter()
    parts = probe.compute(model_cfg, sorted({(c.micro_batch, c.activation_checkpointing) for c in found}), cfg.threads)
    probe_s = time.perf_counter() - t0
    groups = {n for c in found for n in (c.dp_size, c.dp_shard, c.dp_replicate, c.tp)} | ({2} if any(c.pp > 1 for c in found) else set())
    links, sources = probe.links(groups, device, cfg.threads, say=say)
    budget, budget_text = _budget(cfg, device)
    rows = []
    slowdown = _cpu_slowdown(cfg) if device == "cpu" else 1.0
    for c in found:
        p = cost.predict(c, shape, args.global_batch, parts, links, slowdown)
        fits = budget is None or p["memory_bytes"] <= budget
        rows.append({"candidate": c.name, "args": c.args(), "predicted": p, "fits": fits, "measured": [],
                     "pruned": None if fits else f"predicted {p['memory_bytes'] / 2**20:,.1f} MiB > budget {budget / 2**20:,.1f} MiB",
                     "_c": c})
    rows.sort(key=lambda r: r["predicted"]["step_time_s"])
    chosen = [r for r in rows if r["fits"]]
    chosen = chosen if cfg.top == 0 else chosen[:cfg.top]
    say(f"multigpu tune: measuring {len(chosen)} of {len(rows)} (fastest predicted that fit), {cfg.repeats} round(s) "
        f"of {cfg.steps} steps")
    for round_ in range(cfg.repeats):
        for i, r in enumerate(chosen):
            m = _measure(r["_c"], cfg, out, round_)
            r["measured"].append(m)
            shown = f"{m['step_time_s'] * 1e3:,.1f} ms/step, {m['memory_bytes'] / 2**20:,.1f} MiB" if m["status"] == "ok" else f"failed: {m['error']}"
            say(f"[{round_ + 1}.{i + 1}] {r['candidate']}: predicted {r['predicted']['step_time_s'] * 1e3:,.1f} ms -> {shown}")
    report = _report(cfg, args, rows, chosen, left_out, budget, budget_text, parts, sources, probe_s,
                     time.perf_counter() - t_start)
    (out / "tune.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write(tune_page(report), out / "report.md", out / "report.html")
    say(report["verdict"])
    say(f"multigpu tune: report {out / 'report.html'} (and report.md); data {out / 'tune.json'}")
    return out, report


def _summary(ms: list[dict]) -> dict | None:
    ok = [m for m in ms if m["status"] == "ok"]
    if not ok:
        return None
    steps = [m["step_time_s"] for m in ok]
    return {"step_time_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps), "runs": len(ok),
            "memory_bytes": max(m["memory_bytes"] for m in ok)}


def _report(cfg, args, rows, chosen, left_out, budget, budget_text, parts, sources, probe_s, wall_s) -> dict:
    for r in rows:
        r["result"] = _summary(r["measured"])
        r.pop("_c", None)
        if r["result"]:
            r["error"] = {"step_time": r["predicted"]["step_time_s"] / r["result"]["step_time_s"] - 1,
                          "memory": r["predicted"]["memory_bytes"] / r["result"]["memory_bytes"] - 1}
    done = [r for r in chosen if r.get("result") and (budget is None or r["result"]["memory_bytes"] <= budget)]
    winner = min(done, key=lambda r: r["result"]["step_time_s"]) if done else None
    base = f"multigpu run -n {cfg.nproc}{' --cpu' if cfg.cpu else ''} -m {RECIPE} {' '.join(cfg.args)}".rstrip()
    if winner:
        cmd = f"{base} {' '.join(winner['args'])}"
        verdict = (f"multigpu tune: fastest measured: {winner['candidate']}: {winner['result']['step_time_s'] * 1e3:,.1f} ms/step "
                   f"(predicted {winner['predicted']['step_time_s'] * 1e3:,.1f}); run it with: {cmd}")
    else:
        cmd, verdict = None, "multigpu tune: no candidate ran to the end; see the failures in the report"
    errs = [abs(r["error"]["step_time"]) for r in rows if r.get("error")]
    merrs = [abs(r["error"]["memory"]) for r in rows if r.get("error")]
    return {"workload": f"gpt {args.size}", "world_size": cfg.nproc, "global_batch": args.global_batch,
            "device": "cpu" if cfg.cpu else "cuda", "threads_per_worker": cfg.threads if cfg.cpu else None,
            "budget": budget_text, "steps": cfg.steps, "repeats": cfg.repeats, "top": cfg.top,
            "candidates": rows, "left_out": left_out, "winner": winner["candidate"] if winner else None, "command": cmd,
            "verdict": verdict, "probe": {"compute": {f"{m}{'+ac' if ac else ''}": v for (m, ac), v in parts.items()},
                                          "probe_s": probe_s, "links": sources},
            "prediction_error": {"step_time_median": statistics.median(errs) if errs else None,
                                 "step_time_worst": max(errs) if errs else None,
                                 "memory_median": statistics.median(merrs) if merrs else None,
                                 "memory_worst": max(merrs) if merrs else None},
            "wall_s": wall_s}


def _cells(r: dict) -> list[str]:
    p, res = r["predicted"], r.get("result")
    meas = f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})" if res else \
        ("failed: " + next((m["error"] for m in r["measured"] if m["status"] != "ok"), "") if r["measured"] else "-")
    return [r["candidate"], f"{p['step_time_s'] * 1e3:,.1f}", f"{p['compute_s'] * 1e3:,.1f} + {p['comm_s'] * 1e3:,.1f}",
            meas, f"{p['memory_bytes'] / 2**20:,.2f}", f"{res['memory_bytes'] / 2**20:,.2f}" if res else "-",
            r["pruned"] or ("measured" if r["measured"] else "not measured (slower predicted)")]


HEAD = ["candidate", "predicted ms/step", "compute + comm ms", "measured ms/step (min-max)", "predicted MiB/rank",
        "measured MiB/rank", "status"]


def _error_line(report: dict) -> str:
    e = report["prediction_error"]
    if e["step_time_median"] is None:
        return "No candidate was measured."
    return (f"Prediction error over the measured candidates: step time median {e['step_time_median']:.0%}, worst "
            f"{e['step_time_worst']:.0%}; memory median {e['memory_median']:.0%}, worst {e['memory_worst']:.0%}.")


def tune_page(report: dict) -> Page:
    """The report: the verdict, the budget and the prediction error, every candidate, the layouts left out."""
    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"Global batch {report['global_batch']}; memory budget: {report['budget']}; {report['steps']} "
                         f"steps per run, {report['repeats']} round(s). {_error_line(report)} Tune took "
                         f"{report['wall_s']:.0f} s."),
                    Table(HEAD, [_cells(r) for r in report["candidates"]])]
    if report["left_out"]:
        blocks += [Heading("Left out"), Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    blocks.append(Text("The model: docs/tune.md (no overlap of communication and compute is assumed)."))
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
