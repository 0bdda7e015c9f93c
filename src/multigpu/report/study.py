"""Turn a study's ``study.json`` into a self-contained HTML report and a Markdown summary.

Plots are drawn with matplotlib (Agg, no display); ``page.py`` embeds them in the
HTML as base64 PNGs, so the page needs no network and no other file, and writes
the same PNGs next to ``report.md`` for Markdown viewers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .page import Figures, Heading, Items, Page, Pairs, Table, Text, write
from .plots import one_point, png, pyplot

BREAKDOWN = ("compute", "comm_exposed", "data_wait", "idle")


def load_study(results_dir: str | Path) -> dict[str, Any]:
    path = Path(results_dir) / "study.json"
    if not path.is_file():
        raise UsageError(f"{results_dir} holds neither study.json nor a metrics.jsonl with records; pass the directory "
                         "`multigpu study` wrote, or a run directory of a script that uses mg.StepMeter")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); rerun the study") from None


def _label(group: dict[str, Any]) -> str:
    layout = group.get("layout") or ""
    return f"{group['workers']}w {layout + ' ' if layout else ''}{group['policy']}"


def _throughput(plt, groups: list[dict[str, Any]], lines: list[tuple[str, str]]):
    """Throughput and efficiency over the workers, one line per (policy, layout); None: no group has a rate."""
    measured = [g for g in groups if g.get("samples_per_s")]
    if not measured:
        return None

    def efficiency(g: dict[str, Any]) -> float:  # the baseline's is 1 by definition; a group without one: no point
        base = g["workers"] == 1 and not g.get("layout")
        return 100.0 if base else 100 * (g.get("efficiency") or {}).get("mean", math.nan)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for pol, layout in lines:
        gs = sorted((g for g in measured if g["policy"] == pol and (g.get("layout") or "") in {layout, ""}),
                    key=lambda g: g["workers"])
        if not gs:
            continue
        w = [g["workers"] for g in gs]
        name = f"{layout} {pol}" if layout else pol
        ax1.errorbar(w, [g["samples_per_s"]["mean"] for g in gs], yerr=[g["samples_per_s"]["std"] for g in gs],
                     marker="o", capsize=3, label=name)
        ax2.plot(w, [efficiency(g) for g in gs], marker="o", label=name)
    all_w = sorted({g["workers"] for g in groups})
    ax1.set(xlabel="workers", ylabel="samples/s", title="Throughput", xticks=all_w)
    ax2.axhline(100, color="grey", lw=0.8, ls="--")
    ax2.set(xlabel="workers", ylabel="scaling efficiency (%)", title="Efficiency vs 1 worker", xticks=all_w)
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    return fig


def _figures(study: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(name -> matplotlib figure for every plot the data supports, why each other plot is not drawn)."""
    plt = pyplot()
    missing: list[str] = []
    groups, runs = study["groups"], study["runs"]
    # One line per policy over the world sizes; in a layout study one per (policy, layout), from one worker.
    layouts = sorted({g.get("layout") or "" for g in groups} - {""})
    lines = [(pol, lay) for pol in sorted({g["policy"] for g in groups}) for lay in (layouts or [""])]
    figs: dict[str, Any] = {}

    fig = _throughput(plt, groups, lines)
    if fig is None:
        missing.append("No throughput plot: no run gave a rate (every run failed or was too short to judge, "
                       "listed above)")
    else:
        figs["throughput"] = fig

    # The losses of runs too short to judge are still what they trained: drawn, and marked so.
    curves = [r for r in runs if r.get("status") in ("ok", "short") and r.get("curve", {}).get("samples")]
    if curves:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in curves:
            style = dict(lw=2.2, color="black") if r["workers"] == 1 else dict(lw=1.2)
            style |= one_point(r["curve"]["samples"])
            name = _label(r) + (f" #{r['repeat']}" if r.get("repeat") else "") + (" (too short)" if r["status"] == "short" else "")
            ax1.plot(r["curve"]["samples"], r["curve"]["loss"], label=name, **style)
            ax2.plot(r["curve"]["wall_s"], r["curve"]["loss"], label=name, **style)
        scale = "log" if all(v > 0 for r in curves for v in r["curve"]["loss"]) else "linear"  # log hides a loss <= 0
        ax1.set(xlabel="samples seen", ylabel="training loss", title="Loss vs samples (1 worker in black)", yscale=scale)
        ax2.set(xlabel="wall time (s)", ylabel="training loss", title="Loss vs wall time", yscale=scale)
        ax1.legend(fontsize=7)
        fig.tight_layout()
        figs["loss"] = fig
    else:
        missing.append("No loss plot: no finished run logged a loss (pass it to meter.step_end(loss=...))")

    with_breakdown = [g for g in groups if g.get("breakdown") and any(g["breakdown"].get(k) for k in BREAKDOWN)]
    if with_breakdown:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        labels = [_label(g) for g in with_breakdown]
        bottom = [0.0] * len(with_breakdown)
        for key in BREAKDOWN:
            vals = [100 * (g["breakdown"].get(key) or 0.0) for g in with_breakdown]
            ax.bar(labels, vals, bottom=bottom, label=key.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(ylabel="% of step time", title="Where the step time goes")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        figs["breakdown"] = fig
    else:
        missing.append("No time-breakdown plot: no group has a judged run with a measured time breakdown")

    noisy = [r for r in runs if r.get("status") == "ok" and r.get("noise", {}).get("samples")]
    if noisy:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for r in noisy:
            line = ax.plot(r["noise"]["samples"], r["noise"]["b_simple"], label=f"B_simple {_label(r)}",
                           **one_point(r["noise"]["samples"]))
            ax.axhline(r["global_batch"], color=line[0].get_color(), ls=":", lw=1)
        ax.set(xlabel="samples seen", ylabel="examples", yscale="log",
               title="Gradient noise scale (dotted: global batch)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        figs["noise"] = fig
    else:
        missing.append("No noise-scale plot: no run logged noise/b_simple (meter.log(noise.metrics()), on 2 or more "
                       "workers)")
    return figs, missing


def _fmt(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    mean = stat["mean"] * scale
    std = (stat.get("std") or 0.0) * scale
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std else "") + unit


def _ratio(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """A speedup or efficiency: the paired mean with its 95 % interval where there is one (2+ rounds)."""
    if not stat or stat.get("mean") is None:
        return "–"
    text = f"{stat['mean'] * scale:.{digits}f}{unit}"
    if stat.get("low") is not None:
        text += f" ({stat['low'] * scale:.{digits}f}-{stat['high'] * scale:.{digits}f}{unit})"
    return text


def _rows(study: dict[str, Any]) -> list[list[str]]:
    rows = []
    layouts = any(g.get("layout") for g in study["groups"])
    for g in sorted(study["groups"], key=lambda g: (g["policy"], g["workers"], g.get("layout") or "")):
        rows.append([
            str(g["workers"]) + (f" {g.get('layout') or '(one process)'}" if layouts else ""), g["policy"],
            str(g.get("global_batch", "–")),
            _fmt(g.get("samples_per_s"), digits=0), _ratio(g.get("speedup"), unit="x"),
            _ratio(g.get("efficiency"), 100, 0, " %"), _fmt(g.get("accuracy"), 100, 2, " %"),
            _fmt(g.get("to_target_s"), digits=1, unit=" s"),
            f"{g['noise_scale']:.0f}" if g.get("noise_scale") else "–",
            g.get("verdict", ""),
        ])
    return rows


# samples/s, accuracy, time to target: mean ± standard deviation over rounds; speedup and efficiency: the
# mean of each round's ratio (geometric) with its 95 % interval, as the headline and the verdict give them.
HEADER = ["workers", "policy", "global batch", "samples/s", "speedup (95 % interval)", "efficiency (95 % interval)", "accuracy",
          "time to target", "noise scale", "verdict"]


def study_page(study: dict[str, Any], pngs: dict[str, bytes], missing: list[str] = ()) -> Page:
    """The study's report: headline, the table of results and verdicts, failed and short runs, plots (and why
    any is not drawn), environment."""
    blocks: list = [Text(study.get("headline", ""), lead=True), Heading("Results and verdicts"),
                    Table(HEADER, _rows(study))]
    failed = [r for r in study["runs"] if r.get("status") not in ("ok", "short")]
    if failed:
        blocks += [Heading("Failed runs"), Items([f"{r['id']}: {r.get('error', '?')}" for r in failed])]
    short = [r for r in study["runs"] if r.get("status") == "short"]
    if short:
        blocks += [Heading("Runs too short to judge (left out of every verdict)"),
                   Items([f"{r['id']}: {r.get('error', '?')}" for r in short])]
    blocks += [Heading("Plots"), Figures(pngs)] + ([Items(list(missing))] if missing else [])
    blocks += [Heading("Environment"), Pairs(study.get("fingerprint", {}))]
    return Page(f"Scaling study: {study['workload']['name']}", blocks)


def write_report(results_dir: str | Path, output: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` (self-contained) and ``report.md`` for a study; returns both paths.

    >>> html_path, md_path = write_report("studies/digits")
    """
    results_dir = Path(results_dir)
    html_path = Path(output) if output else results_dir / "report.html"
    if html_path.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"report output must end in .html, got {html_path}; e.g. -o report.html")
    study = load_study(results_dir)
    figs, missing = _figures(study)
    pngs = {name: png(fig) for name, fig in figs.items()}
    md_path = results_dir / "report.md"
    try:
        write(study_page(study, pngs, missing), md_path, html_path)
    except OSError as err:
        raise UsageError(f"cannot write the report to {html_path.parent} ({err.strerror}); pass -o to a writable path") from None
    return html_path, md_path
