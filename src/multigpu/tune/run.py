"""``multigpu tune``: one path for every workload: the GPT recipe and a script of the layout contract.

A ``Workload`` says what runs (the recipe's module, or the script), its candidates, and, where its model is
known (always the recipe's; a script's with ``--model``), how to count and probe it. Then, for either:

1. the candidates (``space.candidates``: the mesh's factorings, each micro-batch and checkpointing where the
   model is known, less those the workload would refuse, with its own line; a script measured alone: every
   ``Layout`` of N ranks as it is);
2. where the model is known, each one's predicted memory and step time (``multigpu forecast``'s model with
   this machine's measured rates, links and overheads: ``machine.py``); those over the memory budget
   (``--memory-budget``, or the GPU's memory) are pruned, and the ``top`` fastest predicted are measured;
   else every layout is measured once (one that runs out of memory again with checkpointing) and the
   ``top`` fastest again;
3. each run goes through the launcher for ``steps`` steps in ``repeats`` interleaved rounds (A B C A B C):
   the step time is the workload's StepMeter's (total time / steps over the measured intervals), the memory
   the largest rank's real peak in a warm-up step (``MULTIGPU_MEMORY_STEP``: the meter's ``MemoryStep``);
   a run that fails or runs short is recorded with its line and skipped;
4. the winner is the fastest median measured step time that fits, and one report (tune.json, report.md,
   report.html) lists every candidate with its prediction and measurement, every one left out with its
   reason, and the command to use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..parallel.layout import Layout
from ..report.page import Heading, Items, Page, Table, Text
from ..runtime.contract import MEMORY_STEP_ENV
from . import machine, rounds
from .rounds import Workload

RECIPE = "multigpu.recipes.gpt"
# Besides the layout's flags (parallel.flags), the recipe's flags tune sets itself.
RUN_FLAGS = ("--pp-splits", "--steps", "--log-dir")


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


def recipe(cfg: TuneConfig) -> Workload:
    """The GPT recipe as a workload: launched as a module, its model its own flags, so always predicted."""
    from ..recipes.gpt.model import config
    from ..recipes.gpt.train import parse_args
    from ..parallel.space import layouts
    from .space import candidates, gpt_refusal
    from .wrappers import gpt

    args = parse_args(list(cfg.args))
    model_cfg = config(args.size, **({"block_size": args.block_size} if args.block_size else {}),
                       **({"tie_embeddings": False} if args.untied else {}))
    # Replication alone beside TP or PP is left out: the recipe's data parallelism there is FSDP's (sharded).
    found = [s for s in layouts(cfg.nproc, schedules=("1f1b", "gpipe")) if not (s.strategy == "hsdp" and s.dp_shard == 1)]
    found, left_out = candidates(found, args.global_batch, gpt_refusal(model_cfg, args.global_batch),
                                 micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None)
    # The first interval (3 steps: warm-up, the third's memory measured) is left out of the step time; no eval.
    flags = ("--log-every", "3", "--eval-every", str(10 * cfg.steps), "--eval-batches", "1")
    return Workload(f"gpt {args.size}", RECIPE, True, found, left_out, flags,
                    machine.count_recipe(model_cfg, args.precision), gpt(model_cfg), args.global_batch)


def run_tune(cfg: TuneConfig, say: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Tune; returns the results directory and the report dict (also in tune.json)."""
    from .script import is_script, workload

    check_args(cfg)
    t_start = time.perf_counter()
    cfg, device = rounds.device_of(cfg)
    work = workload(cfg) if is_script(cfg.workload) else recipe(cfg)  # its refusals: one line, nothing written
    rows = [rounds.row(layout) for layout in work.found]
    out = rounds.out_dir(cfg)
    say(f"multigpu tune: {work.name} on {cfg.nproc} {'CPU workers' if cfg.cpu else 'GPUs'}: {len(rows)} candidates "
        f"({len(work.left_out)} layouts left out) -> {out}")
    budget, prediction = _predict(cfg, work, rows, device, out, say) if work.counts else (None, None)
    if prediction:  # the fastest predicted that fit, in every round
        first = sorted((r for r in rows if r["fits"]), key=lambda r: r["predicted"]["step_time_s"])
        first = first if cfg.top == 0 else first[:cfg.top]
        say(f"multigpu tune: measuring {len(first)} of {len(rows)} (fastest predicted that fit), {cfg.repeats} "
            f"round(s) of {cfg.steps} steps")
    else:  # every layout once, then the fastest of that round again, interleaved
        first = rows
        say(f"multigpu tune: measuring every layout for {cfg.steps} steps (with activation checkpointing where one "
            f"runs out of memory without), then {f'the {cfg.top} fastest' if cfg.top else 'every one'} in "
            f"{cfg.repeats - 1} more round(s)")

    def pick(round_: int) -> list[dict]:
        if round_ == 0:
            return first
        ok = [r for r in first if r["measured"][0]["status"] == "ok"]
        if prediction:
            return ok
        ok.sort(key=lambda r: r["measured"][0]["step_time_s"])
        return ok if cfg.top == 0 else ok[:cfg.top]

    rounds.measure_rounds(rows, cfg.repeats, pick, lambda r, i: _measure(work, r["_l"], cfg, out, i), _show, say,
                          retry=work.retry)
    report = _report(cfg, work, rows, budget, prediction, time.perf_counter() - t_start)
    rounds.write_report(report, page(report), out, say)
    return out, report


