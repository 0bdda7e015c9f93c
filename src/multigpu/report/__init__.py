"""Reports: one page writer (``page.py``: Markdown and self-contained HTML) for `multigpu study`
and `multigpu tune`, and the study's report (``study.py``), which `multigpu report` rewrites."""

from __future__ import annotations

from dataclasses import dataclass

from pathlib import Path

from ..errors import UsageError
from ..runtime.fields import add_field

from .run import write_run_report
from .study import load_study, write_report

__all__ = ["ReportConfig", "add_arguments", "load_study", "main", "write_report"]


@dataclass(frozen=True)
class ReportConfig:
    """What ``multigpu report`` was asked to write. Each field's docstring is its argument's help in
    `multigpu report --help` (``add_arguments``)."""

    results: str
    """the results directory `multigpu study` wrote, one run's directory (its metrics.jsonl), or a folder
    holding one of them (`multigpu run --log-dir`)"""
    output: str | None = None
    """HTML file to write (default: RESULTS/report.html)"""


def add_arguments(parser) -> None:
    """`multigpu report RESULTS [-o report.html]` arguments."""
    add_field(parser, "results", config=ReportConfig, field="results")
    add_field(parser, "-o", "--output", config=ReportConfig, field="output")


def _is_results(path: Path) -> bool:
    return (path / "study.json").is_file() or (path / "metrics.jsonl").is_file()


def find_results(given: Path) -> Path:
    """The study or run directory ``given`` names: itself, or its one subfolder that is one (``multigpu run
    --log-dir DIR`` keeps each run in ``DIR/<run>``). Several: one line listing them, newest first."""
    if _is_results(given) or not given.is_dir():
        return given
    found = sorted((p for p in given.iterdir() if p.is_dir() and _is_results(p)),
                   key=lambda p: max(f.stat().st_mtime for f in (p / "study.json", p / "metrics.jsonl") if f.is_file()),
                   reverse=True)
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(p.name for p in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise UsageError(f"{given} holds {len(found)} runs ({names}; newest first); pass one, e.g. "
                         f"multigpu report {found[0]}")
    return given  # neither: the study's reader says what it expected


def main(args) -> int:
    cfg = ReportConfig(results=args.results, output=args.output)
    results = find_results(Path(cfg.results))
    if (results / "study.json").is_file() or not (results / "metrics.jsonl").is_file():
        html_path, md_path = write_report(results, cfg.output)
    else:  # one run's directory (`multigpu run`, mg.StepMeter)
        html_path, md_path = write_run_report(results, Path(cfg.output) if cfg.output else results / "report.html")
    found = f" (the one run in {cfg.results})" if results != Path(cfg.results) else ""
    print(f"multigpu report: {html_path} (self-contained) and {md_path}{found}")
    return 0
