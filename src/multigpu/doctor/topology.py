"""GPU topology: ``nvidia-smi topo -m`` parsed, NVML as the fallback, IB devices from sysfs.

The parser works on text so it is tested on fabricated matrices; the
collectors only run the commands / libraries and hand the text over.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Connection legend of `nvidia-smi topo -m`, best first.
LINK_KINDS = {
    "X": "self",
    "NV": "NVLink",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges",
    "PHB": "PCIe host bridge (CPU)",
    "NODE": "PCIe host bridges within a NUMA node",
    "SYS": "across NUMA nodes (SMP interconnect)",
    "SOC": "across CPU sockets (old name of SYS)",
}


@dataclass(frozen=True)
class Topology:
    """Link type between each pair of devices (GPU0.., NIC0..), as nvidia-smi names it."""

    devices: tuple[str, ...] = ()
    links: dict = field(default_factory=dict)  # (a, b) -> "NV12" | "PIX" | ...
    nics: dict = field(default_factory=dict)  # "NIC0" -> "mlx5_0"
    source: str = ""

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nvlink(self) -> bool:
        return any(v.startswith("NV") for v in self.links.values())

    def nvlink_pairs(self) -> list[tuple[str, str, str]]:
        return [(a, b, v) for (a, b), v in sorted(self.links.items()) if a < b and v.startswith("NV")]

    def summary(self) -> str:
        g = self.gpus
        if len(g) < 2:
            return f"{len(g)} GPU(s), no GPU-to-GPU links"
        kinds = sorted({self.links.get((a, b), "?") for a in g for b in g if a < b})
        return f"{len(g)} GPUs, GPU-GPU links: {', '.join(kinds)}" + (" (NVLink present)" if self.nvlink else " (no NVLink)")


def parse_topo_matrix(text: str) -> Topology:
    """Parse the matrix printed by ``nvidia-smi topo -m``.

    >>> t = parse_topo_matrix("\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tNV12\\t0-63\\nGPU1\\tNV12\\t X \\t0-63\\n")
    >>> t.nvlink, t.links[("GPU0", "GPU1")]
    (True, 'NV12')
    """
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header: list[str] = []
    links: dict = {}
    nics: dict = {}
    for ln in lines:
        tokens = ln.split()
        if not tokens:
            continue
        m = re.match(r"\s*(NIC\d+):\s*(\S+)", ln)
        if m:  # NIC legend: "  NIC0: mlx5_0"
            nics[m.group(1)] = m.group(2)
            continue
        if not header and re.fullmatch(r"(GPU|NIC)\d+", tokens[0]) and ln[:1].isspace():
            # Header row: device names up to the affinity columns.
            header = [t for t in tokens if re.fullmatch(r"(GPU|NIC)\d+", t)]
            continue
        if header and re.fullmatch(r"(GPU|NIC)\d+", tokens[0]):
            row = tokens[0]
            for col, value in zip(header, tokens[1:1 + len(header)]):
                links[(row, col)] = value
    return Topology(tuple(header), links, nics, "nvidia-smi topo -m")


def run_topo_matrix(timeout: float = 15.0) -> str | None:
    """Text of ``nvidia-smi topo -m``, or None where nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        res = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def nvml_topology() -> Topology | None:
    """The same matrix from NVML (nvidia-ml-py): NVLink or PCIe distance per GPU pair."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no NVML
        return None
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        pci = [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
        nvlinks: dict[tuple[int, int], int] = {}
        switch_links = [0] * n  # links to an NVSwitch (DGX/HGX): every GPU pair on the switch is NVLink-connected
        for i, h in enumerate(handles):
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                except Exception:  # noqa: BLE001 - link absent / not supported
                    continue
                if remote in pci:
                    j = pci.index(remote)
                    nvlinks[(i, j)] = nvlinks.get((i, j), 0) + 1
                else:
                    switch_links[i] += 1
        level_names = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
        links = {}
        for i in range(n):
            for j in range(n):
                if i == j:
                    links[(f"GPU{i}", f"GPU{j}")] = "X"
                elif (i, j) in nvlinks:
                    links[(f"GPU{i}", f"GPU{j}")] = f"NV{nvlinks[(i, j)]}"
                elif switch_links[i] and switch_links[j]:
                    links[(f"GPU{i}", f"GPU{j}")] = f"NV{min(switch_links[i], switch_links[j])}"
                else:
                    try:
                        lvl = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                        links[(f"GPU{i}", f"GPU{j}")] = level_names.get(int(lvl), "SYS")
                    except Exception:  # noqa: BLE001
                        links[(f"GPU{i}", f"GPU{j}")] = "?"
        return Topology(tuple(f"GPU{i}" for i in range(n)), links, {}, "NVML")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def collect_topology() -> Topology | None:
    text = run_topo_matrix()
    if text:
        topo = parse_topo_matrix(text)
        if topo.devices:
            return topo
    return nvml_topology()


def ib_devices(root: str = "/sys/class/infiniband") -> tuple[str, ...]:
    """InfiniBand / RoCE HCA names (mlx5_0, ...) with at least one ACTIVE port."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ()
    active = []
    for name in names:
        ports = os.path.join(root, name, "ports")
        try:
            states = [open(os.path.join(ports, p, "state")).read() for p in os.listdir(ports)]
        except OSError:
            states = []
        if not states or any("ACTIVE" in s for s in states):
            active.append(name)
    return tuple(active)
