"""Reports: one page writer (``page.py``: Markdown and self-contained HTML) for `multigpu study`
and `multigpu tune`, and the study's report (``study.py``), which `multigpu report` rewrites."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.fields import add_field
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
    html_path, md_path = write_report(cfg.results, cfg.output)
    print(f"multigpu report: {html_path} (self-contained) and {md_path}")
    return 0
