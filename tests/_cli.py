"""Run the ``multigpu`` CLI in the test process, as a user would, and keep what it said."""

from __future__ import annotations


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``multigpu *argv``: (exit code, stderr); argparse's own errors end in SystemExit."""
    from multigpu.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err
