"""``multigpu tune``: predict every layout, measure the most promising, pick the fastest that fits.

1. the candidates (``space.py``) and the measured parts (``probe.py``);
2. each candidate's predicted memory and step time (``multigpu forecast``'s model with this machine's
   measured rates, links and overheads: ``machine.py``); those over
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..parallel.layout import Layout
from ..parallel.space import name
from ..report.page import Heading, Items, Page, Table, Text
from . import machine, rounds
from .space import candidates

RECIPE = "multigpu.recipes.gpt"
# Besides the layout's flags (parallel.flags), the recipe's flags tune sets itself.
RUN_FLAGS = ("--pp-splits", "--steps", "--result-json", "--log-dir")


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
    experts: bool = False
    """the script's model is a mixture of experts: weigh its expert-parallel layouts too (ep of dp_shard)"""
    context: bool = False
    """weigh context-parallel layouts too (cp: each rank a share of every sequence; a transformers model)"""
    model: str | None = None
    """a script's model, as multigpu forecast --model takes it (config.json, module:function or
    path.py:function returning the nn.Module): tune then predicts every layout and measures the --top fastest"""
    seq_len: int | None = None
    """the tokens per sequence the script trains on (with --model)"""


def check_args(cfg: TuneConfig) -> None:
    """The refusals that need no torch (a typo fails at once)."""
    from .script import check_script_args, is_script

    if is_script(cfg.workload):  # a script of the user's that follows the layout contract
        return check_script_args(cfg)
    if cfg.workload not in ("gpt", RECIPE):
        raise UsageError(f"tune knows the layouts of the GPT recipe (`multigpu tune gpt [its flags]`), got {cfg.workload!r}; "
                         "a script of your own cannot be re-laid-out from outside: port its model to the recipe's flags")
    for flag, value in (("--model", cfg.model), ("--seq-len", cfg.seq_len)):
        if value is not None:
            raise UsageError(f"{flag} tells tune a script's model; the recipe's is its own flags (--size, --block-size): "
                             f"drop {flag}")
    from ..parallel.flags import refuse_fixed

    refuse_fixed(cfg.args, "tune chooses", "(pass the model and batch flags: --size, --block-size, --global-batch, "
                 "--untied, ...)", extra=RUN_FLAGS)


def _recipe_args(cfg: TuneConfig):
    check_args(cfg)
    from ..recipes.gpt.model import config
    from ..recipes.gpt.train import parse_args

    args = parse_args(list(cfg.args))
    model_cfg = config(args.size, **({"block_size": args.block_size} if args.block_size else {}),
                       **({"tie_embeddings": False} if args.untied else {}))
    return args, model_cfg


def _measure(layout: Layout, cfg: TuneConfig, root: Path, round_: int) -> dict:
    from ..study.measure import measure_run

    where = root / "runs" / f"{rounds.slug(name(layout))}-r{round_}"
    result = where / "result.json"
    # The first interval (3 steps: warm-up, and the third's memory measured) is left out of the step time.
    argv = [*cfg.args, *layout.flags, "--steps", str(cfg.steps), "--log-every", "3", "--eval-every",
            str(10 * cfg.steps), "--eval-batches", "1", "--result-json", str(result)]
    done, failed = rounds.launch(RECIPE, argv, module=True, cfg=cfg, where=where)
    if failed is not None:
        return failed
    wall = done.elapsed_s
    if not result.is_file():
        return {"status": "failed", "exit_code": 0, "error": (done.failure() or "no output")[:400], "wall_s": wall}
    try:
        measured = measure_run(done.run_dir, None, cfg.steps)
        mem = json.loads(result.read_text())["memory"]
    except (UsageError, KeyError, ValueError) as err:
        return {"status": "failed", "exit_code": 0, "error": f"unreadable results: {err}", "wall_s": wall}
    if measured["thin"]:
        return {"status": "failed", "exit_code": 0, "error": f"too short to judge: {measured['thin']}", "wall_s": wall}
    if mem["total_bytes"] is None:  # the StepMeter's MemoryStep could not profile the step (a profiler of the user's ran)
        return {"status": "failed", "exit_code": 0, "wall_s": wall,
                "error": "the run's memory was not measured (another profiler was running: drop --profile)"}
    return {"status": "ok", "step_time_s": measured["step_time_s"], "memory_bytes": mem["total_bytes"], "wall_s": wall}


