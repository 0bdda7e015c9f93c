"""Running the benchmark: launch ranks (or join the launched job), collect, format (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ..errors import UsageError
from ..runtime.fingerprint import fingerprint
from .ddp import DdpConfig
from .launch import LaunchError, launch_local
from .spec import (CPU_SIZES, GPU_SIZES, BenchCommand, BenchConfig, bus_factor, parse_dtype, parse_ops,
                   parse_sizes)


@record
def bench_rank(cfg: BenchConfig, ddp: DdpConfig | None, timeout: float) -> dict | None:
    """One rank of the benchmark (module level so that launched workers can import it)."""
    import torch

    from ..dist import init
    from .ddp import measure_ddp
    from .measure import measure

    with init(backend=cfg.backend, seed=None, timeout=timeout) as dist:
        rows = measure(cfg, dist.device, dist.rank, dist.world_size)
        ddp_result = measure_ddp(ddp, dist.device, dist.rank, dist.world_size) if ddp else None
        if not dist.is_main:
            return None
        dev = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu"
        # Versions, devices, host and git revision, recorded with every figure (the meter's header has the same).
        return {"world_size": dist.world_size, "group_size": cfg.group or dist.world_size, "backend": dist.backend,
                "device": dev, "rows": rows, "ddp": ddp_result,
                "fingerprint": fingerprint(dist)}


def _launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_bench(cfg: BenchConfig, nproc: int = 2, ddp: DdpConfig | None = None,
              timeout: float = BenchCommand.timeout) -> dict | None:
    """Measure ``cfg`` on ``nproc`` local ranks (or on the launched job); the result on rank 0, None elsewhere."""
    import torch

    if _launched():
        result = bench_rank(cfg, ddp, timeout)
    else:
        if nproc < 1:
            raise UsageError(f"-n must be at least 1, got {nproc}; e.g. -n 2")
        if cfg.group is not None and nproc % cfg.group:
            raise UsageError(f"--group-size must divide -n {nproc} into groups, got {cfg.group}; e.g. --group-size "
                             f"{max(1, nproc // 2)}")
        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cfg.backend != "gloo" and ngpu and nproc > ngpu:
            raise UsageError(f"-n {nproc} needs {nproc} GPUs but {ngpu} are visible; use -n {ngpu} or --backend gloo")
        result = launch_local(bench_rank, nproc, cfg, ddp, timeout, timeout=timeout)[0]
    if result is not None:
        result["config"] = {"ops": list(cfg.ops), "sizes": list(cfg.sizes), "dtype": cfg.dtype, "warmup": cfg.warmup,
                            "iters": cfg.iters, "check": cfg.check, "group_size": result["group_size"]}
        done = [r for r in result["rows"] if not r.get("unsupported")]
        result["avg_busbw"] = {op: _avg([p["busbw"] for r in done if r["op"] == op for p in (r["out"], r["in"]) if p])
                               for op in dict.fromkeys(r["op"] for r in done)}
        result["wrong"] = sum(p["wrong"] or 0 for r in done for p in (r["out"], r["in"]) if p)
    return result


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _cols(p: dict | None) -> str:
    if p is None:
        return f"{'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    wrong = "N/A" if p["wrong"] is None else str(p["wrong"])
    return f"{p['time_us']:9.1f} {p['algbw']:7.2f} {p['busbw']:7.2f} {wrong:>6}"


def format_table(result: dict) -> str:
    """nccl-tests' layout: size, count, type, redop, root, then time/algbw/busbw/#wrong out of place and in place."""
    fp, g = result["fingerprint"], result.get("group_size", result["world_size"])
    groups = f" in groups of {g}, every group at once" if g < result["world_size"] else ""
    lines = [
        f"# multigpu bench: {result['world_size']} ranks{groups}, backend {result['backend']}, device {result['device']}",
        f"# python {fp['python']}, torch {fp['torch']}, cuda {fp['cuda']}, nccl {fp['nccl']}, host {fp['hostname']} "
        f"({fp['cpus']} cpus), git {fp['git']}",
        f"# warmup {result['config']['warmup']}, iters {result['config']['iters']}; time = max over ranks; "
        "algbw = size/time (GB/s, 1e9 B); busbw = algbw x factor",
    ]
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["op"] == op]
        if rows[0].get("unsupported"):
            lines += ["#", f"# {op}: not supported by backend {result['backend']}, skipped"]
            continue
        lines += [
            "#",
            f"# {op} (busbw factor {bus_factor(op, g):.4g})",
            f"#{'':49} {'out-of-place':^32} {'in-place':^32}".rstrip(),
            f"#{'size':>12} {'count':>13} {'type':>8} {'redop':>6} {'root':>5} {'time':>9} {'algbw':>7} {'busbw':>7} "
            f"{'#wrong':>6} {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}",
            f"#{'(B)':>12} {'(elements)':>13} {'':>8} {'':>6} {'':>5} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} "
            f"{'':>6} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}",
        ]
        for r in rows:
            lines.append(f" {r['size']:12d} {r['count']:13d} {r['type']:>8} {r['redop']:>6} {r['root']:5d} {_cols(r['out'])} {_cols(r['in'])}")
        wrong = sum(p["wrong"] or 0 for r in rows for p in (r["out"], r["in"]) if p)
        lines += [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
                  f"# Avg bus bandwidth    : {result['avg_busbw'][op]:.4g}"]
    d = result.get("ddp")
    if d:
        mib = [f"{b / 2**20:.1f}" for b in d["buckets"]]
        lines += ["#", f"# DDP-shaped step: {d['model']}, {d['parameters'] / 1e6:.1f} M parameters, "
                  f"{d['gradient_bytes'] / 2**20:.1f} MiB of gradients in {len(d['buckets'])} buckets "
                  f"(cap {d['bucket_cap_mb']:g} MiB): {', '.join(mib[:8])}{' ...' if len(mib) > 8 else ''} MiB",
                  f"# communication per step: {d['comm_ms_per_step']:.2f} ms (max over ranks), algbw {d['algbw']:.2f} GB/s, "
                  f"busbw {d['busbw']:.2f} GB/s"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry of ``multigpu bench``: 0 when every check passed, 1 on wrong results or a failed rank."""
    import torch

    cmd = BenchCommand(nproc=args.nproc, ops=None if args.ops is None else tuple(args.ops), sizes=args.sizes,
                       dtype=args.dtype, warmup=args.warmup, iters=args.iters, backend=args.backend,
                       group_size=args.group_size,
                       no_check=args.no_check, ddp=args.ddp, bucket_cap_mb=args.bucket_cap_mb, timeout=args.timeout,
                       json=args.json)
    gpu = torch.cuda.is_available() and cmd.backend != "gloo"
    nproc = cmd.nproc if cmd.nproc is not None else (torch.cuda.device_count() if gpu else 2)
    if nproc < 1:
        raise UsageError(f"-n must be at least 1, got {nproc}; e.g. -n 2")
    sizes = parse_sizes(cmd.sizes or (GPU_SIZES if gpu else CPU_SIZES))
    if cmd.bucket_cap_mb <= 0:
        raise UsageError(f"--bucket-cap-mb must be positive, got {cmd.bucket_cap_mb}; DDP's default is 25")
    cfg = BenchConfig(ops=parse_ops(cmd.ops), sizes=tuple(sizes), dtype=parse_dtype(cmd.dtype), warmup=cmd.warmup,
                      iters=cmd.iters, check=not cmd.no_check, backend=cmd.backend, group=cmd.group_size)
    ddp = None
    if cmd.ddp:
        from .ddp import build_meta_model

        build_meta_model(cmd.ddp)  # a bad model spec is a usage error here, not a failed rank later
        ddp = DdpConfig(model=cmd.ddp, bucket_cap_mb=cmd.bucket_cap_mb)
    try:
        result = run_bench(cfg, nproc, ddp, timeout=cmd.timeout)
    except LaunchError as err:
        print(f"multigpu bench: {err}", file=sys.stderr)
        return 1
    if result is None:  # a non-zero rank of a launched job
        return 0
    print(json.dumps(result, indent=1) if cmd.json else format_table(result), flush=True)
    return 1 if result["wrong"] else 0
