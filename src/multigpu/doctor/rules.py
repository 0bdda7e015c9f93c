"""The lint that applies the rule table (``table.py``) to the variables that are set.

Each variable that is set gets exactly one finding. A variable's rule says
what kind it is (debugging-only, deprecated, non-existent, documented), why,
and where that is documented; a few variables also depend on the machine
(NVLink, InfiniBand devices, network interfaces), and those take the
machine's ``Facts`` as an argument so they can be tested on fabricated ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .findings import OK, PROBLEM, WARNING, Finding, redact
from .table import (DEBUG, DEPRECATED, KNOWN_NCCL, KNOWN_TORCH, NONEXISTENT, TORCH_RENAMED, ALGOS, NCCL_ENV,
                    PREFIXES, PROTOS, TORCH_DIST, TORCH_ENV, source)


@dataclass(frozen=True)
class Facts:
    """What the machine looks like, as far as the lint needs it (None = unknown)."""

    nvlink: bool | None = None
    ib_devices: tuple[str, ...] = ()
    interfaces: tuple[str, ...] = ()
    p2p_broken: bool | None = None
    gpus: int = 0


@dataclass(frozen=True)
class Rule:
    kind: str  # debug | deprecated | nonexistent | known
    reason: str
    source: str = NCCL_ENV
    replacement: str = ""


def rule_for(name: str) -> Rule | None:
    """The table's rule for one variable, or None when the variable is unknown."""
    if name in NONEXISTENT:
        reason, _ = NONEXISTENT[name]
        extra = "; PyTorch docs, torch.distributed.init_process_group (timeout)" if name == "NCCL_TIMEOUT" else ""
        return Rule("nonexistent", reason, f"{NCCL_ENV}: {name} is not listed{extra}")
    if name in DEPRECATED:
        src = TORCH_ENV if name in TORCH_RENAMED else NCCL_ENV
        return Rule("deprecated", f"deprecated, use {DEPRECATED[name]}", source(name, src), DEPRECATED[name])
    if name in DEBUG:
        return Rule("debug", DEBUG[name], source(name))
    if name.startswith("NCCL_") and name[5:] in KNOWN_NCCL:
        return Rule("known", "documented NCCL setting", source(name))
    if name in KNOWN_TORCH:
        return Rule("known", "documented PyTorch setting", source(name, TORCH_DIST if "DISTRIBUTED" in name else TORCH_ENV))
    return None


# -- interface / HCA filters (NCCL_SOCKET_IFNAME and NCCL_IB_HCA syntax) ------------


