"""The NCCL / PyTorch environment rule table and the lint that applies it.

Each variable that is set gets exactly one finding. A variable's rule says
what kind it is (tuning knob, debugging-only, deprecated, non-existent...),
why, and where that is documented; a few variables also depend on the
machine (NVLink, InfiniBand devices, network interfaces), and those take the
machine's ``Facts`` as an argument so they can be tested on fabricated ones.

Sources, cited by name in every rule:
  NCCL-ENV  NVIDIA NCCL User Guide, "Environment Variables"
            https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  TORCH-ENV PyTorch docs, "PYTORCH ProcessGroupNCCL Environment Variables" and
            torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (deprecated NCCL_* aliases)
  TORCH-DIST PyTorch docs, torch.distributed "Debugging torch.distributed applications"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .findings import OK, PROBLEM, WARNING, Finding, redact

NCCL_ENV = "NVIDIA NCCL User Guide, Environment Variables"
TORCH_ENV = "PyTorch docs, ProcessGroupNCCL Environment Variables"
TORCH_DIST = "PyTorch docs, torch.distributed: Debugging torch.distributed applications"
PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


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


def _src(name: str, doc: str = NCCL_ENV) -> str:
    return f"{doc} ({name})"


# NVIDIA files these under "Debugging": not production defaults, because NCCL
# already tunes them per topology (reference: shared/reference/nccl.md).
_DEBUG = {
    "NCCL_P2P_DISABLE": "routes GPU-to-GPU traffic through host memory instead of NVLink/PCIe P2P",
    "NCCL_P2P_LEVEL": "overrides NCCL's choice of where P2P is used",
    "NCCL_SHM_DISABLE": "replaces shared-memory transport between processes with the network",
    "NCCL_BUFFSIZE": "changes the per-channel buffer size NCCL tuned for this topology",
    "NCCL_NTHREADS": "changes the CUDA threads per block NCCL tuned for this GPU",
    "NCCL_MIN_NCHANNELS": "forces a channel count (superseded by NCCL_MIN_CTAS since 2.17)",
    "NCCL_MAX_NCHANNELS": "caps the channel count (superseded by NCCL_MAX_CTAS since 2.17)",
    "NCCL_MIN_CTAS": "forces a minimum number of CTAs",
    "NCCL_MAX_CTAS": "caps the number of CTAs",
    "NCCL_IB_DISABLE": "disables InfiniBand/RoCE so inter-node traffic falls back to TCP sockets",
    "NCCL_NET_GDR_LEVEL": "overrides when GPUDirect RDMA is used",
    "NCCL_ALGO": "forces the algorithm for every message size instead of NCCL's tuner",
    "NCCL_PROTO": "forces the protocol for every message size instead of NCCL's tuner",
    "NCCL_NVLS_ENABLE": "overrides NVLink SHARP use",
    "NCCL_CHECK_POINTERS": "checks pointers on every call (slow)",
    "NCCL_LAUNCH_MODE": "changes how kernels are launched",
}

_DEPRECATED = {
    "NCCL_MAX_NRINGS": "NCCL_MAX_NCHANNELS (now NCCL_MAX_CTAS)",
    "NCCL_MIN_NRINGS": "NCCL_MIN_NCHANNELS (now NCCL_MIN_CTAS)",
    "NCCL_IB_GDR_LEVEL": "NCCL_NET_GDR_LEVEL",
    "NCCL_IB_CUDA_SUPPORT": "NCCL_NET_GDR_LEVEL",
    "NCCL_LL_THRESHOLD": "nothing (removed in 2.5; NCCL_PROTO if you must)",
    "NCCL_TREE_THRESHOLD": "nothing (removed in 2.5; NCCL_ALGO if you must)",
    "NCCL_SINGLE_RING_THRESHOLD": "nothing (removed in 2.5)",
    # PyTorch renamed its own knobs from NCCL_* to TORCH_NCCL_*; the old names
    # still work with a deprecation warning, and look like NCCL's own.
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_ENABLE_MONITORING": "TORCH_NCCL_ENABLE_MONITORING",
    "NCCL_HEARTBEAT_TIMEOUT_SEC": "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "NCCL_TRACE_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "NCCL_DUMP_ON_TIMEOUT": "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "NCCL_AVOID_RECORD_STREAMS": "TORCH_NCCL_AVOID_RECORD_STREAMS",
}
_TORCH_RENAMED = {k for k, v in _DEPRECATED.items() if v.startswith("TORCH_")}

# Variables people set believing they exist; NCCL ignores them silently.
_NONEXISTENT = {
    "NCCL_TIMEOUT": (
        "NCCL has no such variable; the collective timeout is the process group's",
        "pass timeout= to init_process_group (mg.init(timeout=seconds)); default 10 min for NCCL",
    ),
    "NCCL_SOCKET_IFACE": ("not a NCCL variable (typo?)", "use NCCL_SOCKET_IFNAME"),
    "NCCL_IFNAME": ("not a NCCL variable (typo?)", "use NCCL_SOCKET_IFNAME"),
    "NCCL_P2P_ENABLE": ("not a NCCL variable: P2P is on by default", "unset it; NCCL_P2P_DISABLE/NCCL_P2P_LEVEL are the real knobs"),
    "NCCL_IB_ENABLE": ("not a NCCL variable: IB is used by default when present", "unset it"),
    "NCCL_DEBUG_LEVEL": ("not a NCCL variable", "use NCCL_DEBUG=WARN|INFO|TRACE"),
}

# Documented NCCL variables that are fine to set when needed (site tuning, plugins, logging).
_KNOWN_NCCL = set(
    """SOCKET_IFNAME SOCKET_FAMILY SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC SOCKET_NTHREADS NSOCKS_PERTHREAD
    CROSS_NIC IB_HCA IB_TIMEOUT IB_RETRY_CNT IB_GID_INDEX IB_ADDR_FAMILY IB_ADDR_RANGE IB_ROCE_VERSION_NUM IB_SL IB_TC
    IB_FIFO_TC IB_RETURN_ASYNC_EVENTS IB_PCI_RELAXED_ORDERING IB_ADAPTIVE_ROUTING IB_AR_THRESHOLD IB_QPS_PER_CONNECTION
    IB_SPLIT_DATA_ON_QPS IB_ECE_ENABLE IB_MERGE_NICS IB_MERGE_VFS IB_USE_INLINE IB_OOB_IPV6 IB_DATA_DIRECT
    OOB_NET_ENABLE OOB_NET_IFNAME UID_STAGGER_THRESHOLD UID_STAGGER_RATE NET NET_PLUGIN TUNER_PLUGIN PROFILER_PLUGIN
    ENV_PLUGIN IGNORE_CPU_AFFINITY CONF_FILE DEBUG DEBUG_FILE DEBUG_SUBSYS DEBUG_TIMESTAMP_FORMAT DEBUG_TIMESTAMP_LEVELS
    COLLNET_ENABLE COLLNET_NODE_THRESHOLD TOPO_FILE TOPO_DUMP_FILE SET_THREAD_NAME SET_STACK_SIZE
    P2P_NET_CHUNKSIZE P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE P2P_LL_THRESHOLD P2P_READ_ENABLE P2P_DIRECT_DISABLE
    P2P_USE_CUDA_MEMCPY P2P_PXN_LEVEL PXN_DISABLE PXN_C2C NET_GDR_READ NET_GDR_C2C NET_SHARED_BUFFERS NET_SHARED_COMMS
    NET_DISABLE_INTRA NET_FORCE_FLUSH NET_OVERHEAD NCHANNELS_PER_NET_PEER NVB_DISABLE NVB_PRECONNECT
    IGNORE_DISABLED_P2P SHM_USE_CUDA_MEMCPY SHM_MEMCPY_MODE SHM_LOCALITY CUMEM_ENABLE CUMEM_HOST_ENABLE
    RUNTIME_CONNECT GRAPH_REGISTER LOCAL_REGISTER LEGACY_CUDA_REGISTER GRAPH_MIXING_SUPPORT DMABUF_ENABLE
    NVLS_CHUNKSIZE NVLSTREE_MAX_CHUNKSIZE MNNVL_ENABLE MNNVL_UUID MNNVL_CLIQUE_ID RAS_ENABLE RAS_ADDR
    RAS_TIMEOUT_FACTOR CGA_CLUSTER_SIZE COMM_BLOCKING WORK_FIFO_DEPTH WORK_FIFO_BYTES CTA_POLICY HOSTID COMM_ID
    CONNECT_TIMEOUT PROXY_APPEND_BATCH_SIZE CREATE_THREAD_CONTEXT ALLOC_P2P_NET_LL_BUFFERS GDRCOPY_ENABLE
    GDRCOPY_FLUSH_ENABLE GDRCOPY_SYNC_ENABLE NVLINK_UTIL_CENTRIC_SCHED_ENABLE SYM_ENABLE WIN_ENABLE
    NVLS_NCHANNELS TUNER_CONFIG_FILE SOCKET_INLINE SOCKET_MIN_TASKSIZE""".split()
)
_KNOWN_TORCH = set(
    """TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_AVOID_RECORD_STREAMS TORCH_NCCL_BCAST_UNIQUEID
    TORCH_NCCL_BLOCKING_WAIT TORCH_NCCL_COORD_CHECK_MILSEC TORCH_NCCL_CUDA_EVENT_CACHE TORCH_NCCL_DEBUG_INFO_PIPE_FILE
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE TORCH_NCCL_DESYNC_DEBUG TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_NCCL_ENABLE_MONITORING
    TORCH_NCCL_ENABLE_TIMING TORCH_NCCL_EXTRA_DUMP_ON_EXEC TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC TORCH_NCCL_HIGH_PRIORITY
    TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN TORCH_NCCL_NAN_CHECK TORCH_NCCL_PROPAGATE_ERROR
    TORCH_NCCL_RANKS_PER_ROOT TORCH_NCCL_RETHROW_CUDA_ERRORS TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING
    TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_NCCL_TRACE_CPP_STACK TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK
    TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC TORCH_NCCL_ABORT_IN_DESTROY_PG TORCH_NCCL_USE_COMM_NONBLOCKING
    TORCH_NCCL_ENABLE_NAN_CHECK TORCH_NCCL_DUMP_ON_EXIT
    TORCH_DISTRIBUTED_DEBUG TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK TORCH_DISTRIBUTED_USE_TORCHCOMMS""".split()
)

# NCCL's algorithms and protocols (NCCL_ALGO / NCCL_PROTO values).
ALGOS = {"ring", "tree", "collnetdirect", "collnetchain", "collnet", "nvls", "nvlstree", "pat"}
PROTOS = {"ll", "ll128", "simple"}


def rule_for(name: str) -> Rule | None:
    """The table's rule for one variable, or None when the variable is unknown."""
    if name in _NONEXISTENT:
        reason, _ = _NONEXISTENT[name]
        return Rule("nonexistent", reason, _src(name))
    if name in _DEPRECATED:
        src = TORCH_ENV if name in _TORCH_RENAMED else NCCL_ENV
        return Rule("deprecated", f"deprecated, use {_DEPRECATED[name]}", _src(name, src), _DEPRECATED[name])
    if name in _DEBUG:
        return Rule("debug", _DEBUG[name], _src(name))
    if name.startswith("NCCL_") and name[5:] in _KNOWN_NCCL:
        return Rule("known", "documented NCCL setting", _src(name))
    if name in _KNOWN_TORCH:
        return Rule("known", "documented PyTorch setting", _src(name, TORCH_DIST if "DISTRIBUTED" in name else TORCH_ENV))
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
        return Finding(OK, f"{name}={value}: P2P stays enabled (the default)", "", source=_src(name))
    if facts.p2p_broken:
        return Finding(OK, f"{name}={value}: justified here, the P2P copy check returned wrong data",
                       "keep it until a driver/BIOS (ACS, IOMMU) fix makes P2P correct", source=_src(name))
    if facts.nvlink:
        return Finding(PROBLEM, f"{name}={value} on a machine with NVLink: GPU-to-GPU traffic goes through host memory",
                       f"unset {name}; if P2P is really broken use NCCL_P2P_LEVEL instead", source=_src(name))
    return Finding(WARNING, f"{name}={value}: a debugging variable; {_DEBUG[name]}",
                   f"unset {name} unless P2P is broken here (the P2P check says whether it is); prefer NCCL_P2P_LEVEL",
                   source=_src(name))


