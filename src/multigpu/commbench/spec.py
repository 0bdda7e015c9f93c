"""What to measure: ops, sizes, dtypes, and nccl-tests' bandwidth formulas.

Sizes are read by ``values.parse_size``, as every size flag: ``K``, ``M``,
``G`` are binary (``256M`` = 256 MiB, as nccl-tests' -b/-e), so are ``KiB`` ..
``GiB``; ``KB``, ``MB``, ``GB`` are decimal (``1MB`` = 10**6 bytes).
Bandwidths are decimal (1 GB/s = 1e9 bytes/s), as in nccl-tests'
doc/PERFORMANCE.md; the two bases stay apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from ..runtime.values import dtype_name, parse_size
from . import OPS

_OP_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "bcast": "broadcast", "alltoall": "all_to_all", "all2all": "all_to_all"}
# torch.distributed.all_reduce and broadcast work in place by API; all_to_all_single has no
# in-place form in NCCL. The other two have both (in place: the input is this rank's slice of the output).
PLACES = {"all_reduce": ("in",), "broadcast": ("in",), "all_gather": ("out", "in"),
          "reduce_scatter": ("out", "in"), "all_to_all": ("out",)}
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum"}
ROOT = {"broadcast": 0}

# --sizes' default where none is given: nccl-tests' usual sweep on GPUs, a shorter one for gloo's copies on CPU.
GPU_SIZES, CPU_SIZES = "8:256M", "8:4M"

# nccl-tests' name of each type, for its "type" column (the dtypes themselves: values.DTYPES).
NCCL_TYPE = {"fp32": "float", "fp16": "half", "bf16": "bfloat16", "fp64": "double", "int8": "int8", "uint8": "uint8",
             "int32": "int32", "int64": "int64"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for ``n`` ranks.

    >>> bus_factor("all_reduce", 8), bus_factor("all_gather", 4), bus_factor("broadcast", 8)
    (1.75, 0.75, 1.0)
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise UsageError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (decimal): size / time."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def parse_sizes(spec: str) -> list[int]:
    """``'MIN:MAX'`` swept by factor 2, or a comma list of sizes (``values.parse_size``'s).

    >>> parse_sizes("8:64"), parse_sizes("1K,4M"), parse_sizes("1MB")
    ([8, 16, 32, 64], [1024, 4194304], [1000000])
    """
    if ":" in spec:
        lo_s, _, hi_s = spec.partition(":")
        lo, hi = parse_size(lo_s, "--sizes"), parse_size(hi_s, "--sizes")
        if lo > hi:
            raise UsageError(f"--sizes {spec}: start {lo} B is larger than end {hi} B; write MIN:MAX, e.g. 8:256M")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out
    return [parse_size(s, "--sizes") for s in spec.split(",")]


def parse_ops(items: list[str] | str | None) -> tuple[str, ...]:
    if not items:
        return OPS
    if isinstance(items, str):
        items = [items]
    out = []
    for item in items:
        for tok in filter(None, item.replace(",", " ").split()):
            name = _OP_ALIASES.get(tok.lower().replace("-", "_"), tok.lower().replace("-", "_"))
            if name not in OPS:
                raise UsageError(f"unknown op {tok!r}; expected some of {', '.join(OPS)}")
            out.append(name)
    return tuple(dict.fromkeys(out))


def parse_dtype(name: str) -> str:
    if dtype_name(name) not in NCCL_TYPE:
        raise UsageError(f"unknown dtype {name!r}; expected one of float32, float16, bfloat16, float64, int8, uint8, int32, int64")
    return name.lower()


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: which collectives, sizes (bytes), dtype and iteration counts.

    >>> BenchConfig(ops=("all_reduce",), sizes=tuple(parse_sizes("8:1M")))
    """

    ops: tuple[str, ...] = OPS
    sizes: tuple[int, ...] = field(default_factory=lambda: tuple(parse_sizes(CPU_SIZES)))
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    check: bool = True
    backend: str | None = None
    group: int | None = None  # ranks per collective: consecutive groups of this many, every group at once (None: all)

    def __post_init__(self):
        # Normalise aliases ("allreduce", "bf16") so every later lookup sees one spelling.
        object.__setattr__(self, "ops", parse_ops(list(self.ops)))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if any(s <= 0 for s in self.sizes):
            raise UsageError(f"sizes must be positive byte counts, got {list(self.sizes)}; use e.g. --sizes 8:256M")
        if self.iters < 1 or self.warmup < 0:
            raise UsageError(f"iters must be >= 1 and warmup >= 0, got iters={self.iters} warmup={self.warmup}")
        if not self.sizes:
            raise UsageError("no sizes to measure; use e.g. --sizes 8:256M")
        if self.group is not None and self.group < 1:
            raise UsageError(f"--group-size must be at least 1, got {self.group}")


@dataclass(frozen=True)
class BenchCommand:
    """What ``multigpu bench`` was asked: a ``BenchConfig`` as flags spell it, and how to launch and print it.
    Each field's docstring is its flag's help in `multigpu bench --help` (commbench/__init__.py); ``None``
    means "choose for this machine" (run.py's main)."""

    nproc: int | None = None
    """ranks to start (default: GPUs visible, else 2)"""
    ops: tuple[str, ...] | None = None
    """collectives (default all): {OPS}"""
    sizes: str | None = None
    """MIN:MAX swept by factor 2, or a comma list; K, M, G and KiB, MiB, GiB binary, KB, MB, GB decimal (default
    {GPU_SIZES} on GPU, {CPU_SIZES} on CPU)"""
    dtype: str = BenchConfig.dtype
    """float32 (default), float16, bfloat16, float64, int8, uint8, int32, int64"""
    warmup: int = BenchConfig.warmup
    """untimed iterations per size (default %(default)s)"""
    iters: int = BenchConfig.iters
    """timed iterations per size (default %(default)s, as nccl-tests)"""
    backend: str | None = BenchConfig.backend
    """default: nccl with GPUs, else gloo"""
    group_size: int | None = None
    """each collective among G consecutive ranks, every group of the -n at once, as a mesh dimension runs inside
    a bigger job (default: all ranks in one)"""
    no_check: bool = False
    """skip the correctness check (#wrong shows N/A)"""
    ddp: str | None = None
    """also time a DDP step's gradient all-reduce for MODEL: gpt2-small, gpt2-medium, gpt2-tiny or
    package.module:factory"""
    bucket_cap_mb: float = 25.0
    """DDP bucket size for --ddp (default %(default)g)"""
    timeout: float = 600.0
    """seconds before a stuck rendezvous/collective fails"""
    json: bool = False
    """print JSON instead of the table"""
