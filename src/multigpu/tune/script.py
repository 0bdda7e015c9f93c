"""``multigpu tune script.py``: the fastest layout of a script that follows the layout contract, measured.

Told the script's model (``--model``, as ``multigpu forecast`` takes it, and ``--seq-len``), tune predicts
every layout as it predicts the recipe's (``_predict``: forecast's count of the model, the probes on the model
and on the script's own loop), prunes what the script would refuse or what does not fit, and measures the
``--top`` fastest predicted. Without it tune measures every layout: every ``Layout`` of N ranks
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
(``meter.evidence.thin_evidence``).
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
    if cfg.model is None:
        for flag, value in (("--memory-budget", cfg.memory_budget), ("--seq-len", cfg.seq_len)):
            if value is not None:
                raise UsageError(f"{flag} serves the prediction of a script's layouts, which needs its model: add "
                                 "--model (e.g. --model train.py:build_model) or drop " + flag)
        return
    if cfg.seq_len is None or cfg.seq_len < 1:
        raise UsageError("--model predicts the script's layouts from its sequence length: add --seq-len N (the tokens "
                         f"per sequence it trains on), got {cfg.seq_len}")
    global_batch(cfg.args)


def global_batch(args) -> int:
    """The script's ``--global-batch`` (the contract's flag) from its arguments: what a prediction divides."""
    args = list(args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--global-batch=") else \
            args[i + 1] if arg == "--global-batch" and i + 1 < len(args) else None
        if value is not None:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--global-batch takes a positive number of sequences, got {value!r}")
            return int(value)
    raise UsageError("--model predicts from the script's global batch: pass the script's --global-batch N after "
                     "the script (e.g. multigpu tune --model ... train.py --global-batch 16)")


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
    from ..parallel.space import layouts
    from .space import splits

    check_script_args(cfg)
    t_start = time.perf_counter()
    cfg, device = rounds.device_of(cfg)
    found = layouts(cfg.nproc, micro_batches=list(cfg.micro_batches) if cfg.micro_batches else None,
                    experts=cfg.experts, context=cfg.context)
    counted = _count(cfg) if cfg.model else None  # a model that does not load or count: one line, nothing written
    batch = global_batch(cfg.args) if cfg.model else None
    if cfg.model:  # predicted: each micro-batch that splits a rank's share and checkpointing weighed, as for the recipe
        found = [replace(layout, micro_batch=m, activation_checkpointing=ac) for layout in found
                 for m in ([layout.micro_batch] if layout.micro_batch else splits(batch // layout.dp_size) or [1])
                 for ac in (False, True)]
    rows = [_row(layout) for layout in found]
    if counted:  # what the script would refuse, before anything is written (all of it: one line)
        _prune(cfg, *counted, batch, rows)
    out = rounds.out_dir(cfg)
    where = f"{cfg.workload} on {cfg.nproc} {'CPU workers' if cfg.cpu else 'GPUs'}"
    if not cfg.model:
        say(f"multigpu tune: {where}: {len(found)} layouts, each measured for {cfg.steps} steps (with activation "
            f"checkpointing where one runs out of memory without), then {f'the {cfg.top} fastest' if cfg.top else 'every one'} "
            f"in {cfg.repeats - 1} more round(s) -> {out}")
    else:
        say(f"multigpu tune: {where}: {len(found)} layouts of {cfg.model}, each predicted (multigpu forecast's model, "
            f"this machine probed), {f'the {cfg.top} fastest' if cfg.top else 'every one'} that fit measured -> {out}")
    predicted = _predict(cfg, device, *counted, batch, rows, out, say) if counted else None
    if predicted is not None:
        chosen = sorted((r for r in rows if r["fits"]), key=lambda r: r["predicted"]["step_time_s"])
        chosen = chosen if cfg.top == 0 else chosen[:cfg.top]
        say(f"multigpu tune: measuring {len(chosen)} of {len(rows)} (fastest predicted that fit), {cfg.repeats} "
            f"round(s) of {cfg.steps} steps")

    def pick(round_: int) -> list[dict]:
        if predicted is not None:  # the fastest predicted, in every round
            return [r for r in chosen if round_ == 0 or r["measured"][0]["status"] == "ok"]
        if round_ == 0:
            return rows
        ok = sorted((r for r in rows if r["measured"][0]["status"] == "ok"),
                    key=lambda r: r["measured"][0]["step_time_s"])
        return ok if cfg.top == 0 else ok[:cfg.top]  # the fastest of the first round, again, interleaved

    def show(r: dict, m: dict) -> str:
        said = f"predicted {r['predicted']['step_time_s'] * 1e3:,.1f} ms -> " if r.get("predicted") else ""
        if m["status"] != "ok":
            return f"{said}left out: {m['error']}"
        mem = f", {m['memory_bytes'] / 2**20:,.1f} MiB" if "memory_bytes" in m else ""
        return f"{said}{m['step_time_s'] * 1e3:,.1f} ms/step{mem}"

    rounds.measure_rounds(rows, cfg.repeats, pick, lambda r, i: _measure(r["_l"], cfg, out, i), show, say,
                          retry=None if predicted else with_checkpointing)
    report = _report(cfg, rows, time.perf_counter() - t_start, predicted)
    rounds.write_report(report, _page(report), out, say)
    return out, report


def _count(cfg) -> tuple:
    """(the builder of ``cfg.model``, forecast's count of it at ``cfg.seq_len``): counted as built, in float32 (a
    script that trains under autocast holds less)."""
    import torch

    from ..forecast.counts import count
    from ..forecast.models import builder

    build, name = builder(cfg.model)
    return build, count(build, cfg.seq_len, name=name, dtype=torch.float32)


def _prune(cfg, build, counts, batch: int, rows: list[dict]) -> None:
    """Each row's ``pruned``: why the script would refuse its layout (``_refusal``), or None; a world where it
    refuses every one is one line."""
    refusal = _refusal(build, counts, cfg.seq_len, batch)
    for r in rows:
        r["pruned"] = refusal(r["_l"].resolve(cfg.nproc))
    if all(r["pruned"] for r in rows):
        raise UsageError(f"the script would refuse every layout of {cfg.nproc} ranks for {counts.name} "
                         f"({rows[0]['candidate']}: {rows[0]['pruned']}); change -n or the script's --global-batch")


def _predict(cfg, device: str, build, counts, batch: int, rows: list[dict], out: Path, say) -> dict:
    """Each row's prediction (``predicted``, ``fits``, ``pruned``) by forecast's model of the counted model on
    this machine, for the script's global ``batch``, as the recipe's tune predicts the GPT's
    (``machine.measure_parts``: the probes on the script's own model and loop, for the layouts ``_prune`` kept);
    returns what the report keeps of the probe."""
    from . import machine, wrappers

    resolved = [r["_l"].resolve(cfg.nproc) for r in rows]
    kept = [r["_l"] for r in rows if not r["pruned"]]
    subject = wrappers.built(build, counts.vocab, cfg.seq_len)
    parts = machine.measure_parts(subject, kept, cfg.nproc, device, cfg.threads, say,
                                  recipe_args=cfg.args, root=out / "probe", workload=cfg.workload, module=False)
    budget, budget_text = machine.budget_of(cfg, device)
    here = machine.measured_cluster(counts, parts, cfg.nproc, budget)
    for r, layout in zip(rows, resolved):
        p = None if r["pruned"] else machine.predict(layout, counts, here, parts, batch)
        r["predicted"], r["fits"] = p, p is not None and p["fits"]
        r["pruned"] = r["pruned"] or machine.pruned(p, here)
    return {"model": counts.name, "global_batch": batch, "budget": budget_text} | machine.probe_record(parts)


def _refusal(build, counts, seq_len: int, batch: int) -> Callable:
    """Why the script would refuse a resolved layout for the counted model, as ``mg.parallelize``,
    ``mg.parallel.pipeline`` and the batch plan refuse it (a TP degree its heads or vocabulary do not divide,
    tensor parallelism for a model with no plan it declares or that can be found, more stages than blocks, a
    model the pipeline cannot cut, a batch that does not split), or None. A tied head is no refusal: the
    pipeline keeps a copy of the table on each stage that uses it."""
    import torch

    from ..parallel import auto
    from ..parallel.spread import tensor_parallel_plan
    from ..parallel.stages import split
    from .space import pipeline_short

    with torch.device("meta"):  # the model, to ask for its TP plan as mg.parallelize does (no memory)
        model = build()
    blocks = auto.block_modules(model)
    cuts: dict[int, str | None] = {}  # stages -> why mg.parallel.pipeline cannot cut the model so, or None

    def uncut(layout) -> str | None:  # the cut alone (no probe on a meta model), once per stage count
        if layout.stages not in cuts:
            try:
                split(model, layout, layout.stages)
                cuts[layout.stages] = None
            except UsageError as err:
                cuts[layout.stages] = str(err)
        return cuts[layout.stages]

    def why(layout) -> str | None:
        try:
            layout.check_sizes(heads=counts.heads or None, kv_heads=counts.kv_heads or None,
                               vocab=counts.vocab or None, seq=seq_len, blocks=counts.layers, model=counts.name)
            if layout.tp > 1:
                tensor_parallel_plan(model, layout, blocks, None, derive_sequence_parallel=layout.pp == 1)
            return (uncut(layout) if layout.pp > 1 else None) or pipeline_short(layout, batch)
        except UsageError as err:
            return str(err)

    return why


def _report(cfg, rows: list[dict], wall_s: float, predicted: dict | None = None) -> dict:
    for r in rows:
        r.pop("_l", None)
        r["result"] = rounds.summary(r["measured"])
        if r["result"] and r.get("predicted"):
            r["error"] = {"step_time": r["predicted"]["step_time_s"] / r["result"]["step_time_s"] - 1} | (
                {"memory": r["predicted"]["memory_bytes"] / r["result"]["memory_bytes"] - 1}
                if "memory_bytes" in r["result"] else {})
    ran = sorted((r for r in rows if r["result"]), key=lambda r: r["result"]["step_time_s"])
    # Not measured: a refusal or failure (its line), or, with a prediction, slower predicted or over the budget.
    left_out = [{"layout": r["candidate"], "reason": r["measured"][0]["error"] if r["measured"] else r.get("pruned")
                 or f"slower predicted ({r['predicted']['step_time_s'] * 1e3:,.1f} ms/step)"}
                for r in sorted((r for r in rows if not r["result"]), key=lambda r: not r["measured"])]
    winner = ran[0] if ran else None
    base = f"multigpu run -n {cfg.nproc}{' --cpu' if cfg.cpu else ''} {cfg.workload} {' '.join(cfg.args)}".rstrip()
    if winner:
        cmd = f"{base} {' '.join(winner['args'])}".rstrip()
        verdict = (f"multigpu tune: fastest measured: {winner['candidate']}: {winner['result']['step_time_s'] * 1e3:,.1f} "
                   f"ms/step (median of {winner['result']['runs']}); run it with: {cmd}")
    else:
        first = f" ({left_out[0]['layout']}: {left_out[0]['reason']})" if left_out else ""
        cmd, verdict = None, f"multigpu tune: no layout was measured{first}; every reason is in the report"
    report = {"workload": cfg.workload, "world_size": cfg.nproc, "device": "cpu" if cfg.cpu else "cuda",
              "threads_per_worker": cfg.threads if cfg.cpu else None, "steps": cfg.steps, "repeats": cfg.repeats,
              "top": cfg.top, "candidates": ran + [r for r in rows if not r["result"]], "left_out": left_out,
              "winner": winner["candidate"] if winner else None, "command": cmd, "verdict": verdict, "wall_s": wall_s}
    if predicted is not None:
        report |= {"prediction": predicted, "prediction_error": rounds.errors(rows)}
    return report


def _page(report: dict) -> Page:
    predicted = report.get("prediction")

    def cells(r: dict) -> list[str]:
        res = r["result"]
        mem = f"{res['memory_bytes'] / 2**20:,.1f}" if "memory_bytes" in res else "-"
        got = [r["candidate"], f"{res['step_time_s'] * 1e3:,.1f} ({res['min_s'] * 1e3:,.1f}-{res['max_s'] * 1e3:,.1f})",
               mem, str(res["runs"]), " ".join(r["args"]) or "(none)"]
        if predicted is None:
            return got
        p = r["predicted"]
        return got[:1] + [f"{p['step_time_s'] * 1e3:,.1f}"] + got[1:2] + [f"{p['memory_bytes'] / 2**20:,.2f}"] + got[2:]

    if predicted is None:
        how = (f"Every layout of {report['world_size']} ranks ran the script for {report['steps']} steps; the fastest "
               f"again in {report['repeats'] - 1} more round(s).")
        head = ["layout", "measured ms/step (min-max)", "peak MiB", "runs", "flags"]
    else:
        how = (f"Every layout of {report['world_size']} ranks was predicted by multigpu forecast's model of "
               f"{predicted['model']} (global batch {predicted['global_batch']}; memory budget: {predicted['budget']}), "
               f"this machine described by its probe (docs/tune.md); the fastest predicted that fit ran the script for "
               f"{report['steps']} steps in {report['repeats']} round(s). {rounds.error_line(report['prediction_error'])}")
        head = ["layout", "predicted ms/step", "measured ms/step (min-max)", "predicted MiB", "peak MiB", "runs", "flags"]
    blocks: list = [Text(report["verdict"].removeprefix("multigpu tune: ") + ".", lead=True),
                    Text(f"{how} Step time: the script's StepMeter; peak memory: the largest rank's in a warm-up step "
                         f"(its StepMeter's MemoryStep). Tune took {report['wall_s']:.0f} s."),
                    Table(head, [cells(r) for r in report["candidates"] if r["result"]])]
    if report["left_out"]:
        blocks += [Heading("Not measured (the script's own refusal or failure; with a prediction, slower or over "
                           "the budget)" if predicted else "Left out (the script's own refusal or failure)"),
                   Items([f"{o['layout']}: {o['reason']}" for o in report["left_out"]])]
    return Page(f"multigpu tune: {report['workload']} on {report['world_size']} ranks ({report['device']})", blocks)
