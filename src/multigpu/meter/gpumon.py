"""A background NVML sampler: utilisation, memory, power and temperature of this rank's GPU.

NVML's utilisation is "a kernel was running during the sample period"; a
NCCL kernel spinning in a collective that waits for a slow rank reads ~100 %
(see docs/observability.md), so read it together with power and step progress.
Without NVML (no driver, CPU run, nvidia-ml-py missing) the monitor is off and
says so once.
"""

from __future__ import annotations

import math
import threading
from typing import Any

# Per-sample fields, in the order they travel in the meter's gathered vector.
FIELDS = ("util_pct", "mem_used_gb", "power_w", "temp_c")


def _load_nvml():
    import pynvml  # the nvidia-ml-py package

    pynvml.nvmlInit()
    return pynvml


class GpuMonitor:
    """Samples one GPU every ``interval`` s on a daemon thread; ``take()`` summarises and resets.

    ``nvml`` may be given (a module with pynvml's API) for tests; by default
    pynvml is imported and initialised, and any failure turns the monitor off
    with ``reason`` set.

    >>> mon = GpuMonitor(device_index=0); mon.start(); ...; mon.take()["util_pct"]
    {'min': 97.0, 'max': 100.0, 'mean': 99.1}
    """

    def __init__(self, device_index: int = 0, interval: float = 1.0, nvml: Any = None, uuid: str | None = None) -> None:
        self.interval = interval
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._nvml = nvml if nvml is not None else _load_nvml()
            # NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES; the UUID names the same GPU in both.
            if uuid:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as err:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
            self._nvml = None
            self.reason = f"GPU monitor off: NVML unavailable ({type(err).__name__}: {err})".strip()

    @property
    def enabled(self) -> bool:
        return self._nvml is not None

    def sample(self) -> tuple[float, ...]:
        n, h = self._nvml, self._handle
        util = float(n.nvmlDeviceGetUtilizationRates(h).gpu)
        mem = n.nvmlDeviceGetMemoryInfo(h).used / 1e9
        try:
            power = n.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW -> W
        except Exception:  # noqa: BLE001 - some boards do not report power
            power = math.nan
        temp = float(n.nvmlDeviceGetTemperature(h, getattr(n, "NVML_TEMPERATURE_GPU", 0)))
        return util, mem, power, temp

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                s = self.sample()
            except Exception as err:  # noqa: BLE001 - a vanished GPU stops the sampler, not the job
                self.reason = f"GPU monitor stopped: {type(err).__name__}: {err}"
                return
            with self._lock:
                self._samples.append(s)

    def start(self) -> "GpuMonitor":
        if self.enabled and self._thread is None:
            with self._lock:
                self._samples.append(self.sample())
            self._thread = threading.Thread(target=self._run, name="multigpu-gpumon", daemon=True)
            self._thread.start()
        return self

    def take(self) -> dict[str, dict[str, float]] | None:
        """{field: {min, max, mean}} over the samples since the last call; None when off or empty."""
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return None
        out = {}
        for i, name in enumerate(FIELDS):
            vals = [s[i] for s in samples if not math.isnan(s[i])]
            out[name] = ({"min": min(vals), "max": max(vals), "mean": sum(vals) / len(vals)} if vals
                         else {"min": math.nan, "max": math.nan, "mean": math.nan})
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None


def as_vector(summary: dict[str, dict[str, float]] | None) -> list[float]:
    """min, max, mean per field, flattened (NaN when off) for the meter's gather."""
    if summary is None:
        return [math.nan] * (3 * len(FIELDS))
    return [summary[f][k] for f in FIELDS for k in ("min", "max", "mean")]


def across_ranks(vectors: list[list[float]]) -> dict[str, dict[str, float]] | None:
    """Per field: min and max over ranks (and which rank holds them), mean of the rank means."""
    out: dict[str, dict[str, float]] = {}
    for i, name in enumerate(FIELDS):
        mins = [(v[3 * i], r) for r, v in enumerate(vectors) if not math.isnan(v[3 * i])]
        maxs = [(v[3 * i + 1], r) for r, v in enumerate(vectors) if not math.isnan(v[3 * i + 1])]
        means = [v[3 * i + 2] for v in vectors if not math.isnan(v[3 * i + 2])]
        if not mins:
            continue
        lo, hi = min(mins), max(maxs)
        out[name] = {"min": lo[0], "min_rank": lo[1], "max": hi[0], "max_rank": hi[1], "mean": sum(means) / len(means)}
    return out or None
