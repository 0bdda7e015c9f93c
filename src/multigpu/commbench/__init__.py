"""``multigpu bench``: collective benchmark with nccl-tests' columns and formulas.

>>> from multigpu.commbench import BenchConfig, run_bench
>>> result = run_bench(BenchConfig(ops=("all_reduce",), sizes=(1024, 2048)), nproc=2)
>>> result["rows"][0]["in"]["busbw"]   # GB/s, max time over ranks

Same code on GPU (nccl, CUDA events) and CPU (gloo, wall clock after a
barrier). Run under torchrun (or ``multigpu run``) it measures the launched
job in place, across nodes too; otherwise it starts ``nproc`` local ranks.
"""

from __future__ import annotations

import argparse

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

__all__ = ["BenchConfig", "DdpConfig", "LaunchError", "add_arguments", "algbw", "bus_factor", "format_table",
           "launch_local", "main", "parse_sizes", "run_bench"]

_LAZY = {"BenchConfig": "spec", "algbw": "spec", "bus_factor": "spec", "parse_sizes": "spec", "DdpConfig": "ddp",
         "LaunchError": "launch", "launch_local": "launch", "format_table": "run", "run_bench": "run"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=None, help="ranks to start (default: GPUs visible, else 2)")
    parser.add_argument("--ops", nargs="+", default=None, metavar="OP", help=f"collectives (default all): {', '.join(OPS)}")
    parser.add_argument("--sizes", default=None, help="MIN:MAX swept by factor 2, or a comma list; K, M, G "
                        "and KiB, MiB, GiB binary, KB, MB, GB decimal (default 8:256M on GPU, 8:4M on CPU)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), float16, bfloat16, float64, int8, uint8, int32, int64")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20, as nccl-tests)")
    parser.add_argument("--backend", choices=("nccl", "gloo", "mpi"), default=None, help="default: nccl with GPUs, else gloo")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check (#wrong shows N/A)")
    parser.add_argument("--ddp", metavar="MODEL", default=None, help="also time a DDP step's gradient all-reduce for MODEL: "
                        "gpt2-small, gpt2-medium, gpt2-tiny or package.module:factory")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size for --ddp (default 25)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck rendezvous/collective fails")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def main(args: argparse.Namespace) -> int:
    """Entry of ``multigpu bench``: 0 when every check passed, 1 on wrong results or a failed rank."""
    from .run import main as run_main

    return run_main(args)