def _ib_disable(name: str, value: str, facts: Facts) -> Finding | None:
    if not _bool(value):
        return Finding(OK, f"{name}={value}: InfiniBand stays enabled (the default)", "", source=_src(name))
    if facts.ib_devices:
        return Finding(PROBLEM, f"{name}={value} with InfiniBand/RoCE devices present ({', '.join(facts.ib_devices)}): "
                       "inter-node traffic falls back to TCP sockets", f"unset {name}", source=_src(name))
    return Finding(WARNING, f"{name}={value}: does nothing here (no InfiniBand device), but forces TCP if copied to an IB cluster",
                   f"unset {name}", source=_src(name))


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
                       f"name an existing interface, e.g. {name}={example}, or unset it", source=_src(name))
    if exclude and "lo" in admitted:
        return Finding(PROBLEM, f"{name}={value} replaces NCCL's default filter (which skips docker*, lo) and lets lo through: "
                       "ranks may advertise 127.0.0.1 and hang across nodes",
                       f"use {name}=^docker,lo or name the real interface (e.g. ={real[0] if real else _example_iface(facts)}), or unset it",
                       source=_src(name))
    if not real:
        return Finding(WARNING, f"{name}={value} admits only loopback: works on one node, other nodes cannot connect",
                       f"name the real interface, e.g. {name}={_example_iface(facts)}", source=_src(name))
    return Finding(OK, f"{name}={value} selects {', '.join(real)}", "", source=_src(name))


