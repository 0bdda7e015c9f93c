"""``multigpu run --fault-tolerant G``: G replica groups, each its own torch job, and one torchft lighthouse.

Each group is an ordinary ``multigpu run`` of ``-n`` workers (its own rendezvous, store and logs) in a
child process, with ``--max-restarts`` (default ``RESTARTS``): when one of its workers dies, torch's
agent restarts the group, and its workers heal from a live group (parallel/fault_tolerant.py) while the
others go on stepping. The lighthouse, where the groups' quorum forms, runs inside this process (torchft's
Rust server), so it ends with the launcher; ``--lighthouse HOST:PORT`` uses one already running instead.
Every group's output reaches the console prefixed ``[group g]``.

On several nodes (``--nnodes N`` with ``--node-rank``/``--master``, or SLURM's) each node's launcher runs whole
groups, node k groups k*G/N.. (G a multiple of N), and keeps its own groups' records. Node 0's launcher starts
the lighthouse on ``--master``'s port; the others wait for it. Each node's groups advertise the address the
node routes to node 0 from (``MULTIGPU_REPLICA_HOST``, parallel/fault_tolerant.py) and gloo binds its interface.
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
from typing import Any, Callable

from ..errors import UsageError
from ..runtime import contract
from . import slurm
from .config import Placement, RunConfig, cpu_count, parse_nnodes, resolve
from .network import node_address

RESTARTS = 3  # --max-restarts' default per group under --fault-tolerant
# The lighthouse waits this long for the groups of the last quorum before it forms one without a
# missing group: the stall a lost group costs the others (torchft's own examples use 1-10 s).
JOIN_TIMEOUT_MS = 2000
HEARTBEAT_TIMEOUT_MS = 2000  # a group silent for this long is no longer counted healthy by the lighthouse
SAY_WAIT_S = 5.0  # a node waiting this long for node 0's lighthouse says so (a quick refusal stays one line)


def check(cfg: RunConfig) -> None:
    """The checks of ``--fault-tolerant`` before anything starts (one-line ``UsageError``); on a node other than
    node 0, the wait for node 0's lighthouse too (bounded by --rdzv-timeout)."""
    groups = cfg.fault_tolerant
    if groups is None:
        return
    if groups < 2:
        raise UsageError(f"--fault-tolerant needs at least 2 replica groups (a lost group heals from a live one), "
                         f"got {groups}; use --fault-tolerant 2 or more, or drop --fault-tolerant")
    nodes = parse_nnodes(cfg.nnodes)
    if nodes is not None and nodes[0] < nodes[1]:
        raise UsageError(f"--fault-tolerant keeps the live groups training without a restart; --nnodes takes one "
                         f"count N with it, got {cfg.nnodes}; use --nnodes {nodes[1]}")
    place = _placement(cfg)  # --nnodes, --node-rank, --master (or SLURM's) checked as for any run
    if groups % place.nnodes:
        near = sorted({groups - groups % place.nnodes, groups + place.nnodes - groups % place.nnodes} - {0})
        raise UsageError(f"--fault-tolerant {groups} on {place.nnodes} nodes: each node runs whole replica groups, "
                         f"the same number on every node, and {groups} is not a multiple of {place.nnodes}; use "
                         f"--fault-tolerant {' or '.join(map(str, near))}")
    if importlib.util.find_spec("torchft") is None:
        raise UsageError("--fault-tolerant needs torchft, which is not installed; pip install 'multigpu[ft]'")
    if cfg.lighthouse is not None:
        host, port = _host_port(cfg.lighthouse)
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as err:
            raise UsageError(f"--lighthouse {cfg.lighthouse}: cannot reach a lighthouse there ({err.strerror or err}); "
                             "start one (torchft_lighthouse --min_replicas 1) or drop --lighthouse") from None
    elif place.nnodes > 1 and place.node_rank != 0:  # node 0's launcher starts it: wait for it, bounded
        _await(place.master_addr, place.master_port, cfg.rdzv_timeout)
    if place.nnodes > 1:
        _node_address(place)  # what the other nodes will dial here, known before anything starts


def _host_port(lighthouse: str) -> tuple[str, int]:
    host, _, port = lighthouse.removeprefix("http://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--lighthouse takes HOST:PORT, got {lighthouse!r}; use e.g. --lighthouse node0:29510")
    return host.strip("[]"), int(port)


