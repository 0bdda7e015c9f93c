"""``multigpu run --fault-tolerant G``: G replica groups, each its own torch job, and one torchft lighthouse.

Each group is an ordinary ``multigpu run`` of ``-n`` workers (its own rendezvous, store and logs) in a
child process, with ``--max-restarts`` (default ``RESTARTS``): when one of its workers dies, torch's
agent restarts the group, and its workers heal from a live group (parallel/fault_tolerant.py) while the
others go on stepping. The lighthouse, where the groups' quorum forms, runs inside this process (torchft's
Rust server), so it ends with the launcher; ``--lighthouse HOST:PORT`` uses one already running instead.
Every group's output reaches the console prefixed ``[group g]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ..errors import UsageError
from ..runtime import contract
from .config import RunConfig, cpu_count, resolve

RESTARTS = 3  # --max-restarts' default per group under --fault-tolerant
# The lighthouse waits this long for the groups of the last quorum before it forms one without a
# missing group: the stall a lost group costs the others (torchft's own examples use 1-10 s).
JOIN_TIMEOUT_MS = 2000
HEARTBEAT_TIMEOUT_MS = 2000  # a group silent for this long is no longer counted healthy by the lighthouse


def check(cfg: RunConfig) -> None:
    """The checks of ``--fault-tolerant`` that need no process (one-line ``UsageError``)."""
    groups = cfg.fault_tolerant
    if groups is None:
        return
    if groups < 2:
        raise UsageError(f"--fault-tolerant needs at least 2 replica groups (a lost group heals from a live one), "
                         f"got {groups}; use --fault-tolerant 2 or more, or drop --fault-tolerant")
    if (cfg.nnodes not in (None, 1, "1")) or cfg.master is not None:
        raise UsageError(f"--fault-tolerant starts its {groups} replica groups on this node, got --nnodes "
                         f"{cfg.nnodes} / --master {cfg.master}; drop them (several nodes are not supported yet)")
    if importlib.util.find_spec("torchft") is None:
        raise UsageError("--fault-tolerant needs torchft, which is not installed; pip install 'multigpu[ft]'")
    if cfg.lighthouse is not None:
        host, _, port = cfg.lighthouse.removeprefix("http://").rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--lighthouse takes HOST:PORT, got {cfg.lighthouse!r}; use e.g. --lighthouse node0:29510")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as err:
            raise UsageError(f"--lighthouse {cfg.lighthouse}: cannot reach a lighthouse there ({err.strerror or err}); "
                             "start one (torchft_lighthouse --min_replicas 1) or drop --lighthouse") from None


def _lighthouse(cfg: RunConfig):
    """(address, server or None): the lighthouse the groups meet at, started here unless --lighthouse names one."""
    if cfg.lighthouse is not None:
        return (cfg.lighthouse if cfg.lighthouse.startswith("http") else f"http://{cfg.lighthouse}"), None
    from torchft._torchft import LighthouseServer

    errors = []
    for bind in ("[::]:0", "0.0.0.0:0"):  # IPv6 (and v4) where the host has it, else IPv4 only
        try:
            server = LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            break
        except Exception as err:  # noqa: BLE001 - the Rust server's error, whatever its type
            errors.append(f"{bind}: {' '.join(str(err).split())}")
    else:
        raise UsageError(f"--fault-tolerant: the torchft lighthouse could not start ({'; '.join(errors)}); "
                         "start one yourself and pass --lighthouse HOST:PORT")
    # It binds every interface; the groups are on this node.
    return f"http://localhost:{server.address().rsplit(':', 1)[1]}", server


def _end_with_parent() -> None:
    """In a group's launcher, before it runs: SIGTERM it when this launcher dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so that no group trains on, orphaned, against a lighthouse that is gone."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _relay(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def launch(cfg: RunConfig, run_dir: str) -> int:
    """Start the lighthouse and ``cfg.fault_tolerant`` groups (``check`` passed); wait for all; the first failed
    group's exit code."""
    from . import logs

    groups = cfg.fault_tolerant
    place = resolve(dataclasses.replace(cfg, fault_tolerant=None, lighthouse=None))
    quiet = None
    if "RUST_LOG" not in os.environ:  # torchft's Rust side (lighthouse, managers) logs every quorum at INFO
        quiet = "warn"
        logs.say("RUST_LOG: unset -> 'warn' (torchft's quorum and commit lines stay out of the console)")
    with contract.environ(RUST_LOG=quiet):
        return _launch(cfg, run_dir, groups, place)


