"""``multigpu doctor``: is this machine set up for multi-GPU training, and if not, what to change.

Every check returns ``Finding(status, what, fix)`` objects; the rules are
pure functions of their inputs (environment dict, topology text, IB devices,
interfaces) so they are tested on fabricated machines, and the collectors
here only feed them.

>>> from multigpu.doctor import run_doctor
>>> findings = run_doctor(nproc=2)
>>> [f for f in findings if f.status == "problem"]
[]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
from dataclasses import dataclass

from ..errors import UsageError
from ..runtime.fields import add_field
from .findings import OK, PROBLEM, WARNING, Finding, redact, worst
from .rules import Facts, lint_env, merge_env

__all__ = ["DoctorConfig", "Facts", "Finding", "add_arguments", "format_findings", "lint_env", "main", "redact",
           "run_doctor", "worst"]


@dataclass(frozen=True)
class DoctorConfig:
    """What ``multigpu doctor`` was asked to check. Each field's docstring is its flag's help in
    `multigpu doctor --help` (``add_arguments``); ``timeout``'s default is ``run_doctor()``'s."""

    nproc: int | None = None
    """ranks for the live smoke test (default: GPUs visible, else 2)"""
    port: int | None = None
    """rendezvous port to check (default: $MASTER_PORT or 29500)"""
    backend: str | None = None
    """smoke-test backend (default: nccl with GPUs)"""
    timeout: float = 60.0
    """smoke-test timeout in seconds (default %(default)g)"""
    no_smoke: bool = False
    """skip the live smoke test"""
    json: bool = False
    """print JSON for scripts instead of the table"""


def conf_files(environ) -> list[tuple[str, str]]:
    """NCCL's config files in its order: NCCL_CONF_FILE (or ~/.nccl.conf), then /etc/nccl.conf."""
    paths = [environ.get("NCCL_CONF_FILE") or os.path.expanduser("~/.nccl.conf"), "/etc/nccl.conf"]
    out = []
    for p in paths:
        try:
            with open(p) as fh:
                out.append((p, fh.read()))
        except OSError:
            pass
    return out


def _guarded(check: str, fn, *args, default=None):
    """Run a collector; a crash (driver error, odd tool output) becomes a finding, not a traceback."""
    try:
        return fn(*args), []
    except Exception as err:  # noqa: BLE001 - the doctor must finish and report
        msg = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        return default, [Finding(PROBLEM, f"the {check} check failed: {msg}",
                                 "run the command it wraps by hand (nvidia-smi, python -c 'import torch') to see the full error",
                                 check)]


def run_doctor(nproc: int = 2, port: int | None = DoctorConfig.port, smoke: bool = True,
               backend: str | None = DoctorConfig.backend, timeout: float = DoctorConfig.timeout,
               environ=None) -> list[Finding]:
    """Run every check on this machine; the findings in report order.

    ``environ`` replaces ``os.environ`` for the lint (the smoke test's ranks
    still inherit the real environment).
    """
    import torch

    from . import checks
    from .topology import collect_topology, ib_devices

    environ = dict(os.environ if environ is None else environ)
    port = port if port is not None else int(environ.get("MASTER_PORT") or 29500)
    out: list[Finding] = []
    versions, bad = _guarded("versions", checks.collect_versions)
    out += (checks.check_versions(versions) if versions else []) + bad
    gpus, bad = _guarded("devices", checks.collect_gpus, default=[])
    out += bad
    topo, bad = _guarded("devices", collect_topology) if gpus or shutil.which("nvidia-smi") else (None, [])
    out += checks.check_devices(gpus, topo) + bad
    p2p, bad = _guarded("devices", checks.collect_p2p, len(gpus), default={}) if len(gpus) > 1 else ({}, [])
    out += checks.check_p2p(p2p) + bad
    ifaces, bad_ifaces = _guarded("host", checks.collect_interfaces, default=[])
    facts = Facts(
        nvlink=topo.nvlink if topo and topo.gpus else (False if len(gpus) < 2 else None),
        ib_devices=ib_devices(),
        interfaces=tuple(i.name for i in ifaces if i.up),  # NCCL only considers interfaces with an address
        p2p_broken=any(ok is False for _, ok in p2p.values()) if p2p else None,
        gpus=len(gpus),
    )
    values, origins = merge_env(environ, conf_files(environ))
    out += lint_env(values, facts, origins)
    out += checks.check_shm(checks.shm_size(), len(gpus))
    out += checks.check_nofile(*checks.nofile_limit())
    out += checks.check_interfaces(ifaces) + bad_ifaces
    out += checks.check_port(port, checks.port_in_use(port))
    out += checks.check_torchft(*checks.torchft_status(environ))
    out += checks.check_secrets(environ)
    if smoke:
        from .smoke import run_smoke

        use_gpu = torch.cuda.is_available() and backend != "gloo"
        if use_gpu and nproc > len(gpus):
            out.append(Finding(PROBLEM, f"smoke test asked for {nproc} ranks but only {len(gpus)} GPU(s) are visible",
                               f"use -n {len(gpus)} (or --backend gloo)", "smoke test"))
        else:
            out += run_smoke(nproc, backend=backend, timeout=timeout)
    return out


