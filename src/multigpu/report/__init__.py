"""Reports: one page writer (``page.py``: Markdown and self-contained HTML) for `multigpu study`
and `multigpu tune`, and the study's report (``study.py``), which `multigpu report` rewrites."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.fields import add_field
from pathlib import Path

from .run import write_run_report
from .study import load_study, write_report

__all__ = ["ReportConfig", "add_arguments", "load_study", "main", "write_report"]


@dataclass(frozen=True)
class ReportConfig:
    """What ``multigpu report`` was asked to write. Each field's docstring is its argument's help in
    `multigpu report --help` (``add_arguments``)."""

    results: str
    """the results directory `multigpu study` wrote, or one run's directory (its metrics.jsonl)"""
    output: str | None = None
    """HTML file to write (default: RESULTS/report.html)"""


def add_arguments(parser) -> None:
    """`multigpu report RESULTS [-o report.html]` arguments."""
    add_field(parser, "results", config=ReportConfig, field="results")
    add_field(parser, "-o", "--output", config=ReportConfig, field="output")


def main(args) -> int:
    cfg = ReportConfig(results=args.results, output=args.output)
    results = Path(cfg.results)
    if (results / "study.json").is_file() or not (results / "metrics.jsonl").is_file():
        html_path, md_path = write_report(results, cfg.output)
    else:  # one run's directory (`multigpu run`, mg.StepMeter)
        html_path, md_path = write_run_report(results, Path(cfg.output) if cfg.output else results / "report.html")
    print(f"multigpu report: {html_path} (self-contained) and {md_path}")
    return 0