def parse_filter(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL filter syntax -> (exclude, exact, entries).

    ``^`` excludes, ``=`` matches whole names instead of prefixes, entries are
    comma separated (``:port`` suffixes on HCAs are kept in the entry).

    >>> parse_filter("^=docker0,lo")
    (True, True, ['docker0', 'lo'])
    """
    v = value.strip()
    exclude = v.startswith("^")
    v = v[1:] if exclude else v
    exact = v.startswith("=")
    v = v[1:] if exact else v
    return exclude, exact, [e.strip() for e in v.split(",") if e.strip()]


def _entry_matches(entry: str, name: str, exact: bool) -> bool:
    entry = entry.split(":")[0]  # IB_HCA entries may carry a port: mlx5_0:1
    return name == entry if exact else name.startswith(entry)


def filter_admits(value: str, name: str) -> bool:
    """Whether NCCL's filter ``value`` lets interface/HCA ``name`` through."""
    exclude, exact, entries = parse_filter(value)
    hit = any(_entry_matches(e, name, exact) for e in entries)
    return not hit if exclude else hit


def _bool(value: str) -> bool | None:
    v = value.strip().lower()
    return True if v in ("1", "true", "yes", "on") else False if v in ("0", "false", "no", "off", "") else None


# -- variable-specific checks (value x machine) ---------------------------------------

Check = Callable[[str, str, Facts], Finding | None]


def _p2p_disable(name: str, value: str, facts: Facts) -> Finding | None:
    if not _bool(value):
        return Finding(OK, f"{name}={value}: P2P stays enabled (the default)", "", source=source(name))
    if facts.p2p_broken:
        return Finding(OK, f"{name}={value}: justified here, the P2P copy check returned wrong data",
                       "keep it until a driver/BIOS (ACS, IOMMU) fix makes P2P correct", source=source(name))
    if facts.nvlink:
        return Finding(PROBLEM, f"{name}={value} on a machine with NVLink: GPU-to-GPU traffic goes through host memory",
                       f"unset {name}; if P2P is really broken use NCCL_P2P_LEVEL instead", source=source(name))
    return Finding(WARNING, f"{name}={value}: a debugging variable; {DEBUG[name]}",
                   f"unset {name} unless P2P is broken here (the P2P check says whether it is); prefer NCCL_P2P_LEVEL",
                   source=source(name))


def _ib_disable(name: str, value: str, facts: Facts) -> Finding | None:
    if not _bool(value):
        return Finding(OK, f"{name}={value}: InfiniBand stays enabled (the default)", "", source=source(name))
    if facts.ib_devices:
        return Finding(PROBLEM, f"{name}={value} with InfiniBand/RoCE devices present ({', '.join(facts.ib_devices)}): "
                       "inter-node traffic falls back to TCP sockets", f"unset {name}", source=source(name))
    return Finding(WARNING, f"{name}={value}: does nothing here (no InfiniBand device), but forces TCP if copied to an IB cluster",
                   f"unset {name}", source=source(name))


def _example_iface(facts: Facts) -> str:
    return next((i for i in facts.interfaces if i != "lo" and not i.startswith(("docker", "virbr"))), "eth0")


def _socket_ifname(name: str, value: str, facts: Facts) -> Finding | None:
    ifaces = tuple(dict.fromkeys((*facts.interfaces, "lo")))  # lo always exists on Linux
    admitted = [i for i in ifaces if filter_admits(value, i)]
    exclude, _, _ = parse_filter(value)
    real = [i for i in admitted if i != "lo"]
    if not admitted:
        example = _example_iface(facts)
        return Finding(PROBLEM, f"{name}={value} matches none of this host's interfaces ({', '.join(ifaces)}): "
                       "NCCL init fails with 'no socket interface found'",
                       f"name an existing interface, e.g. {name}={example}, or unset it", source=source(name))
    if exclude and "lo" in admitted:
        return Finding(PROBLEM, f"{name}={value} replaces NCCL's default filter (which skips docker*, lo) and lets lo through: "
                       "ranks may advertise 127.0.0.1 and hang across nodes",
                       f"use {name}=^docker,lo or name the real interface (e.g. ={real[0] if real else _example_iface(facts)}), or unset it",
                       source=source(name))
    if not real:
        return Finding(WARNING, f"{name}={value} admits only loopback: works on one node, other nodes cannot connect",
                       f"name the real interface, e.g. {name}={_example_iface(facts)}", source=source(name))
    return Finding(OK, f"{name}={value} selects {', '.join(real)}", "", source=source(name))


def _ib_hca(name: str, value: str, facts: Facts) -> Finding | None:
    devices = facts.ib_devices
    if not devices:
        return Finding(WARNING, f"{name}={value}: no InfiniBand/RoCE device on this host, so it matches nothing here",
                       "check it on the compute nodes (`ls /sys/class/infiniband`)", source=source(name))
    exclude, exact, entries = parse_filter(value)
    admitted = [d for d in devices if filter_admits(value, d)]
    if not admitted:
        return Finding(PROBLEM, f"{name}={value} admits none of {', '.join(devices)}: NCCL finds no IB device and uses TCP",
                       f"list existing devices, e.g. {name}='=" + ",".join(devices) + "'", source=source(name))
    if not exact:
        over = {e: [d for d in devices if d.startswith(e.split(":")[0]) and d != e.split(":")[0]] for e in entries}
        over = {e: ds for e, ds in over.items() if ds}
        if over:
            e, ds = next(iter(over.items()))
            verb = "also excludes" if exclude else "also selects"
            return Finding(WARNING, f"{name}={value}: '{e}' is a prefix match and {verb} {', '.join(ds)}",
                           f"a leading '=' makes the names exact: {name}='{'^' if exclude else ''}={','.join(entries)}'",
                           source=source(name))
    return Finding(OK, f"{name}={value} selects {', '.join(admitted)}", "", source=source(name))


def _tokens(value: str) -> list[str]:
    """NCCL_ALGO/PROTO values: 'Ring,Tree', '^LL128', 'allreduce:tree;allgather:ring' (2.24+)."""
    out = []
    for part in value.split(";"):
        part = part.split(":", 1)[1] if ":" in part else part
        out += [t.strip().lstrip("^").lower() for t in part.split(",") if t.strip().lstrip("^")]
    return out


def _algo(name: str, value: str, facts: Facts) -> Finding | None:
    bad = [t for t in _tokens(value) if t not in ALGOS]
    if bad:
        return Finding(PROBLEM, f"{name}={value}: unknown algorithm {', '.join(bad)} (NCCL >= 2.24 fails at init)",
                       f"unset {name}", source=source(name))
    return Finding(WARNING, f"{name}={value} forces the algorithm for every size and topology instead of NCCL's tuner",
                   f"unset {name} unless you are debugging one algorithm", source=source(name))


def _proto(name: str, value: str, facts: Facts) -> Finding | None:
    toks = _tokens(value)
    bad = [t for t in toks if t not in PROTOS]
    if bad:
        return Finding(PROBLEM, f"{name}={value}: unknown protocol {', '.join(bad)}", f"unset {name}", source=source(name))
    if "ll128" in toks and not value.strip().startswith("^"):
        return Finding(PROBLEM, f"{name}={value} forces LL128, which can corrupt data on platforms that do not support it",
                       f"unset {name}: NCCL enables LL128 only where it is safe", source=source(name))
    return Finding(WARNING, f"{name}={value} forces the protocol for every size instead of NCCL's tuner",
                   f"unset {name} unless you are debugging one protocol", source=source(name))


def _nccl_debug(name: str, value: str, facts: Facts) -> Finding | None:
    v = value.strip().upper()
    if v in ("", "VERSION", "WARN"):
        return Finding(OK, f"{name}={value}", "", source=source(name))
    if v in ("INFO", "TRACE"):
        return Finding(WARNING, f"{name}={value}: verbose logging on every rank (fine while debugging)",
                       f"use {name}=WARN for production runs", source=source(name))
    return Finding(WARNING, f"{name}={value}: not a level NCCL knows (VERSION, WARN, INFO, TRACE)",
                   f"use {name}=WARN or INFO", source=source(name))


def _torch_value(name: str, value: str, facts: Facts) -> Finding | None:
    src = source(name, TORCH_DIST if "DISTRIBUTED" in name else TORCH_ENV)
    b = _bool(value)
    if name == "TORCH_DISTRIBUTED_DEBUG":
        v = value.strip().upper()
        if v == "DETAIL":
            return Finding(WARNING, f"{name}=DETAIL checks every collective's shapes and slows the job",
                           f"use {name}=INFO or unset it outside debugging", source=src)
        if v not in ("OFF", "INFO", ""):
            return Finding(WARNING, f"{name}={value}: expected OFF, INFO or DETAIL", f"use {name}=INFO", source=src)
        return Finding(OK, f"{name}={value}", "", source=src)
    if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and value.strip() == "0":
        return Finding(WARNING, f"{name}=0: a failed or timed-out collective hangs the job instead of aborting it",
                       f"unset {name} (default 3: abort the communicator and tear down the process)", source=src)
    if name == "TORCH_NCCL_BLOCKING_WAIT" and b:
        return Finding(WARNING, f"{name}={value}: every wait blocks the CPU until the collective finishes (debugging only)",
                       f"unset {name}", source=src)
    if name == "TORCH_NCCL_ENABLE_MONITORING" and b is False:
        return Finding(WARNING, f"{name}={value}: the watchdog heartbeat monitor is off, so hangs are not detected",
                       f"unset {name}", source=src)
    if name in ("TORCH_NCCL_NAN_CHECK", "TORCH_NCCL_DESYNC_DEBUG", "TORCH_NCCL_ENABLE_NAN_CHECK") and b:
        return Finding(WARNING, f"{name}={value}: a debugging aid with a cost on every collective", f"unset {name} outside debugging",
                       source=src)
    return None


CHECKS: dict[str, Check] = {
    "NCCL_P2P_DISABLE": _p2p_disable,
    "NCCL_IB_DISABLE": _ib_disable,
    "NCCL_SOCKET_IFNAME": _socket_ifname,
    "NCCL_IB_HCA": _ib_hca,
    "NCCL_ALGO": _algo,
    "NCCL_PROTO": _proto,
    "NCCL_DEBUG": _nccl_debug,
    "TORCH_DISTRIBUTED_DEBUG": _torch_value,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": _torch_value,
    "TORCH_NCCL_BLOCKING_WAIT": _torch_value,
    "TORCH_NCCL_ENABLE_MONITORING": _torch_value,
    "TORCH_NCCL_NAN_CHECK": _torch_value,
    "TORCH_NCCL_ENABLE_NAN_CHECK": _torch_value,
    "TORCH_NCCL_DESYNC_DEBUG": _torch_value,
}


def lint_variable(name: str, value: str, facts: Facts, origin: str = "environment") -> Finding:
    """The one finding for a variable that is set.

    >>> lint_variable("NCCL_TIMEOUT", "1800", Facts()).status
    'warning'
    """
    shown = redact(name, value)
    where = "" if origin == "environment" else f" (from {origin})"
    finding = CHECKS[name](name, shown, facts) if name in CHECKS else None
    if finding is None:
        rule = rule_for(name)
        if rule is None:
            finding = Finding(WARNING, f"{name}={shown}: unknown variable, not in the documented NCCL/PyTorch lists (typo?)",
                              f"check the spelling against the docs or unset {name}",
                              source=f"{TORCH_ENV if name.startswith('TORCH_') else NCCL_ENV}: {name} is not listed")
        elif rule.kind == "nonexistent":
            finding = Finding(WARNING, f"{name}={shown}: does not exist, {rule.reason}", NONEXISTENT[name][1], source=rule.source)
        elif rule.kind == "deprecated":
            finding = Finding(WARNING, f"{name}={shown}: {rule.reason}", f"rename it to {rule.replacement}"
                              if rule.replacement.startswith(("NCCL_", "TORCH_")) else f"unset {name}", source=rule.source)
        elif rule.kind == "debug":
            finding = Finding(WARNING, f"{name}={shown}: a debugging variable; {rule.reason}",
                              f"unset {name} unless you are debugging a specific issue", source=rule.source)
        else:
            finding = Finding(OK, f"{name}={shown} ({rule.reason})", "", source=rule.source)
    return Finding(finding.status, finding.what + where, finding.fix, "environment", finding.source)


def lint_env(env: Mapping[str, str], facts: Facts, origins: Mapping[str, str] | None = None) -> list[Finding]:
    """One finding per NCCL_*, TORCH_NCCL_* and TORCH_DISTRIBUTED_* variable in ``env``.

    >>> lint_env({"NCCL_P2P_DISABLE": "1"}, Facts(nvlink=True))[0].status
    'problem'
    """
    names = sorted(n for n in env if n.startswith(PREFIXES))
    if not names:
        return [Finding(OK, "no NCCL_/TORCH_NCCL_/TORCH_DISTRIBUTED_ variables set: the tuned defaults apply", "", "environment")]
    origins = origins or {}
    return [lint_variable(n, env[n], facts, origins.get(n, "environment")) for n in names]


def parse_nccl_conf(text: str) -> dict[str, str]:
    """``NAME=value`` lines of an nccl.conf file (``#`` comments, blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            k, v = line.split("=", 1)
            if k.strip():
                out[k.strip()] = v.strip()
    return out


def merge_env(environ: Mapping[str, str], conf_files: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """NCCL's view of its settings: the environment wins over config files, earlier files over later.

    ``conf_files`` is ``[(path, text), ...]`` in NCCL's order: NCCL_CONF_FILE
    (or ~/.nccl.conf), then /etc/nccl.conf. Returns (values, origin by name).
    """
    values = {k: v for k, v in environ.items() if k.startswith(PREFIXES)}
    origins = {k: "environment" for k in values}
    for path, text in conf_files:
        for k, v in parse_nccl_conf(text).items():
            if k not in values:
                values[k], origins[k] = v, path
    return values, origins
