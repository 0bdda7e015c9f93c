"""The environment fingerprint recorded next to every number we measure.

A throughput figure means little without the versions, devices, world size
and code revision that produced it ("measure like a record attempt":
warm up, repeat, report the spread and the environment). ``fingerprint()`` collects them once; benchmarks (``multigpu
bench`` too) print it, the step meter writes it as the header line of its
JSONL file.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from typing import Any


def git_revision(cwd: str | None = None) -> str | None:
    """``<sha>`` or ``<sha>+dirty`` of the git checkout at ``cwd``; None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"]


def fingerprint(dist: Any = None, **extra: Any) -> dict[str, Any]:
    """Versions, devices, world size, host, git revision and time, as a JSON-able dict.

    ``extra`` entries (strategy, plan, ...) are added as given.

    >>> fp = mg.fingerprint(dist, strategy="ddp")
    >>> fp["torch"], fp["world_size"]
    ('2.13.0+cpu', 2)
    """
    import numpy
    import torch

    cuda = torch.version.cuda if torch.cuda.is_available() else None
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL still has a fingerprint
            nccl = None
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": cuda,
        "nccl": nccl,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "devices": _devices(),
        "world_size": getattr(dist, "world_size", 1),
        "backend": getattr(dist, "backend", None),
        "device": str(getattr(dist, "device", "cpu")),
        "git": git_revision(),
        "argv": list(sys.argv),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    out.update(extra)
    return out


def format_fingerprint(fp: dict[str, Any]) -> str:
    """One line for benchmark output: ``torch 2.13.0 | cpu ... | world 2 | git abc123``."""
    devs = fp.get("devices") or []
    dev = f"{len(devs)}x {devs[0]}" if devs and not str(devs[0]).startswith("cpu") else (devs[0] if devs else "?")
    parts = [f"python {fp.get('python')}", f"torch {fp.get('torch')}"]
    if fp.get("cuda"):
        parts.append(f"cuda {fp['cuda']} nccl {fp.get('nccl')}")
    parts += [dev, f"world {fp.get('world_size')}", f"host {fp.get('hostname')}", f"git {fp.get('git')}", fp.get("time", "")]
    return " | ".join(str(p) for p in parts)