def run_tune(cfg: TuneConfig, say: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Tune; returns the results directory and the report dict (also in tune.json)."""
    from .script import is_script, run_script_tune

    if is_script(cfg.workload):  # a script measures itself: no torch or probe needed here
        return run_script_tune(cfg, say)
    t_start = time.perf_counter()
    args, model_cfg = _recipe_args(cfg)
    cfg, device = rounds.device_of(cfg)
    found, left_out = candidates(cfg.nproc, model_cfg, args.global_batch,
                                 micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None)
    out = rounds.out_dir(cfg)
    say(f"multigpu tune: gpt {args.size} on {cfg.nproc} {'CPU workers' if device == 'cpu' else 'GPUs'}, global batch "
        f"{args.global_batch}: {len(found)} candidates ({len(left_out)} layouts left out) -> {out}")
    counts = machine.count_recipe(model_cfg, args.precision)
    from .wrappers import gpt

    parts = machine.measure_parts(gpt(model_cfg), found, cfg.nproc, device, cfg.threads, say, workload=RECIPE,
                                  module=True, recipe_args=cfg.args, root=out / "probe")
    budget, budget_text = machine.budget_of(cfg, device)
    here = machine.measured_cluster(counts, parts, cfg.nproc, budget)
    rows = []
    for c in found:
        p = machine.predict(c, counts, here, parts, args.global_batch)
        rows.append({"candidate": name(c), "args": c.flags, "predicted": p, "fits": p["fits"], "measured": [],
                     "pruned": machine.pruned(p, here), "_c": c})
    rows.sort(key=lambda r: r["predicted"]["step_time_s"])
    chosen = [r for r in rows if r["fits"]]
    chosen = chosen if cfg.top == 0 else chosen[:cfg.top]
    say(f"multigpu tune: measuring {len(chosen)} of {len(rows)} (fastest predicted that fit), {cfg.repeats} round(s) "
        f"of {cfg.steps} steps")

    def show(r: dict, m: dict) -> str:
        shown = f"{m['step_time_s'] * 1e3:,.1f} ms/step, {m['memory_bytes'] / 2**20:,.1f} MiB" if m["status"] == "ok" \
            else f"failed: {m['error']}"
        return f"predicted {r['predicted']['step_time_s'] * 1e3:,.1f} ms -> {shown}"

    rounds.measure_rounds(rows, cfg.repeats, lambda _: chosen, lambda r, i: _measure(r["_c"], cfg, out, i), show, say)
    report = _report(cfg, args, rows, chosen, left_out, budget, budget_text, parts, time.perf_counter() - t_start)
    rounds.write_report(report, tune_page(report), out, say)
    return out, report


def _report(cfg, args, rows, chosen, left_out, budget, budget_text, parts, wall_s) -> dict:
    for r in rows:
        r["result"] = rounds.summary(r["measured"])
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
    return {"workload": f"gpt {args.size}", "world_size": cfg.nproc, "global_batch": args.global_batch,
            "device": "cpu" if cfg.cpu else "cuda", "threads_per_worker": cfg.threads if cfg.cpu else None,
            "budget": budget_text, "steps": cfg.steps, "repeats": cfg.repeats, "top": cfg.top,
            "candidates": rows, "left_out": left_out, "winner": winner["candidate"] if winner else None, "command": cmd,
            "verdict": verdict, "probe": machine.probe_record(parts),
            "prediction_error": rounds.errors(rows),
            "wall_s": wall_s}


def _cells(r: dict) -> list[str]:
    p, res = r["predicted"], r.get("result")
    meas = f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})" if res else \
        ("failed: " + next((m["error"] for m in r["measured"] if m["status"] != "ok"), "") if r["measured"] else "-")
    return [r["candidate"], f"{p['step_time_s'] * 1e3:,.1f}", f"{p['compute_s'] * 1e3:,.1f} + {p['comm_s'] * 1e3:,.1f} + {p.get('overhead_s', 0.0) * 1e3:,.1f}",
            meas, f"{p['memory_bytes'] / 2**20:,.2f}", f"{res['memory_bytes'] / 2**20:,.2f}" if res else "-",
            r["pruned"] or ("measured" if r["measured"] else "not measured (slower predicted)")]


HEAD = ["candidate", "predicted ms/step", "compute + comm + fixed ms", "measured ms/step (min-max)", "predicted MiB/rank",
        "measured MiB/rank", "status"]


def tune_page(report: dict) -> Page:
    """The report: the verdict, the budget and the prediction error, every candidate, the layouts left out."""
    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"Global batch {report['global_batch']}; memory budget: {report['budget']}; {report['steps']} "
                         f"steps per run, {report['repeats']} round(s). {rounds.error_line(report['prediction_error'])} Tune took "
                         f"{report['wall_s']:.0f} s."),
                    Table(HEAD, [_cells(r) for r in report["candidates"]])]
    if report["left_out"]:
        blocks += [Heading("Left out"), Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    blocks.append(Text("The model: multigpu forecast's (docs/forecast.md) with this machine's measured rates, links and "
                       "overheads (docs/tune.md); no overlap of communication and compute is assumed."))
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
