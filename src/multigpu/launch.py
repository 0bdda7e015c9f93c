"""`multigpu run`: placeholder until the launcher lands (see the spine issue)."""

from __future__ import annotations

import argparse


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", nargs="?", help="training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError("launcher not built yet")
