"""The forecast's files: forecast.json (every layout, every part), report.md and report.html (the ranked
table, the assumptions, and the memory and step-time breakdowns of the best layouts as stacked bars)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..report.page import Figures, Heading, Items, Page, Table, Text, write
from .cost import GiB


def row(f: dict) -> list[str]:
    return [f["name"], f"{f['memory_bytes'] / GiB:.1f}", "yes" if f["fits"] else "no", f"{f['step_s']:.2f}",
            f"{f['tokens_per_s_per_gpu']:,.0f}", f"{100 * f['mfu']:.1f}"]


HEADER = ["layout", "GiB/GPU", "fits", "step s", "tokens/s/GPU", "MFU %"]


def _bars(forecasts: list[dict], part: str, scale: float, unit: str) -> bytes:
    from ..report.plots import png, pyplot

    plt = pyplot()
    names = [f["name"] for f in forecasts][::-1]
    parts = list(dict.fromkeys(k for f in forecasts for k in f[part]))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 2.2))
    left = [0.0] * len(names)
    for k in parts:
        widths = [f[part].get(k, 0.0) / scale for f in forecasts][::-1]
        ax.barh(names, widths, left=left, label=k)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel(unit)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)  # below the bars
    fig.tight_layout()
    return png(fig)


def write_all(out: Path, title: str, ranked: list[dict], left_out: list[dict], top: int, assumptions,
              context: dict, command: str | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)  # forecast's main checked it can
    best = ranked[:top]
    data = {"context": context, "assumptions": dataclasses.asdict(assumptions), "command": command,
            "forecasts": [{k: (v.flags if k == "layout" else v) for k, v in f.items()} for f in ranked],
            "left_out": left_out}
    (out / "forecast.json").write_text(json.dumps(data, indent=1, default=str))
    blocks = [Text(f"Best: {best[0]['name']}: {best[0]['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                   f"{best[0]['memory_bytes'] / GiB:.1f} GiB per GPU" + ("" if best[0]["fits"] else " (does not fit)"),
                   lead=True),
              Text(f"Run it: {command}" if command else f"Not run: multigpu does not build it: {best[0]['unbuilt']}"),
              Heading(f"The {len(best)} fastest of {len(ranked)} layouts"), Table(HEADER, [row(f) for f in best]),
              Heading("Memory per GPU and step time, by part"),
              Figures({"memory": _bars(best, "memory", GiB, "GiB per GPU"), "time": _bars(best, "time", 1.0, "seconds per step")}),
              Heading("Assumptions (each a flag of multigpu forecast)"),
              Items([f"{k} = {v}" for k, v in dataclasses.asdict(assumptions).items()]),
              Heading("Machine and run"), Items([f"{k}: {v}" for k, v in context.items()])]
    if left_out:
        reasons = {}
        for o in left_out:
            reasons.setdefault(o["reason"], o["layout"])
        blocks += [Heading("Left out"), Items([f"{r} (e.g. {lay})" for r, lay in reasons.items()])]
    write(Page(title, blocks), out / "report.md", out / "report.html")
    return out / "report.html"