def _placement(cfg: RunConfig) -> Placement:
    """Where one group's workers go (``-n`` of them), and which node of how many this launcher is: from
    --nnodes/--node-rank/--master or SLURM's variables, checked as for any run (--master also with --lighthouse:
    this node's address is the one it routes to node 0 from)."""
    place = resolve(dataclasses.replace(cfg, fault_tolerant=None, lighthouse=None))
    if place.source == "slurm":  # SLURM's node name -> its address (one line when neither resolves), as for any run
        place = dataclasses.replace(place, master_addr=slurm.master_address(place.master_addr, place.master_port,
                                                                            place.nodes_text)[0])
    return place


def _host_join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _lighthouse(cfg: RunConfig, place: Placement):
    """(address, server or None): the lighthouse the groups meet at. One node: started here on a free port. Several:
    node 0 starts it on --master's port (free there: each group is a torch job of its own, with no rendezvous on
    it), the other nodes' ``check`` waited for it. --lighthouse names one already running."""
    if cfg.lighthouse is not None:
        return (cfg.lighthouse if cfg.lighthouse.startswith("http") else f"http://{cfg.lighthouse}"), None
    shared = f"http://{_host_join(place.master_addr, place.master_port)}" if place.nnodes > 1 else None
    if shared and place.node_rank != 0:  # up: check() waited for it
        return shared, None
    from torchft._torchft import LighthouseServer

    port, errors = (place.master_port if shared else 0), []
    for bind in (f"[::]:{port}", f"0.0.0.0:{port}"):  # IPv6 (and v4) where the host has it, else IPv4 only
        try:
            server = LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            break
        except Exception as err:  # noqa: BLE001 - the Rust server's error, whatever its type
            errors.append(" ".join(str(err).split()))
    else:
        got = "; ".join(dict.fromkeys(errors))  # the same reason on both binds is said once
        if not shared:
            raise UsageError(f"--fault-tolerant: the torchft lighthouse could not listen on a free port ({got}); "
                             "start one yourself (torchft_lighthouse --min_replicas 1) and pass --lighthouse HOST:PORT")
        flags = place.source == "flags"
        raise UsageError(f"--fault-tolerant: node 0 starts the torchft lighthouse on "
                         f"{'--master' if flags else 'the SLURM job'}'s port {port}, and it could not listen there "
                         f"({got}); free port {port}{' or name another in --master' if flags else ''}, or pass "
                         "--lighthouse HOST:PORT to use a lighthouse already running")
    # It binds every interface: one node's groups dial localhost, several nodes' the address they were all given.
    return shared or f"http://localhost:{server.address().rsplit(':', 1)[1]}", server


def _await(host: str, port: int, timeout: float) -> None:
    """Wait for node 0's lighthouse to accept connections (its launcher may start after this one), saying so once
    the wait passes SAY_WAIT_S (a silent wait can last the whole --rdzv-timeout)."""
    from . import logs

    start = time.monotonic()
    deadline, said = start + timeout, False
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
            return
        except OSError as err:
            if not said and time.monotonic() - start >= SAY_WAIT_S:
                logs.say(f"--fault-tolerant: waiting up to {timeout:g} s (--rdzv-timeout) for node 0's lighthouse at "
                         f"{_host_join(host, port)} ({err.strerror or err})")
                said = True
            if time.monotonic() >= deadline:
                raise UsageError(f"--fault-tolerant: no lighthouse answered at node 0's {_host_join(host, port)} within "
                                 f"{timeout:g} s ({err.strerror or err}); start node 0's launcher (it starts the "
                                 "lighthouse there), pass --lighthouse HOST:PORT, or a longer --rdzv-timeout") from None
        time.sleep(0.5)


def _node_address(place: Placement) -> tuple[str, str | None]:
    """(address, interface) the other nodes reach this one at: the one the kernel routes to node 0 from, as for
    the rendezvous of any run on several nodes (network.node_address)."""
    found = node_address(place.master_addr, place.master_port)
    if found is None:
        raise UsageError(f"--fault-tolerant on {place.nnodes} nodes: cannot tell this node's address toward node 0's "
                         f"{_host_join(place.master_addr, place.master_port)} (no route to it, or this host's name maps "
                         "to a loopback address); give --master as node 0's IP address, or fix the route or the name in "
                         "/etc/hosts")
    return found


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