def _predict(cfg: TuneConfig, work: Workload, rows: list[dict], device: str, out: Path, say) -> tuple[int | None, dict]:
    """Each row's prediction (``predicted``, ``fits``, ``pruned``) by forecast's model of the counted model on this
    machine (``machine.measure_parts``: the probes on the workload's own model and loop, for its candidates);
    returns the memory budget and what the report keeps of the prediction."""
    parts = machine.measure_parts(work.subject, work.found, cfg.nproc, device, cfg.threads, say, workload=work.target,
                                  module=work.module, recipe_args=cfg.args, root=out / "probe")
    budget, budget_text = machine.budget_of(cfg, device)
    here = machine.measured_cluster(work.counts, parts, cfg.nproc, budget)
    for r in rows:
        p = machine.predict(r["_l"].resolve(cfg.nproc), work.counts, here, parts, work.global_batch)
        r["predicted"], r["fits"], r["pruned"] = p, p["fits"], machine.pruned(p, here)
    return budget, {"model": work.counts.name, "global_batch": work.global_batch, "budget": budget_text,
                    "probe": machine.probe_record(parts)}


def _measure(work: Workload, layout: Layout, cfg: TuneConfig, root: Path, round_: int) -> dict:
    """One run of ``layout``: its StepMeter's step time and a warm-up step's peak memory, or why there are none."""
    from ..study.measure import measure_run

    where = root / "runs" / f"{rounds.slug(layout.label)}-r{round_}"
    done, failed = rounds.launch(work.target, [*cfg.args, *layout.flags, *work.flags, "--steps", str(cfg.steps)],
                                 module=work.module, cfg=cfg, where=where, env={MEMORY_STEP_ENV: "1"})
    if failed is not None:  # a script's own refusal (its UsageError's message) is the reason
        return failed
    try:
        measured = measure_run(done.run_dir, None, cfg.steps)
    except UsageError as err:
        return {"status": "failed", "exit_code": 0, "error": f"unreadable results: {err}", "wall_s": done.elapsed_s}
    if measured["thin"]:  # too short to time: no evidence for the fastest layout
        return {"status": "failed", "exit_code": 0, "error": f"too short to judge: {measured['thin']}",
                "wall_s": done.elapsed_s}
    peak = measured["step_peak_bytes"]  # the largest rank's; None where another profiler ran (--profile)
    return {"status": "ok", "step_time_s": measured["step_time_s"], "wall_s": done.elapsed_s} | (
        {"memory_bytes": peak} if peak is not None else {})


def _show(r: dict, m: dict) -> str:
    said = f"predicted {r['predicted']['step_time_s'] * 1e3:,.1f} ms -> " if r["predicted"] else ""
    if m["status"] != "ok":
        return f"{said}left out: {m['error']}"
    mem = f", {m['memory_bytes'] / 2**20:,.1f} MiB" if "memory_bytes" in m else ""
    return f"{said}{m['step_time_s'] * 1e3:,.1f} ms/step{mem}"


