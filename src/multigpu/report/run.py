"""The report of one run: what `multigpu report` writes for a run directory (``metrics.jsonl``, what
``mg.StepMeter`` wrote under `multigpu run`), through the same page writer as a study's.

It says what the meter measured (samples/s as total samples over total time of the measured steps, the
step time, the steps it left out and why), draws the loss over samples and wall time (a single point
shown as one), and says in one line when the run is too short to judge, or why a plot is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..meter.quorum import text as quorum_text
from ..meter.records import read_records
from .page import Figures, Heading, Items, Page, Pairs, Text, write
from .plots import one_point, png, pyplot


def load_run(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    records = read_records(metrics) if metrics.is_file() else []
    if not records:
        raise UsageError(f"{run_dir} holds neither study.json nor a metrics.jsonl with records; pass the directory "
                         "`multigpu study` wrote, or a run directory of a script that uses mg.StepMeter")
    return records


def _loss_figure(steps: list[dict[str, Any]]):
    with_loss = [r for r in steps if r.get("loss") is not None]
    if not with_loss:
        return None
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    samples, times, losses = ([r.get(k) for r in with_loss] for k in ("samples_seen", "time", "loss"))
    ax1.plot(samples, losses, lw=1.8, **one_point(samples))
    ax2.plot(times, losses, lw=1.8, **one_point(times))
    scale = "log" if all(v > 0 for v in losses) else "linear"
    ax1.set(xlabel="samples seen", ylabel="training loss", title="Loss vs samples", yscale=scale)
    ax2.set(xlabel="wall time (s)", ylabel="training loss", title="Loss vs wall time", yscale=scale)
    fig.tight_layout()
    return fig


def run_page(run_dir: Path, records: list[dict[str, Any]], pngs: dict[str, bytes], missing: list[str]) -> Page:
    from ..meter.evidence import steps_asked, thin_evidence

    summary = next((r for r in reversed(records) if r.get("type") == "summary"), None)
    header = next((r for r in records if r.get("type") == "header"), {})
    # the steps asked: the script's own --steps, from the command line its fingerprint recorded
    thin = thin_evidence(records, steps_asked((header.get("fingerprint") or {}).get("argv", [])[1:]))
    if summary is None:
        lead = "No summary: the run ended before meter.close(), so no rate was measured"
    elif thin:
        lead = f"Too short to judge: {thin}"
    else:
        lead = (f"{summary['samples_per_s']:,.1f} samples/s over steps {summary['rate_steps'][0]}-"
                f"{summary['rate_steps'][1]}, {1000 * summary['step_time']:.1f} ms per step")
    blocks: list = [Text(lead, lead=True)]
    if summary is not None:
        measured = summary.get("measured") or {}
        spread = (summary.get("intervals") or {}).get("samples_per_s") or {}
        blocks += [Heading("Measured"), Pairs({k: v for k, v in {
            "steps": summary.get("steps"), "samples seen": summary.get("samples_seen"),
            "wall time (s)": round(summary.get("wall_time", 0.0), 2),
            "samples/s": round(summary["samples_per_s"], 2),
            "step time (ms)": round(1000 * summary["step_time"], 2),
            "measured": f"{measured.get('steps')} steps in {measured.get('intervals')} intervals, "
                        f"{measured.get('time_s', 0.0):.2f} s",
            "samples/s per interval": ", ".join(f"{k} {v:,.1f}" for k, v in spread.items() if k != "n") or "one interval",
            "left out": "; ".join(f"steps {o['steps'][0]}-{o['steps'][1]} ({o['why']})"
                                  for o in measured.get("left_out", ())) or "nothing",
            "time shares": ", ".join(f"{k} {100 * v:.0f} %" for k, v in (summary.get("fractions") or {}).items()),
            "peak memory (GB)": round(summary.get("peak_mem_gb") or 0.0, 3),
            "MFU": summary.get("mfu")}.items() if v is not None})]
    experts = (summary or {}).get("experts")
    if experts:  # expert parallelism's dispatch (mg.parallelize with ep)
        tokens = experts["tokens"]
        blocks += [Heading("Experts"), Pairs({
            "tokens per expert": ", ".join(f"{t:,.0f}" for t in tokens),
            "imbalance (max / mean tokens, worst layer and interval)": round(experts["imbalance"], 3),
            "imbalance over the run": round(max(tokens) / (sum(tokens) / len(tokens)), 3) if sum(tokens) else None,
            "dropped (token, expert) pairs": f"{experts['dropped']:,.0f}",
            "all-to-all share of step time": f"{100 * experts['a2a_share']:.1f} %"})]
    replicas = (summary or {}).get("replicas")
    if replicas:  # mg.fault_tolerant's quorums, as this group saw them
        blocks += [Heading("Replica groups"), Text(quorum_text(replicas)), Items(
            [f"from step {c['step']}: groups {', '.join(map(str, c['groups']))} of {replicas['groups']}"
             for c in replicas["changes"]])]
    blocks += [Heading("Plots"), Figures(pngs)] + ([Items(missing)] if missing else [])
    env = header.get("fingerprint") or {}
    if env:
        blocks += [Heading("Environment"), Pairs(env)]
    return Page(f"Run: {run_dir.name}", blocks)


def write_run_report(run_dir: Path, html_path: Path) -> tuple[Path, Path]:
    """``report.html`` and ``report.md`` for one run directory."""
    if html_path.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"report output must end in .html, got {html_path}; e.g. -o report.html")
    records = load_run(run_dir)
    fig = _loss_figure([r for r in records if r.get("type") == "step"])
    pngs = {"loss": png(fig)} if fig is not None else {}
    missing = [] if fig is not None else ["No loss plot: the run logged no loss (pass it to meter.step_end(loss=...))"]
    md_path = run_dir / "report.md"
    try:
        write(run_page(run_dir, records, pngs, missing), md_path, html_path)
    except OSError as err:
        raise UsageError(f"cannot write the report to {html_path.parent} ({err.strerror}); pass -o to a writable path") from None
    return html_path, md_path