def _ib_hca(name: str, value: str, facts: Facts) -> Finding | None:
    devices = facts.ib_devices
    if not devices:
        return Finding(WARNING, f"{name}={value}: no InfiniBand/RoCE device on this host, so it matches nothing here",
                       "check it on the compute nodes (`ls /sys/class/infiniband`)", source=_src(name))
    exclude, exact, entries = parse_filter(value)
    admitted = [d for d in devices if filter_admits(value, d)]
    if not admitted:
        return Finding(PROBLEM, f"{name}={value} admits none of {', '.join(devices)}: NCCL finds no IB device and uses TCP",
                       f"list existing devices, e.g. {name}='=" + ",".join(devices) + "'", source=_src(name))
    if not exact:
        over = {e: [d for d in devices if d.startswith(e.split(":")[0]) and d != e.split(":")[0]] for e in entries}
        over = {e: ds for e, ds in over.items() if ds}
        if over:
            e, ds = next(iter(over.items()))
            verb = "also excludes" if exclude else "also selects"
            return Finding(WARNING, f"{name}={value}: '{e}' is a prefix match and {verb} {', '.join(ds)}",
                           f"a leading '=' makes the names exact: {name}='{'^' if exclude else ''}={','.join(entries)}'",
                           source=_src(name))
    return Finding(OK, f"{name}={value} selects {', '.join(admitted)}", "", source=_src(name))


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
                       f"unset {name}", source=_src(name))
    return Finding(WARNING, f"{name}={value} forces the algorithm for every size and topology instead of NCCL's tuner",
                   f"unset {name} unless you are debugging one algorithm", source=_src(name))