def _report(cfg: TuneConfig, work: Workload, rows: list[dict], budget: int | None, prediction: dict | None,
            wall_s: float) -> dict:
    for r in rows:
        r.pop("_l", None)
        r["result"] = rounds.summary(r["measured"])
        if r["result"] and r["predicted"]:
            r["error"] = {"step_time": r["predicted"]["step_time_s"] / r["result"]["step_time_s"] - 1} | (
                {"memory": r["predicted"]["memory_bytes"] / r["result"]["memory_bytes"] - 1}
                if "memory_bytes" in r["result"] else {})
    # The prediction's order where there is one (how good it was is the report's question), else the measurement's.
    key = "predicted" if prediction else "result"
    rows.sort(key=lambda r: (r[key] is None, r[key]["step_time_s"] if r[key] else 0.0))
    fit = [r for r in rows if r["result"] and (budget is None or r["result"].get("memory_bytes", 0) <= budget)]
    winner = min(fit, key=lambda r: r["result"]["step_time_s"]) if fit else None
    # Not measured: a refusal or failure (its line), or, predicted, over the budget or slower; then no candidate.
    left_out = [{"layout": r["candidate"], "reason": r["measured"][0]["error"] if r["measured"] else r["pruned"]
                 or f"slower predicted ({r['predicted']['step_time_s'] * 1e3:,.1f} ms/step)"}
                for r in sorted((r for r in rows if not r["result"]), key=lambda r: not r["measured"])] + work.left_out
    run = f"-m {work.target}" if work.module else work.target
    base = f"multigpu run -n {cfg.nproc}{' --cpu' if cfg.cpu else ''} {run} {' '.join(cfg.args)}".rstrip()
    if winner:
        res, p = winner["result"], winner["predicted"]
        cmd = f"{base} {' '.join(winner['args'])}".rstrip()
        said = f", predicted {p['step_time_s'] * 1e3:,.1f}" if p else ""
        verdict = (f"multigpu tune: fastest measured: {winner['candidate']}: {res['step_time_s'] * 1e3:,.1f} ms/step "
                   f"(median of {res['runs']}{said}); run it with: {cmd}")
    else:
        first = f" ({left_out[0]['layout']}: {left_out[0]['reason']})" if left_out else ""
        cmd, verdict = None, f"multigpu tune: no layout was measured{first}; every reason is in the report"
    return {"workload": work.name, "world_size": cfg.nproc, "device": "cpu" if cfg.cpu else "cuda",
            "threads_per_worker": cfg.threads if cfg.cpu else None, "steps": cfg.steps, "repeats": cfg.repeats,
            "top": cfg.top, "candidates": rows, "left_out": left_out, "winner": winner["candidate"] if winner else None,
            "command": cmd, "verdict": verdict, "wall_s": wall_s} | (
        prediction | {"prediction_error": rounds.errors(rows)} if prediction else {})


def page(report: dict) -> Page:
    """The report: the verdict, how it was found (and the prediction's error), every candidate measured, the rest
    with their reason."""
    predicted = "prediction_error" in report

    def cells(r: dict) -> list[str]:
        res, p = r["result"], r["predicted"]
        got = [f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})",
               f"{res['memory_bytes'] / 2**20:,.2f}" if "memory_bytes" in res else "-"]
        guess = [f"{p['step_time_s'] * 1e3:,.1f}", f"{p['compute_s'] * 1e3:,.1f} + {p['comm_s'] * 1e3:,.1f} + "
                 f"{p['overhead_s'] * 1e3:,.1f}", f"{p['memory_bytes'] / 2**20:,.2f}"] if predicted else []
        return [r["candidate"], *guess[:2], got[0], *guess[2:], got[1], str(res["runs"]), " ".join(r["args"]) or "(none)"]

    if predicted:
        how = (f"Every candidate of {report['world_size']} ranks was predicted by multigpu forecast's model of "
               f"{report['model']} (docs/forecast.md; global batch {report['global_batch']}; memory budget: "
               f"{report['budget']}), this machine described by its probe's measured rates, links and overheads "
               f"(docs/tune.md; no overlap of communication and compute assumed); the fastest predicted that fit ran "
               f"{report['steps']} steps in {report['repeats']} round(s). {rounds.error_line(report['prediction_error'])}")
        head = ["candidate", "predicted ms/step", "compute + comm + fixed ms", "measured ms/step (min-max)",
                "predicted MiB/rank", "measured MiB/rank", "runs", "flags"]
    else:
        how = (f"Every layout of {report['world_size']} ranks ran {report['steps']} steps; the fastest again in "
               f"{report['repeats'] - 1} more round(s).")
        head = ["candidate", "measured ms/step (min-max)", "measured MiB/rank", "runs", "flags"]
    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"{how} Step time: the workload's StepMeter; memory: the largest rank's peak in a warm-up "
                         f"step (its StepMeter's MemoryStep). Tune took {report['wall_s']:.0f} s."),
                    Table(head, [cells(r) for r in report["candidates"] if r["result"]])]
    if report["left_out"]:
        blocks += [Heading("Not measured (a refusal or failure; predicted, over the budget or slower)"),
                   Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