def _launch(cfg: RunConfig, run_dir: str, groups: int, place) -> int:
    from . import logs

    address, server = _lighthouse(cfg)
    version = importlib.metadata.version("torchft")
    record_dir = os.path.join(run_dir, "replicas")
    os.makedirs(record_dir, exist_ok=True)
    group_cfg = dataclasses.replace(cfg, fault_tolerant=None, lighthouse=None, log_dir=run_dir,
                                    max_restarts=RESTARTS if cfg.max_restarts is None else cfg.max_restarts)
    env = dict(os.environ)
    env.update({contract.LIGHTHOUSE_ENV: address, contract.REPLICA_GROUPS_ENV: str(groups),
                contract.REPLICAS_DIR_ENV: record_dir})
    if "OMP_NUM_THREADS" not in os.environ:  # every group's workers share this node's CPUs
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // (groups * place.nproc)))
        logs.say(f"OMP_NUM_THREADS: unset -> {env['OMP_NUM_THREADS']!r} ({cpu_count()} CPUs // {groups} groups x "
                 f"{place.nproc} workers)")
    logs.say(f"--fault-tolerant: {groups} replica groups of {place.nproc} worker{'s' if place.nproc > 1 else ''}, "
             f"torchft {version}, lighthouse {address}{' (started here)' if server else ''}, each group restarted up "
             f"to {group_cfg.max_restarts} times; a missing group's share of each global batch is skipped; "
             f"records: {record_dir}")
    children: list[subprocess.Popen] = []

    def forward(signum, _frame) -> None:  # Ctrl-C or a scheduler's SIGTERM: each group stops its workers
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = []
    try:
        for g in range(groups):
            child = subprocess.Popen([sys.executable, "-m", "multigpu.launch.group", json.dumps(
                dataclasses.asdict(group_cfg))], env=dict(env, **{contract.REPLICA_GROUP_ENV: str(g)}),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, preexec_fn=_end_with_parent)
            children.append(child)
            threads.append(threading.Thread(target=_relay, args=(child.stdout, f"[group {g}] ", sys.stdout), daemon=True))
            threads[-1].start()
        codes, late = _wait(children, record_dir)
    finally:
        for child in children:  # this launcher failed or was stopped: no group outlives it
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for t in threads:
            t.join(timeout=5)
        for s, handler in old.items():
            signal.signal(s, handler)
        if server is not None:
            server.shutdown()
    if os.path.exists(os.path.join(record_dir, "refused")):
        raise UsageError(_differ(record_dir, groups))
    failed = [(g, c) for g, c in enumerate(codes) if c != 0 and g not in late]
    line = _summary(record_dir, groups, failed)
    if late:
        line += "; " + ", ".join(f"group {g}" for g in late) + f" stopped: training ended {FINISH_GRACE_S:g} s before"
    logs.say(line)
    return failed[0][1] if failed else 0


# Groups in step finish within moments of each other; one still running this long after a group finished
# training is restarting or healing, with no live group left to heal from: it is stopped.
FINISH_GRACE_S = 20.0


def _wait(children: list[subprocess.Popen], record_dir: str) -> tuple[list[int], list[int]]:
    """Every group's exit code, and the groups stopped because training had ended without them (or all, at
    once, when a group found that they differ: no restart can fix that)."""
    finished, late = None, []
    while any(child.poll() is None for child in children):
        if os.path.exists(os.path.join(record_dir, "refused")):
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                child.wait()
            break
        if finished is None and any(child.poll() == 0 for child in children):
            finished = time.monotonic()
        if finished is not None and time.monotonic() - finished > FINISH_GRACE_S:
            late = [g for g, child in enumerate(children) if child.poll() is None]
            for g in late:
                children[g].send_signal(signal.SIGTERM)
            for g in late:
                children[g].wait()
        time.sleep(0.1)
    return [child.returncode for child in children], late


def _differ(record_dir: str, groups: int) -> str:
    """The refusal of groups that differ, naming what differs (each group's ``group<g>.setup.json``)."""
    setups = {}
    for g in range(groups):
        try:
            with open(os.path.join(record_dir, f"group{g}.setup.json")) as fp:
                setups[g] = json.load(fp)
        except (OSError, ValueError):
            continue
    keys = sorted({k for s in setups.values() for k in s if len({json.dumps(t.get(k)) for t in setups.values()}) > 1})
    if "parameters" in keys and "shapes" in keys:  # the shapes' hash says nothing more
        keys.remove("shapes")
    what = "; ".join(f"{k}: " + ", ".join(f"group {g} {s.get(k)}" for g, s in setups.items()) for k in keys)
    return (f"the replica groups differ ({what or 'see the groups logs'}); every group must run the same script, "
            "layout and torchft release: start them from one launcher and environment")


def _summary(record_dir: str, groups: int, failed: list[tuple[int, int]]) -> str:
    """One line: steps committed, the steps a group was missing from and the samples that skipped, heals."""
    steps: dict[int, dict[str, Any]] = {}
    heals: list[float] = []
    for g in range(groups):
        try:
            with open(os.path.join(record_dir, f"group{g}.jsonl")) as fp:
                for line in fp:
                    rec = json.loads(line)
                    steps.setdefault(rec["step"], rec)
                    if rec["healed"]:
                        heals.append(rec.get("heal_s", 0.0))
        except (OSError, ValueError):
            continue
    short = [s for s in steps.values() if len(s["groups"]) < groups]
    line = (f"--fault-tolerant: {len(steps)} steps committed, {len(short)} without every group "
            f"({sum(s['skipped'] for s in short)} samples skipped), {len(heals)} heal{'s' if len(heals) != 1 else ''} "
            f"from a live group" + (f" ({', '.join(f'{h:.2f}' for h in heals)} s)" if heals else ""))
    if failed:
        line += "; " + ", ".join(f"group {g} failed (exit {c})" for g, c in failed)
    return line
