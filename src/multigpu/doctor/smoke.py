"""The live smoke test: start N ranks, all-reduce, check, time; on failure, say why."""

from __future__ import annotations

import re

from torch.distributed.elastic.multiprocessing.errors import record

from .findings import OK, PROBLEM, Finding

# (pattern in the failure text, likely cause and fix). First match wins.
CAUSES: list[tuple[str, str]] = [
    (r"needs a CUDA GPU", "no GPU is visible to the ranks: use --backend gloo, or check CUDA_VISIBLE_DEVICES and the driver"),
    (r"multigpu: error:", "a setup mistake: the error line says what to change"),
    (r"wrong values", "the all-reduce returned wrong data: P2P between these GPUs may be broken; run the P2P check, "
                      "try NCCL_P2P_DISABLE=1 to confirm, then fix ACS/IOMMU or the driver"),
    (r"address already in use|EADDRINUSE|errno: 98", "the rendezvous port is taken: pick another MASTER_PORT / --master-port"),
    (r"no socket interface found|Bootstrap : no socket", "NCCL_SOCKET_IFNAME matches no interface: fix or unset it"),
    (r"Duplicate GPU detected", "two ranks share one GPU: check CUDA_VISIBLE_DEVICES and that -n is at most the GPU count"),
    (r"shm|shared memory|No space left on device", "/dev/shm is too small for NCCL's shared-memory transport: "
                                                   "docker --ipc=host or --shm-size=16g"),
    (r"unhandled system error|ncclSystemError", "NCCL hit a system error (sockets, /dev/shm, IB verbs); rerun with "
                                                "NCCL_DEBUG=INFO and read the first WARN line"),
    (r"unhandled cuda error|CUDA error|cudaError", "a CUDA error: driver/runtime mismatch or a faulty GPU; check `nvidia-smi` and dmesg"),
    (r"invalid usage|ncclInvalidUsage", "NCCL rejected the call: often two ranks on one GPU or mismatched tensors"),
    (r"timed out|timeout|Timeout|DistStoreError", "ranks could not reach each other in time: a firewall, the wrong interface "
                                                  "(NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) or an unreachable MASTER_ADDR"),
    (r"Connection refused|Connection reset|Broken pipe", "a rank died or refused the connection: read that rank's error above"),
    (r"out of memory", "a GPU is out of memory: another process holds it (`nvidia-smi`)"),
]


def likely_cause(message: str) -> str:
    """The most likely cause of a smoke-test failure, from its error text.

    >>> likely_cause("DistStoreError: Socket Timeout")[:25]
    'ranks could not reach eac'
    """
    for pattern, cause in CAUSES:
        if re.search(pattern, message, re.I):
            return cause
    return "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=INFO and read the first error of the first failing rank"


@record
def smoke_rank(backend: str | None, timeout: float) -> dict:
    """One rank of the smoke test (module level: the launcher imports it in each worker)."""
    import time

    import torch
    import torch.distributed as tdist

    from ..dist import init

    torch.set_num_threads(1)
    with init(backend=backend, seed=None, timeout=timeout) as dist:
        n, r = dist.world_size, dist.rank
        expect = n * (n + 1) / 2
        # A small message (NCCL's low-latency protocol) and 4 MiB (its bandwidth path); both checked exactly.
        for numel in (256, 1 << 20):
            x = torch.full((numel,), float(r + 1), device=dist.device)
            tdist.all_reduce(x)
            wrong = int((x != expect).sum())
            if wrong:
                raise RuntimeError(f"all_reduce returned wrong values on rank {r}: {wrong} of {numel} elements differ from {expect}")
        x = torch.ones(1, device=dist.device)
        sync = torch.cuda.synchronize if dist.device.type == "cuda" else (lambda: None)
        iters = 20
        tdist.all_reduce(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            tdist.all_reduce(x)
        sync()
        lat = torch.tensor([(time.perf_counter() - t0) / iters * 1e6], device=dist.device, dtype=torch.float64)
        tdist.all_reduce(lat, op=tdist.ReduceOp.MAX)
        return {"rank": r, "latency_us": float(lat.item()), "backend": dist.backend, "device": str(dist.device), "world_size": n}


def run_smoke(nproc: int, backend: str | None = None, timeout: float = 60.0) -> list[Finding]:
    """Start ``nproc`` ranks, all-reduce, check the result, report latency (or the likely cause)."""
    from ..commbench.launch import LaunchError, launch_local

    c = "smoke test"
    try:
        res = launch_local(smoke_rank, nproc, backend, timeout, timeout=timeout)
    except LaunchError as err:
        first = err.message.strip().splitlines()[-1] if err.message.strip() else f"exit code {err.exitcode}"
        return [Finding(PROBLEM, f"{nproc} ranks: rank {err.rank} failed: {first[:300]}", likely_cause(err.message), c)]
    r0 = res[0]
    return [Finding(OK, f"{nproc} ranks over {r0['backend']} ({r0['device'].split(':')[0]}): all_reduce correct, "
                    f"latency {r0['latency_us']:.0f} µs per small all_reduce (max over ranks)", "", c)]