_MARK = {OK: "ok", WARNING: "WARN", PROBLEM: "PROBLEM"}


def format_findings(findings: list[Finding]) -> str:
    """Plain aligned text, grouped by check: status, what was found, and the fix."""
    lines, current = [], None
    for f in findings:
        if f.check != current:
            current = f.check
            lines.append(f"\n{current.upper()}")
        lines.append(f"  {_MARK[f.status]:<8} {f.what}")
        if f.fix:
            lines.append(f"  {'':<8}   fix: {f.fix}")
        if f.source and f.status != OK:
            lines.append(f"  {'':<8}   see: {f.source}")
    counts = {s: sum(f.status == s for f in findings) for s in (OK, WARNING, PROBLEM)}
    lines.append(f"\n{counts[PROBLEM]} problem(s), {counts[WARNING]} warning(s), {counts[OK]} ok")
    return "\n".join(lines).lstrip("\n")


def _print_rich(findings: list[Finding]) -> bool:
    """The same table through rich, when it is installed and stdout is a terminal."""
    if not sys.stdout.isatty():
        return False
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        return False
    style = {OK: "green", WARNING: "yellow", PROBLEM: "bold red"}
    table = Table(show_lines=False, header_style="bold")
    for col in ("status", "check", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for f in findings:
        see = f"\n[dim]see: {escape(f.source)}[/]" if f.source and f.status != OK else ""
        table.add_row(f"[{style[f.status]}]{f.status}[/]", f.check, escape(f.what), escape(f.fix) + see)
    console = Console()
    console.print(table)
    counts = {s: sum(f.status == s for f in findings) for s in (OK, WARNING, PROBLEM)}
    console.print(f"{counts[PROBLEM]} problem(s), {counts[WARNING]} warning(s), {counts[OK]} ok", highlight=False)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    doctor = functools.partial(add_field, parser, config=DoctorConfig)
    doctor("-n", "--nproc", field="nproc", type=int)  # None: the visible GPUs, else 2, chosen in main
    doctor("--port", field="port", type=int)
    doctor("--backend", field="backend", choices=("nccl", "gloo", "mpi"))
    doctor("--timeout", field="timeout", type=float)
    doctor("--no-smoke", field="no_smoke", action="store_true")
    doctor("--json", field="json", action="store_true")


def main(args: argparse.Namespace) -> int:
    """Entry of ``multigpu doctor``: exit 0 without problems, 1 with at least one."""
    import torch

    cfg = DoctorConfig(nproc=args.nproc, port=args.port, backend=args.backend, timeout=args.timeout,
                       no_smoke=args.no_smoke, json=args.json)
    nproc = cfg.nproc if cfg.nproc is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 2
    if nproc < 1:
        raise UsageError(f"-n must be at least 1, got {nproc}; e.g. -n 2")
    if cfg.port is not None and not 0 < cfg.port < 65536:
        raise UsageError(f"--port must be 1..65535, got {cfg.port}; e.g. --port 29500")
    if cfg.timeout <= 0:
        raise UsageError(f"--timeout must be positive seconds, got {cfg.timeout}; e.g. --timeout 60")
    findings = run_doctor(nproc=nproc, port=cfg.port, smoke=not cfg.no_smoke, backend=cfg.backend, timeout=cfg.timeout)
    status = 1 if worst(findings) == PROBLEM else 0
    if cfg.json:
        print(json.dumps({"status": worst(findings), "exit_status": status, "findings": [f.to_dict() for f in findings]}, indent=1))
    elif not _print_rich(findings):
        print(format_findings(findings))
    return status
