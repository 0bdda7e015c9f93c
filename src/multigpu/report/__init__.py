"""Reports: one page writer (``page.py``: Markdown and self-contained HTML) for `multigpu study`
and `multigpu tune`, and the study's report (``study.py``), which `multigpu report` rewrites."""

from __future__ import annotations

from .study import load_study, write_report

__all__ = ["add_arguments", "load_study", "main", "write_report"]


def add_arguments(parser) -> None:
    """`multigpu report RESULTS [-o report.html]` arguments."""
    parser.add_argument("results", help="the results directory `multigpu study` wrote")
    parser.add_argument("-o", "--output", default=None, help="HTML file to write (default: RESULTS/report.html)")


def main(args) -> int:
    html_path, md_path = write_report(args.results, args.output)
    print(f"multigpu report: {html_path} (self-contained) and {md_path}")
    return 0
