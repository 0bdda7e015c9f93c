"""The machine a forecast is for: a GPU kind from a table of public spec figures, and the cluster around it.

The table (``meter/gpus.json``, which the step meter's MFU reads too) holds, per kind, the vendor's dense peak (half the "with sparsity" figure)
for bf16 and fp8, the HBM's size and bandwidth, and the collective bus bandwidth nccl-tests reaches on the
node's scale-up link (NVLink, Infinity Fabric) and on one scale-out NIC per GPU; each figure names its
source there. ``Cluster`` is that kind times a GPU count and a node size, with every figure overridable
(a forecast for a machine the table does not describe exactly: 96 GB H100s, 200 Gb/s NICs). The vendors'
memory figure is read as GiB: that is about what the device reports (an "80 GB" H100: 79.6 GiB, a "141 GB"
H200: 140 GiB), where 1e9 bytes would make every layout look 7 % tighter than it is.

A machine known by measurement rather than by its spec sheet (``multigpu tune``'s probe of this one) is a
``Cluster`` too: its ``rates`` (FLOP/s a micro-batch's forward and backward achieved, per micro-batch size and
recompute) replace peak x efficiency, its ``links`` (each collective timed at a few sizes on each group size)
replace the bus-bandwidth model.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ..errors import UsageError
from ..meter.gpus import kinds

GiB = 2**30
DATA = Path(__file__).resolve().parent / "tables"  # not data/: .gitignore leaves data/ folders out


@dataclass(frozen=True)
class Gpu:
    kind: str
    name: str
    hbm_bytes: float
    hbm_bandwidth: float      # bytes/s
    bf16_flops: float         # dense peak, FLOP/s
    fp8_flops: float | None   # dense peak, FLOP/s (None: no fp8 tensor cores)
    scale_up_busbw: float     # bytes/s, a large all-reduce's busbw inside a node (nccl-tests)
    scale_out_busbw: float    # bytes/s, per GPU across nodes (one NIC per GPU)


@cache
def table() -> dict[str, dict]:
    """The GPU kinds a forecast is for: those of the meter's table (``meter/gpus.json``: GB, TB/s, TFLOP/s, GB/s,
    sources) whose collective bandwidths are known."""
    return {k: row for k, row in kinds().items() if row["scale_up_busbw_gb_s"] is not None}


def gpu(kind: str) -> Gpu:
    """The spec figures of ``kind`` (``h100``, ``a100-80gb``, ...); an unknown kind is one line naming the known."""
    row = table().get(kind.lower())
    if row is None:
        raise UsageError(f"unknown GPU kind {kind!r}; expected one of {', '.join(table())} "
                         "(or describe yours: --gpu h100 --hbm-gib 96 --peak-tflops 800 ...)")
    fp8 = row["tflops"].get("fp8")
    return Gpu(kind.lower(), row["name"], row["hbm_gb"] * GiB, row["hbm_tb_s"] * 1e12, row["tflops"]["bf16"] * 1e12,
               None if fp8 is None else fp8 * 1e12, row["scale_up_busbw_gb_s"] * 1e9,
               row["scale_out_busbw_gb_s"] * 1e9)


class Links:
    """Seconds of a collective of ``nbytes`` (the whole buffer: what an all-gather gathers, an all-reduce
    reduces) on ``n`` ranks, interpolated from measured points (log-log); ``send`` is a broadcast on 2."""

    def __init__(self, points: dict[tuple[str, int], list[tuple[int, float]]]) -> None:
        self.points = {k: sorted(v) for k, v in points.items()}

    def time(self, op: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        pts = self.points.get(("broadcast", 2) if op == "send" else (op, n))
        if not pts:
            raise UsageError(f"no measurement of {op} on {n} ranks on this machine")
        sizes = [s for s, _ in pts]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return pts[0][1]  # latency-bound below the smallest size
        if i == len(pts):
            (s0, t0), (s1, t1) = pts[-2], pts[-1]
            return t1 + (nbytes - s1) * (t1 - t0) / (s1 - s0)  # the largest sizes' bandwidth
        (s0, t0), (s1, t1) = pts[i - 1], pts[i]
        w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


# What one rank moves per byte of the buffer, of (n - 1) / n (nccl-tests' bus bandwidth convention); a send
# moves the buffer once.
_BUS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    gpus: int
    gpus_per_node: int = 8
    rates: dict | None = field(default=None, compare=False)  # measured FLOP/s per (micro_batch, recompute)
    links: Links | None = field(default=None, compare=False)  # measured collectives
    # How much slower each rank computes while every rank does (ranks sharing CPU cores: the rates above are
    # already that slow); a rank idle in a pipeline's bubble gives its share back. 1 on a cluster of GPUs.
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise UsageError(f"a cluster needs at least 1 GPU and 1 per node, got {self.gpus} GPUs, "
                             f"{self.gpus_per_node} per node")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise UsageError(f"{self.gpus} GPUs do not fill nodes of {self.gpus_per_node}; give --gpus as a multiple "
                             f"of --gpus-per-node")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def busbw(self, span: int) -> float:
        """Bus bandwidth of a collective whose group's ranks lie ``span`` consecutive GPUs apart at most
        (inner mesh dimensions are consecutive ranks): the NIC's once the group leaves a node."""
        inside = span <= self.gpus_per_node and self.gpus_per_node % span == 0  # else some group straddles nodes
        return self.gpu.scale_up_busbw if inside else self.gpu.scale_out_busbw

    def collective_s(self, op: str, n: int, span: int, nbytes: float, calls: float = 1.0) -> float:
        """Seconds of ``calls`` collectives ``op`` among ``n`` ranks lying ``span`` GPUs apart, each of ``nbytes``:
        measured where the links are, else the buffer x the op's bus factor / the span's bus bandwidth."""
        if n <= 1 or calls <= 0 or nbytes <= 0:
            return 0.0
        if self.links is not None:
            return calls * self.links.time(op, n, nbytes)
        bus = _BUS[op] * (n - 1) / n if op != "send" else 1.0
        return calls * nbytes * bus / self.busbw(span)

    def rate(self, micro_batch: int, recompute: str) -> float | None:
        """The measured FLOP/s of that micro-batch (None: a described GPU, whose peak x efficiency serves)."""
        if self.rates is None:
            return None
        if (micro_batch, recompute) not in self.rates:
            raise UsageError(f"micro-batch {micro_batch} with recompute {recompute} was not measured on this machine")
        return self.rates[(micro_batch, recompute)]

    def peak(self, precision: str) -> float:
        if precision == "fp8":
            if self.gpu.fp8_flops is None:
                raise UsageError(f"{self.gpu.name} has no fp8 tensor cores; use --precision bf16")
            return self.gpu.fp8_flops
        return self.gpu.bf16_flops


