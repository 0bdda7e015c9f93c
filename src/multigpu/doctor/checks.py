"""Version, device and host checks: pure functions of collected facts, plus the collectors.

Every ``check_*`` takes plain values (so tests can fabricate any machine) and
returns findings; every ``collect_*`` reads the real machine.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field

from .findings import OK, PROBLEM, WARNING, Finding, is_secret
from .topology import Topology

GiB = 2**30


# -- versions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Versions:
    python: str
    torch: str
    distributed: bool
    backends: dict = field(default_factory=dict)  # name -> bool
    cuda_runtime: str | None = None  # torch.version.cuda
    cuda_available: bool = False
    driver: str | None = None
    driver_cuda: str | None = None  # highest CUDA version the driver supports
    driver_gpus: int = 0  # GPUs the driver (NVML) sees, whatever torch thinks
    nccl: str | None = None
    cudnn: str | None = None


def _ver(s: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in (s or "").split(".")[:2])
    except ValueError:
        return ()


def check_versions(v: Versions) -> list[Finding]:
    """Findings about the software stack.

    >>> check_versions(Versions("3.11.9", "2.7.0", False))[1].status
    'problem'
    """
    c = "versions"
    out = [Finding(OK, f"Python {v.python}, torch {v.torch}", "", c)]
    if not v.distributed:
        out.append(Finding(PROBLEM, "torch was built without torch.distributed", "install an official torch wheel", c))
        return out
    have = ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in v.backends.items())
    gpus = max(v.driver_gpus, 1 if v.cuda_available else 0)
    if gpus and not v.backends.get("nccl"):
        out.append(Finding(PROBLEM, f"backends: {have}; {gpus} NVIDIA GPU(s) present but no NCCL in this torch build",
                           "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu12x)", c))
    elif not v.backends.get("gloo"):
        out.append(Finding(WARNING, f"backends: {have}; gloo missing (CPU collectives, barriers on CPU tensors)", "install an official torch wheel", c))
    else:
        out.append(Finding(OK, f"torch.distributed backends: {have}", "", c))
    if v.driver_gpus and not v.cuda_available:
        why = "torch is a CPU-only build" if not v.cuda_runtime else f"torch's CUDA {v.cuda_runtime} runtime cannot use this driver"
        out.append(Finding(PROBLEM, f"the driver sees {v.driver_gpus} GPU(s) but torch.cuda.is_available() is False: {why}",
                           "install a torch build whose CUDA version the driver supports (nvidia-smi shows it)", c))
    elif v.cuda_runtime and v.driver_cuda and _ver(v.driver_cuda) and _ver(v.driver_cuda) < _ver(v.cuda_runtime):
        out.append(Finding(WARNING, f"driver {v.driver} supports CUDA {v.driver_cuda}, torch was built for CUDA {v.cuda_runtime} "
                           "(works only through forward-compatibility packages)", "update the NVIDIA driver", c))
    if v.cuda_runtime or v.driver:
        out.append(Finding(OK, f"CUDA runtime {v.cuda_runtime or 'none'}, driver {v.driver or 'none'}"
                           + (f" (supports CUDA {v.driver_cuda})" if v.driver_cuda else ""), "", c))
    else:
        out.append(Finding(OK, "no CUDA runtime or NVIDIA driver: CPU/gloo only", "", c))
    if v.nccl or v.cudnn:
        out.append(Finding(OK, f"NCCL {v.nccl or 'not built in'}, cuDNN {v.cudnn or 'not available'}", "", c))
    return out


def collect_versions() -> Versions:
    import torch
    import torch.distributed as tdist

    backends = {}
    if tdist.is_available():
        backends = {"nccl": tdist.is_nccl_available(), "gloo": tdist.is_gloo_available(), "mpi": tdist.is_mpi_available()}
    nccl = None
    if backends.get("nccl"):
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - no libnccl loaded
            nccl = None
    cudnn = None
    try:
        cudnn = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    driver, driver_cuda, driver_gpus = _nvml_driver()
    return Versions(platform.python_version(), torch.__version__, tdist.is_available(), backends, torch.version.cuda,
                    torch.cuda.is_available(), driver, driver_cuda, driver_gpus, nccl, cudnn)


def _nvml_driver() -> tuple[str | None, str | None, int]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver
        return None, None, 0
    try:
        drv = pynvml.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else drv
        cv = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
        return drv, f"{cv // 1000}.{cv % 1000 // 10}", pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001
        return None, None, 0
    finally:
        pynvml.nvmlShutdown()


# -- devices -------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory: int  # bytes
    capability: tuple[int, int]


def check_devices(gpus: list[Gpu], topo: Topology | None) -> list[Finding]:
    """Findings about the GPUs and how they are connected."""
    c = "devices"
    if not gpus:
        return [Finding(OK, "no CUDA GPU visible: collectives run on CPU over gloo", "", c)]
    out = [Finding(OK, f"GPU{g.index}: {g.name}, {g.memory / GiB:.1f} GiB, compute capability {g.capability[0]}.{g.capability[1]}", "", c)
           for g in gpus]
    if len({(g.name, g.memory) for g in gpus}) > 1:
        out.append(Finding(WARNING, "the GPUs are not all the same model: the slowest one sets the pace of every step",
                           "use CUDA_VISIBLE_DEVICES to select identical GPUs", c))
    if len(gpus) < 2:
        return out
    if topo is None or not topo.gpus:
        out.append(Finding(WARNING, "GPU topology unknown (nvidia-smi topo and NVML unavailable)",
                           "install the NVIDIA driver utilities or nvidia-ml-py to see NVLink/PCIe links", c))
    elif topo.nvlink:
        pairs = ", ".join(f"{a}-{b} {v}" for a, b, v in topo.nvlink_pairs()[:6])
        out.append(Finding(OK, f"{topo.summary()}: {pairs}{' ...' if len(topo.nvlink_pairs()) > 6 else ''} [{topo.source}]", "", c))
    else:
        sys_pairs = [(a, b) for (a, b), v in topo.links.items() if a < b and a.startswith("GPU") and b.startswith("GPU") and v in ("SYS", "SOC")]
        status, fix = (WARNING, "keep communicating GPUs on one CPU socket (CUDA_VISIBLE_DEVICES) where you can") if sys_pairs else (OK, "")
        out.append(Finding(status, f"{topo.summary()}: GPU-to-GPU traffic goes over PCIe"
                           + (f", {len(sys_pairs)} pair(s) across CPU sockets" if sys_pairs else "") + f" [{topo.source}]", fix, c))
    return out


def collect_gpus() -> list[Gpu]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Gpu(i, p.name, p.total_memory, (p.major, p.minor)))
    return out


def check_p2p(results: dict) -> list[Finding]:
    """``results[(i, j)] = (peer_access, copy_correct or None)`` -> findings.

    >>> check_p2p({(0, 1): (True, False)})[0].status
    'problem'
    """
    c = "devices"
    out = []
    wrong = [(i, j) for (i, j), (acc, ok) in sorted(results.items()) if acc and ok is False]
    no_access = [(i, j) for (i, j), (acc, _) in sorted(results.items()) if not acc]
    good = [(i, j) for (i, j), (acc, ok) in sorted(results.items()) if acc and ok]
    for i, j in wrong:
        out.append(Finding(PROBLEM, f"P2P copy GPU{i} -> GPU{j} returned wrong data (a known fault of some consumer GPUs / PCIe ACS, IOMMU)",
                           "set NCCL_P2P_DISABLE=1 (the case it exists for) and report it; or disable ACS/IOMMU in the BIOS", c))
    if no_access:
        pairs = ", ".join(f"{i}-{j}" for i, j in no_access[:8])
        out.append(Finding(WARNING, f"no P2P access between GPU pairs {pairs}: their traffic is staged through host memory",
                           "expected across CPU sockets or on some consumer GPUs; otherwise check ACS/IOMMU settings", c))
    if good:
        out.append(Finding(OK, f"P2P access and copy check correct for {len(good)} GPU pair(s)", "", c))
    return out


def collect_p2p(n: int, nbytes: int = 16 * 2**20) -> dict:
    """Peer access for every ordered GPU pair, and a copy round trip compared bit for bit."""
    import torch

    results = {}
    if n < 2:
        return results
    gen = torch.Generator().manual_seed(0)
    ref = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=gen)
    for i in range(n):
        src = ref.to(f"cuda:{i}")
        for j in range(n):
            if i == j:
                continue
            access = torch.cuda.can_device_access_peer(i, j)
            ok = None
            if access:
                # torch copies between devices with cudaMemcpyPeer when peer access is on: the path NCCL's P2P uses.
                dst = src.to(f"cuda:{j}")
                torch.cuda.synchronize(j)
                ok = bool(torch.equal(dst.cpu(), ref))
            results[(i, j)] = (access, ok)
    return results


# -- host ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Iface:
    name: str
    up: bool
    addrs: tuple[str, ...] = ()


def check_shm(total: int | None, gpus: int) -> list[Finding]:
    c = "host"
    if total is None:
        return [Finding(WARNING, "/dev/shm is missing: NCCL's shared-memory transport and DataLoader workers need it",
                        "mount a tmpfs on /dev/shm (docker: --ipc=host or --shm-size=16g)", c)]
    what = f"/dev/shm is {total / GiB:.1f} GiB" if total >= GiB else f"/dev/shm is {total / 2**20:.0f} MiB"
    if total < 512 * 2**20:
        status = PROBLEM if gpus > 1 else WARNING
        return [Finding(status, f"{what}: too small for NCCL between local ranks and DataLoader workers (docker's default is 64 MiB)",
                        "docker run --ipc=host (or --shm-size=16g); Kubernetes: an emptyDir with medium: Memory on /dev/shm", c)]
    if total < 2 * GiB:
        return [Finding(WARNING, f"{what}: small for many local ranks or DataLoader workers", "raise it to several GiB (--shm-size)", c)]
    return [Finding(OK, what, "", c)]


def check_nofile(soft: int, hard: int) -> list[Finding]:
    c = "host"
    if soft < 4096:
        return [Finding(WARNING, f"open file limit is {soft} (hard {hard}): DataLoader workers and NCCL sockets can run out",
                        f"ulimit -n {min(hard, 65536) if hard > 0 else 65536}", c)]
    return [Finding(OK, f"open file limit {soft}", "", c)]


def check_interfaces(ifaces: list[Iface]) -> list[Finding]:
    c = "host"
    desc = ", ".join(f"{i.name} ({'up' if i.up else 'down'}{', ' + ' '.join(i.addrs) if i.addrs else ''})" for i in ifaces)
    real = [i for i in ifaces if i.up and i.name != "lo"]
    if not real:
        return [Finding(WARNING, f"network interfaces: {desc or 'none'}; only loopback is up, so only single-node runs can work",
                        "bring up a network interface for multi-node runs", c)]
    return [Finding(OK, f"network interfaces: {desc}", "", c)]


def check_port(port: int, error: str | None) -> list[Finding]:
    c = "host"
    if error:
        return [Finding(PROBLEM, f"rendezvous port {port} is in use ({error}): another job or a leftover process holds it",
                        f"stop that process, or pick a free port (MASTER_PORT / --master-port), e.g. {port + 1}", c)]
    return [Finding(OK, f"rendezvous port {port} is free", "", c)]


def check_torchft(version: str | None, lighthouse: str | None, error: str | None) -> list[Finding]:
    """``multigpu run --fault-tolerant``'s needs: torchft's release, and the lighthouse named by
    TORCHFT_LIGHTHOUSE (torchft's own variable) reachable when one is named.

    >>> check_torchft(None, None, None)[0].what
    "torchft not installed: multigpu run --fault-tolerant needs it (pip install 'multigpu[ft]')"
    """
    c = "fault tolerance"
    if version is None:
        return [Finding(OK, "torchft not installed: multigpu run --fault-tolerant needs it (pip install 'multigpu[ft]')", "", c)]
    out = [Finding(OK, f"torchft {version}", "", c)]
    if lighthouse and error:
        out.append(Finding(PROBLEM, f"TORCHFT_LIGHTHOUSE={lighthouse} cannot be reached ({error})",
                           "start the lighthouse (torchft_lighthouse --min_replicas 1 --bind [::]:PORT) or unset "
                           "TORCHFT_LIGHTHOUSE (multigpu run --fault-tolerant starts its own)", c))
    elif lighthouse:
        out.append(Finding(OK, f"lighthouse {lighthouse} answers", "", c))
    return out


def torchft_status(environ: dict) -> tuple[str | None, str | None, str | None]:
    """(torchft's version or None, TORCHFT_LIGHTHOUSE or None, why it cannot be reached or None)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        version = None
    lighthouse = environ.get("TORCHFT_LIGHTHOUSE") or None
    if not lighthouse:
        return version, None, None
    host, _, port = lighthouse.split("://")[-1].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except (OSError, ValueError) as err:
        return version, lighthouse, getattr(err, "strerror", None) or str(err)
    return version, lighthouse, None


def check_secrets(env: dict) -> list[Finding]:
    names = sorted(k for k, v in env.items() if is_secret(k, v))
    if not names:
        return []
    return [Finding(OK, f"{len(names)} variable(s) look like credentials ({', '.join(names[:6])}{' ...' if len(names) > 6 else ''}); "
                    "their values are never printed", "", "host")]


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def nofile_limit() -> tuple[int, int]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = 2**31
    return (inf if soft == resource.RLIM_INFINITY else soft), (inf if hard == resource.RLIM_INFINITY else hard)


def collect_interfaces() -> list[Iface]:
    names = [n for _, n in socket.if_nameindex()]
    addrs: dict[str, list[str]] = {}
    try:
        import psutil  # optional: addresses only

        for name, lst in psutil.net_if_addrs().items():
            addrs[name] = [a.address for a in lst if a.family == socket.AF_INET]
    except ImportError:
        pass
    out = []
    for n in names:
        try:
            state = open(f"/sys/class/net/{n}/operstate").read().strip()
        except OSError:
            state = "unknown"
        # lo reports "unknown"; so do some virtual NICs that work.
        up = state == "up" or (state == "unknown" and bool(addrs.get(n)))
        out.append(Iface(n, up, tuple(addrs.get(n, ()))))
    return out


def port_in_use(port: int) -> str | None:
    """None when ``port`` can be bound on all interfaces (as TCPStore does), else the error."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # SO_REUSEADDR as TCPStore sets it: TIME_WAIT leftovers do not block, a listener does.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError as err:
        return err.strerror or str(err)
    finally:
        s.close()
    return None