def launch(cfg: RunConfig, new_run_dir: Callable[[], str]) -> int:
    """Start the lighthouse (unless another node or --lighthouse has it), then the run folder (``new_run_dir``)
    and this node's groups (``check`` passed); wait for all; the first failed group's exit code. A lighthouse that
    cannot start is one line before anything is said, made or started."""
    from . import logs

    place = _placement(cfg)
    quiet = "warn" if "RUST_LOG" not in os.environ else None  # torchft's Rust side logs every quorum at INFO
    with contract.environ(RUST_LOG=quiet):
        address, server = _lighthouse(cfg, place)
        try:
            if quiet:
                logs.say("RUST_LOG: unset -> 'warn' (torchft's quorum and commit lines stay out of the console)")
            return _launch(cfg, new_run_dir(), cfg.fault_tolerant, place, address, started=server is not None)
        finally:
            if server is not None:
                server.shutdown()


def _here(groups: int, place: Placement) -> range:
    """This node's replica groups: node k of N runs groups k*G/N .. (k+1)*G/N - 1 (G divisible by N)."""
    each = groups // place.nnodes
    return range(place.node_rank * each, (place.node_rank + 1) * each)


def _group_env(cfg: RunConfig, place: Placement, groups: int, here: range, address: str,
               record_dir: str) -> dict[str, str]:
    """The environment of this node's groups: the lighthouse, the groups, and on several nodes the address and
    interface the other nodes reach this one at (torchft advertises it; gloo binds to it)."""
    from . import logs

    env = dict(os.environ)
    env.update({contract.LIGHTHOUSE_ENV: address, contract.REPLICA_GROUPS_ENV: str(groups),
                contract.REPLICAS_DIR_ENV: record_dir})
    if "OMP_NUM_THREADS" not in os.environ:  # every group's workers share this node's CPUs
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // (len(here) * place.nproc)))
        logs.say(f"OMP_NUM_THREADS: unset -> {env['OMP_NUM_THREADS']!r} ({cpu_count()} CPUs // {len(here)} groups x "
                 f"{place.nproc} workers)")
    if place.nnodes > 1:
        addr, interface = _node_address(place)
        env[contract.REPLICA_HOST_ENV] = addr
        if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Left alone, gloo binds to what the host name resolves to, a loopback address on many hosts.
            env["GLOO_SOCKET_IFNAME"] = interface
            logs.say(f"GLOO_SOCKET_IFNAME: unset -> {interface!r} (gloo's interface: {addr}, this node's route to "
                     "node 0)")
    return env


def _launch(cfg: RunConfig, run_dir: str, groups: int, place: Placement, address: str, started: bool) -> int:
    from . import logs

    here = _here(groups, place)
    record_dir = os.path.join(run_dir, "replicas")
    os.makedirs(record_dir, exist_ok=True)
    version = importlib.metadata.version("torchft")
    # Each group is a torch job of this node alone (--nnodes 1: not SLURM's several nodes either).
    group_cfg = dataclasses.replace(cfg, fault_tolerant=None, lighthouse=None, log_dir=run_dir, nnodes=1,
                                    node_rank=None, master=None,
                                    max_restarts=RESTARTS if cfg.max_restarts is None else cfg.max_restarts)
    env = _group_env(cfg, place, groups, here, address, record_dir)
    node = (f"node {place.node_rank} of {place.nnodes} ({place.source}) runs groups {here.start}..{here.stop - 1} of "
            if place.nnodes > 1 else "")
    logs.say(f"--fault-tolerant: {node}{groups} replica groups of {place.nproc} worker{'s' if place.nproc > 1 else ''}"
             f", torchft {version}, lighthouse {address}{' (started here)' if started else ''}, each group restarted up "
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
        for g in here:
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
    if os.path.exists(os.path.join(record_dir, "refused")):
        raise UsageError(_differ(record_dir, groups))
    failed = [(here[i], c) for i, c in enumerate(codes) if c != 0 and i not in late]
    line = _summary(record_dir, groups, failed)
    if late:
        line += "; " + ", ".join(f"group {here[i]}" for i in late) + f" stopped: training ended {FINISH_GRACE_S:g} s before"
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
    # On several nodes a node may hold one group's setup only: the other node's last line names the difference.
    what = what or (f"group {', '.join(map(str, setups)) or '?'} here differs from a group on another node; the "
                     "other nodes' last lines say what differs")
    return (f"the replica groups differ ({what}); every group must run the same script, "
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