def cluster(kind: str, gpus: int, gpus_per_node: int = 8, *, hbm_gib: float | None = None,
            peak_tflops: float | None = None, scale_up_gb_s: float | None = None,
            scale_out_gb_s: float | None = None) -> Cluster:
    """A cluster of ``gpus`` GPUs of ``kind``, with any spec figure replaced (memory in GiB, GB/s 1e9 bytes;
    ``peak_tflops`` replaces the bf16 peak and scales fp8's alike)."""
    g = gpu(kind)
    changes = {}
    for value, name in ((hbm_gib, "--hbm-gib"), (peak_tflops, "--peak-tflops"), (scale_up_gb_s, "--scale-up-gb-s"),
                        (scale_out_gb_s, "--scale-out-gb-s")):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be a positive number, got {value}")
    if hbm_gib is not None:
        changes["hbm_bytes"] = hbm_gib * GiB
    if peak_tflops is not None:
        ratio = peak_tflops * 1e12 / g.bf16_flops
        changes["bf16_flops"] = peak_tflops * 1e12
        changes["fp8_flops"] = None if g.fp8_flops is None else g.fp8_flops * ratio
    if scale_up_gb_s is not None:
        changes["scale_up_busbw"] = scale_up_gb_s * 1e9
    if scale_out_gb_s is not None:
        changes["scale_out_busbw"] = scale_out_gb_s * 1e9
    return Cluster(dataclasses.replace(g, **changes), gpus, gpus_per_node)
