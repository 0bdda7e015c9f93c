"""``multigpu bench``: collective benchmark with nccl-tests' columns and formulas; ``--precision bf16,fp8``
times training steps in two precisions instead (precision.py).

>>> from multigpu.commbench import BenchConfig, run_bench
>>> result = run_bench(BenchConfig(ops=("all_reduce",), sizes=(1024, 2048)), nproc=2)
>>> result["rows"][0]["in"]["busbw"]   # GB/s, max time over ranks

Same code on GPU (nccl, CUDA events) and CPU (gloo, wall clock after a
barrier). Run under torchrun (or ``multigpu run``) it measures the launched
job in place, across nodes too; otherwise it starts ``nproc`` local ranks.
"""

from __future__ import annotations

import argparse
import functools

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

__all__ = ["BenchCommand", "BenchConfig", "DdpConfig", "LaunchError", "add_arguments", "algbw", "bus_factor",
           "format_table", "launch_local", "main", "parse_sizes", "run_bench"]

_LAZY = {"BenchCommand": "spec", "BenchConfig": "spec", "algbw": "spec", "bus_factor": "spec",
         "parse_sizes": "spec", "DdpConfig": "ddp", "LaunchError": "launch", "launch_local": "launch",
         "format_table": "run", "run_bench": "run"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..runtime.fields import add_field
    from .spec import CPU_SIZES, GPU_SIZES, BenchCommand

    # The named values are the ones the help quotes from constants written once (the ops, the size sweeps).
    bench = functools.partial(add_field, parser, config=BenchCommand,
                              values={"OPS": ", ".join(OPS), "GPU_SIZES": GPU_SIZES, "CPU_SIZES": CPU_SIZES})
    bench("-n", "--nproc", field="nproc", type=int)  # None: the visible GPUs, else 2, chosen in main
    bench("--ops", field="ops", nargs="+", metavar="OP")
    bench("--sizes", field="sizes")
    bench("--dtype", field="dtype")
    bench("--warmup", field="warmup", type=int)
    bench("--iters", field="iters", type=int)
    bench("--backend", field="backend", choices=("nccl", "gloo", "mpi"))
    bench("--group-size", field="group_size", type=int, metavar="G")
    bench("--no-check", field="no_check", action="store_true")
    bench("--ddp", field="ddp", metavar="MODEL")
    bench("--bucket-cap-mb", field="bucket_cap_mb", type=float)
    bench("--timeout", field="timeout", type=float)
    bench("--json", field="json", action="store_true")
    from .precision import PrecisionBench

    steps = functools.partial(add_field, parser, config=PrecisionBench)
    steps("--precision", field="precision", metavar="BASE,OTHER")
    steps("--model", field="model")
    steps("--seq-len", field="seq_len", type=int)
    steps("--batch", field="batch", type=int)
    steps("--rounds", field="rounds", type=int)
    steps("--compile", field="compile", action="store_true")
    steps("--fp8-recipe", field="fp8_recipe", choices=("tensorwise", "rowwise"))
    steps("--fp8-include", field="fp8_include", metavar="NAME,...")
    steps("--fp8-exclude", field="fp8_exclude", metavar="NAME,...")


def main(args: argparse.Namespace) -> int:
    """Entry of ``multigpu bench``: 0 when every check passed, 1 on wrong results or a failed rank; with
    ``--precision``, training steps in two precisions instead (precision.py)."""
    if args.precision is not None:
        from .precision import main as precision_main

        return precision_main(args)
    from .run import main as run_main

    return run_main(args)