def _proto(name: str, value: str, facts: Facts) -> Finding | None:
    toks = _tokens(value)
    bad = [t for t in toks if t not in PROTOS]
    if bad:
        return Finding(PROBLEM, f"{name}={value}: unknown protocol {', '.join(bad)}", f"unset {name}", source=_src(name))
    if "ll128" in toks and not value.strip().startswith("^"):
        return Finding(PROBLEM, f"{name}={value} forces LL128, which can corrupt data on platforms that do not support it",
                       f"unset {name}: NCCL enables LL128 only where it is safe", source=_src(name))
    return Finding(WARNING, f"{name}={value} forces the protocol for every size instead of NCCL's tuner",
                   f"unset {name} unless you are debugging one protocol", source=_src(name))


def _nccl_debug(name: str, value: str, facts: Facts) -> Finding | None:
    v = value.strip().upper()
    if v in ("", "VERSION", "WARN"):
        return Finding(OK, f"{name}={value}", "", source=_src(name))
    if v in ("INFO", "TRACE"):
        return Finding(WARNING, f"{name}={value}: verbose logging on every rank (fine while debugging)",
                       f"use {name}=WARN for production runs", source=_src(name))
    return Finding(WARNING, f"{name}={value}: not a level NCCL knows (VERSION, WARN, INFO, TRACE)",
                   f"use {name}=WARN or INFO", source=_src(name))


def _torch_value(name: str, value: str, facts: Facts) -> Finding | None:
    src = _src(name, TORCH_DIST if "DISTRIBUTED" in name else TORCH_ENV)
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
                              source=_src(name, TORCH_ENV if name.startswith("TORCH_") else NCCL_ENV))
        elif rule.kind == "nonexistent":
            finding = Finding(WARNING, f"{name}={shown}: does not exist, {rule.reason}", _NONEXISTENT[name][1], source=rule.source)
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
