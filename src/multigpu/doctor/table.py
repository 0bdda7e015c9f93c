"""The rule table: which NCCL / PyTorch variables are debugging-only, deprecated,
non-existent or documented, with the reason and the documentation each rests on.

Sources (cited by name in every finding):
  NVIDIA NCCL User Guide, "Environment Variables"
      https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  PyTorch docs, "PYTORCH ProcessGroupNCCL Environment Variables" and
      torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (the deprecated NCCL_* aliases)
  PyTorch docs, torch.distributed "Debugging torch.distributed applications"
  nccl-tests doc/PERFORMANCE.md (bandwidth vocabulary, used by the bench)
"""

from __future__ import annotations

NCCL_ENV = "NVIDIA NCCL User Guide, Environment Variables"
TORCH_ENV = "PyTorch docs, ProcessGroupNCCL Environment Variables"
TORCH_DIST = "PyTorch docs, torch.distributed: Debugging torch.distributed applications"
PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


def source(name: str, doc: str = NCCL_ENV) -> str:
    return f"{doc} ({name})"


# NVIDIA files these under "Debugging": not production defaults, because NCCL
# already tunes them per topology (NCCL User Guide, Environment Variables: NCCL_ENV).
DEBUG = {
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

DEPRECATED = {
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
TORCH_RENAMED = {k for k, v in DEPRECATED.items() if v.startswith("TORCH_")}

# Variables people set believing they exist; NCCL ignores them silently.
NONEXISTENT = {
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
KNOWN_NCCL = set(
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
KNOWN_TORCH = set(
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
