"""``StepMeter``: where the time of each training step goes, with almost no cost of its own.

Per step the meter stores a few timestamps (CUDA events on GPU) and adds the
loss to a running sum on the device; nothing is synchronised. Every
``log_every`` steps it waits for the last step's end event, gathers one small
vector per rank (times, loss and metric sums, peak memory, GPU monitor
summary) and rank 0 writes a record to its sinks. See docs/observability.md
for the record schema.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as tdist

from ..errors import UsageError
from ..runtime.fingerprint import fingerprint
from ..runtime.contract import attempt, launch_id, memory_step_requested, profile_window, run_dir, verify_requested
from ..runtime.values import positive_int
from . import gpumon, sinks as _sinks
from .flops import FlopCount, dtype_key, peak_flops
from .footprint import MemoryStep
from .interval import Interval
from .probe import Probe, dp_rank, is_pipeline
from .quorum import Quorum, change_line
from .records import experts_stats, figures, interval_record, router_note, run_summary, summary_line

SCHEMA_VERSION = 2  # 2: summary throughput from totals, per-interval spreads under "intervals", pauses

class StepMeter:
    """Times data wait and compute per step; logs throughput, MFU, memory, loss, stragglers; with ``step_peak``
    (None: when the launch asks) one warm-up step's real peak memory into the summary (``MemoryStep``).

    >>> with mg.StepMeter(dist, plan, log_every=10, log_dir="runs/x", model=model) as meter:
    ...     for step, micro_batches in meter.steps(train):
    ...         ...  # forward, backward, opt.step()
    ...         meter.step_end(loss=loss, lr=opt.param_groups[0]["lr"])
    """

    def __init__(
        self,
        dist: Any = None,
        plan: Any = None,
        *,
        log_every: int = 10,
        log_dir: str | None = None,
        sinks: Iterable[str] = ("jsonl",),
        model: torch.nn.Module | None = None,
        samples_per_step: int | None = None,
        flops_per_sample: float | str | None = "auto",
        tokens_per_sample: float | None = None,
        dtype: str | torch.dtype | None = None,
        total_steps: int | None = None,
        gpu_monitor: bool = True,
        progress: bool = True,
        watchdog: float | None = 300.0,
        profile: str | tuple[int, int] | None = None,
        straggler_threshold: float = 0.05,
        resume: bool = False,
        fingerprint_extra: dict[str, Any] | None = None,
        sink_options: dict[str, dict[str, Any]] | None = None,
        step_peak: bool | None = None,
        replicas: Any = None,
    ) -> None:
        positive_int(log_every, "log_every", "use e.g. log_every=10")
        log_every = 1 if verify_requested() else log_every  # `multigpu verify` compares every step's loss
        _sinks.check_sinks(sinks)
        self.rank, self.world_size = getattr(dist, "rank", 0), getattr(dist, "world_size", 1)
        self.device = torch.device(getattr(dist, "device", "cpu"))
        self.is_main = self.rank == 0
        self.log_every = log_every
        self.total_steps = total_steps
        self._cuda = self.device.type == "cuda"
        self._distributed = tdist.is_available() and tdist.is_initialized() and self.world_size > 1
        if samples_per_step is None:
            if plan is None:
                raise UsageError("StepMeter needs the global samples per step; pass plan=BatchPlan(...) or samples_per_step=N")
            samples_per_step = plan.global_batch
        self.samples_per_step = int(samples_per_step)
        # mg.fault_tolerant's groups: steps are the committed ones, samples those the quorum trained on
        self._quorum = Quorum(replicas) if replicas is not None else None
        self._ranks = self.world_size * (replicas.groups if replicas is not None else 1)  # every group's ranks
        self._skipped = 0  # samples the missing groups' shares skipped so far
        self.tokens_per_sample = tokens_per_sample
        self._flops_auto = flops_per_sample == "auto" and not is_pipeline(model)
        self.flops_per_sample = None if flops_per_sample in (None, "auto") else float(flops_per_sample)
        self._dtype = dtype_key(dtype)
        name = torch.cuda.get_device_name(self.device) if self._cuda else "cpu"
        self.peak_flops = peak_flops(name, self._dtype) if self._cuda else None
        self.straggler_threshold = straggler_threshold
        self.step = 0  # index of the next step to run
        self._in_step = False
        self._started = False
        self._records: list[dict[str, Any]] = []
        self._streak: dict[tuple[int, str], int] = {}
        self._extra: dict[str, Any] = {}
        self._lr: float | None = None
        self._flop_count: FlopCount | None = None
        self._t_start = time.perf_counter()  # elapsed times: a clock no NTP step moves
        self._iv = Interval()
        self._paused: dict[str, float] = {}

        # Every rank's host, and its launcher's id and attempt (one launcher per node): the header's "launch".
        ranks = self._gather_objects((socket.gethostname(), launch_id(), attempt()))
        self.hosts = [host for host, _, _ in ranks]
        self._launch = {lid: n for _, lid, n in ranks if lid} or None
        self.log_dir = _sinks.agree_log_dir(log_dir, self._distributed)
        os.makedirs(self.log_dir, exist_ok=True)

        self._start_instruments(dist, model, gpu_monitor, watchdog, profile)
        self._experts = experts_stats(model)  # expert parallelism's dispatch figures (none for other models)
        router_note(model, plan)
        self.probe = Probe(model, self.log_dir, self.rank, self.world_size, dp_rank(plan, dist), self._dtype) if verify_requested() else None
        asked = memory_step_requested() if step_peak is None else step_peak  # a warm-up step's real peak (tune's runs)
        self._memory = MemoryStep(self.device, log_every, total_steps) if asked else None
        self._open_sinks(dist, plan, sinks, progress, resume, fingerprint_extra, sink_options, flops_per_sample)

    def _start_instruments(self, dist: Any, model: torch.nn.Module | None, gpu_monitor: bool,
                           watchdog: float | None, profile: Any) -> None:
        """Gradient-ready hooks, GPU monitor, watchdog and profiler, as asked."""
        self._hooks = []
        if model is not None and not is_pipeline(model):
            # The time until this rank's own gradients are ready, before it can wait for
            # anybody in the all-reduce: the fair basis for naming a compute straggler.
            for p in model.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

        self.monitor = None
        self._notes: list[str] = []
        if gpu_monitor and self._cuda:
            uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
            self.monitor = gpumon.GpuMonitor(self.device.index or 0, uuid=f"GPU-{uuid}" if uuid else None).start()
            if not self.monitor.enabled:
                self._notes.append(self.monitor.reason)
        elif gpu_monitor:
            self._notes.append("GPU monitor off: this run is on the CPU")

        from .watchdog import start_watchdog

        self.watchdog = start_watchdog(os.path.join(run_dir() or self.log_dir, "watchdog"), self.rank, self.hosts[self.rank], watchdog)

        profile = profile if profile is not None else profile_window()
        self.profiler = None
        if profile:
            from .profile import Profile

            self.profiler = Profile(dist, profile, out_dir=os.path.join(self.log_dir, "profile")).start()

    def _open_sinks(self, dist: Any, plan: Any, sinks: Iterable[str], progress: bool, resume: bool,
                    fingerprint_extra: dict[str, Any] | None, sink_options: dict[str, dict[str, Any]] | None,
                    flops_per_sample: Any) -> None:
        """Rank 0's header and sinks (a sink that fails to open stops what was started)."""
        self.sinks: list[Any] = []
        self.console = None
        if self.is_main:
            self.header = {
                "type": "header", "schema": SCHEMA_VERSION, "launch": self._launch,
                "fingerprint": fingerprint(dist, **(fingerprint_extra or {})),
                "plan": {k: getattr(plan, k) for k in ("global_batch", "world_size", "micro_batch", "accum_steps")} if plan else None,
                "meter": {"log_every": self.log_every, "samples_per_step": self.samples_per_step, "dtype": self._dtype,
                          "peak_flops": self.peak_flops, "flops_per_sample": flops_per_sample, "hosts": self.hosts},
            }
            if self._quorum is not None:
                self.header["replicas"] = {"groups": self._quorum.groups}
            try:
                self.sinks = _sinks.make_sinks(sinks, self.log_dir, self.header, resume, sink_options or {})
            except BaseException:
                self._shutdown(write_summary=False)  # no threads or hooks left behind
                raise
            if progress:
                self.console = _sinks.ConsoleSink(self.total_steps)
                self.sinks.append(self.console)
                for note in self._notes[:1]:  # said once, by rank 0
                    self.console.note(f"multigpu: {note}")

    # -- collectives used only at construction and at log steps -------------------------
    def _gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [obj] * (1 if not self._distributed else self.world_size)
        if self._distributed:
            tdist.all_gather_object(out, obj)
        return out

    # -- per step: timestamps only ------------------------------------------------------
    def _grad_ready(self, _param) -> None:
        if self._in_step:
            self._iv.grad_ready(len(self._hooks))

    @property
    def will_log(self) -> bool:
        """True while running a step that ends with a log record (use it to compute costly metrics)."""
        return (self.step + 1) % self.log_every == 0

    def steps(self, iterable: Iterable[Any], start: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` from ``iterable``, timing how long each ``next()`` blocks.

        A step the user does not end with ``step_end()`` is ended when the next one is requested. With
        ``replicas=``, ``iterable`` is ``replicas.steps(...)``: its ``(committed step, micro-batches)`` pass
        through as they are, and its quorum's time is not data wait.
        """
        if start is not None:
            self.step = start
        it = iter(iterable)
        if not self._started:
            self._started = True
            self._iv.t0 = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            try:
                if self.profiler is not None and self.profiler.active:
                    with torch.profiler.record_function("multigpu:data_wait"):
                        batch = next(it)
                else:
                    batch = next(it)
            except StopIteration:
                return
            waited = time.perf_counter() - t0
            if self._quorum is not None:
                self.step, batch, waited = self._quorum.begin(batch, waited)
            self.step_begin(data_wait=waited)
            if self.probe is not None:
                batch = self.probe.batch(batch)
            yield self.step, batch
            if self._in_step:
                self.step_end()

    def step_begin(self, data_wait: float = 0.0) -> None:
        """Start timing compute (``steps()`` calls this; call it yourself only without ``steps()``)."""
        if not self._started:
            self._started = True
            self._iv.t0 = time.perf_counter()
        self._in_step = True
        if self._memory is not None:
            self._memory.begin(self.step)
        self._iv.begin(data_wait, self._cuda)
        if self._flops_auto and self.flops_per_sample is None and self._flop_count is None:
            self._flop_count = FlopCount()
            self._flop_count.start()

    def step_end(self, loss: Any = None, lr: Any = None, **metrics: Any) -> None:
        """End the step: ``loss`` (tensor or float, summed on the device), ``lr`` (float or optimizer).

        Extra keyword metrics are averaged over steps and ranks at log steps.
        """
        if not self._in_step:
            raise UsageError("step_end() called outside a step; iterate with meter.steps(loader) or call meter.step_begin() first")
        self._in_step = False
        self._iv.end()
        if self._flop_count is not None and self._flop_count.total is None:
            rank_samples = self.samples_per_step / self._ranks
            self.flops_per_sample = self._flop_count.stop() / rank_samples or None
        self._iv.add(loss, metrics)
        if self._memory is not None:
            self._memory.end(self._distributed)
        if lr is not None:
            self._lr = float(lr.param_groups[0]["lr"]) if hasattr(lr, "param_groups") else float(lr)
        committed = self._quorum.step_end() if self._quorum is not None else True  # else the step is retried
        self._skipped = self._quorum.replicas.skipped if self._quorum is not None else 0
        self.step += committed
        if self.watchdog is not None:
            self.watchdog.beat(self.step - 1)
        if committed and self.step % self.log_every == 0:
            self._log_interval()
        if self.profiler is not None:  # after the log step; its trace export is paused time, not training
            with self.pause("profile"):
                self.profiler.step()

    def log(self, values: dict[str, Any] | None = None, /, **kw: Any) -> None:
        """Values (already global, e.g. ``noise.metrics()``) added to the next log record as given."""
        self._extra.update(values or {}, **kw)

    @contextlib.contextmanager
    def pause(self, kind: str = "eval") -> Iterator[None]:
        """Time inside is not training time: throughput leaves it out, the summary reports it by kind.

        >>> with meter.pause("eval"):   # or "checkpoint" around ckpt.save(step)
        ...     accuracy = evaluate(model, val)
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self._iv.paused += dt
            self._paused[kind] = self._paused.get(kind, 0.0) + dt

    def log_eval(self, step: int | None = None, **metrics: Any) -> None:
        """Write an ``eval`` record now (rank 0; pass values that are already global)."""
        if self.is_main:
            rec = {"type": "eval", "step": self.step - 1 if step is None else step,
                   "time": time.perf_counter() - self._t_start, "samples_seen": self.step * self.samples_per_step - self._skipped}
            rec.update({k: (v.item() if torch.is_tensor(v) else v) for k, v in metrics.items()})
            for s in self.sinks:
                s.write(rec)

    # -- log steps: one sync, one gather (and the expert dispatch's one all-reduce) -----
    def _log_interval(self) -> None:
        if self._iv.n == 0:
            return
        vec, keys = self._iv.vector(self.device, self.monitor)
        mine = torch.tensor(vec, dtype=torch.float64, device=self.device if self._cuda else "cpu")
        if self._distributed:
            # Every rank must report the same metric names; a mismatch fails here, loudly.
            gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            tdist.all_gather(gathered, mine)
            rows = [g.tolist() for g in gathered]
        else:
            rows = [vec]
        n_steps = self._iv.n
        self._iv = Interval()
        experts = figures(self._experts)  # every rank (a collective over its data-parallel ranks); None without EP
        if self.is_main:
            self._write_record(rows, keys, n_steps, experts)

    def _write_record(self, rows: list[list[float]], keys: list[str], n_steps: int, experts: dict | None) -> None:
        replicas = self._quorum.take() if self._quorum is not None else None
        # under replicas a retried step trains nothing and a missing group's share is skipped
        samples = replicas["committed"] * self.samples_per_step - replicas["skipped"] if replicas else None
        rec, self._streak = interval_record(
            rows, keys, step=self.step - 1, n_steps=n_steps, samples_per_step=self.samples_per_step,
            samples=samples, skipped=self._skipped, elapsed=time.perf_counter() - self._t_start, lr=self._lr,
            world_size=self._ranks,
            tokens_per_sample=self.tokens_per_sample, flops_per_sample=self.flops_per_sample,
            peak_flops=self.peak_flops, hosts=self.hosts, gpu=self._cuda,
            straggler_threshold=self.straggler_threshold, streak=self._streak, experts=experts)
        if self.profiler is not None and self.step - n_steps < self.profiler.stop_step and \
                self.step > self.profiler.start_step - 1:
            rec["profiled"] = True  # the profiler slowed these steps: left out of the summary
        if replicas is not None:  # "steps" the committed ones (``step`` moves by those), "attempts" every one run
            rec.update(replicas=replicas, attempts=n_steps, steps=replicas["committed"])
            for change in replicas["changes"] if self.console is not None else ():
                self.console.note(change_line(change, replicas["groups"]))
        if not self._records:
            rec["warmup"] = True  # this meter's first interval (first steps, FLOP counting): left out likewise
        rec.update(self._extra)
        self._extra = {}
        self._records.append(rec)
        for s in self.sinks:
            s.write(rec)

    # -- end of run ---------------------------------------------------------------------
    def summary(self) -> dict[str, Any] | None:
        """Throughput (samples / time over the measured steps), its per-interval spread, the time breakdown (rank 0).

        The first interval (``warmup``: FLOP counting) and profiled ones are left out when there are
        others; ``rate_steps`` and ``measured.left_out`` name the steps."""
        out = run_summary(self._records, steps=self.step, samples_per_step=self.samples_per_step,
                          wall_time=time.perf_counter() - self._t_start, flops_per_sample=self.flops_per_sample,
                          peak_flops=self.peak_flops, world_size=self._ranks, paused=self._paused,
                          skipped=self._skipped)
        if out is not None and self._quorum is not None:
            out["replicas"] = self._quorum.summary()
        if out is not None and self._memory is not None and self._memory.bytes is not None:
            out["step_peak"] = {"step": self._memory.step, "bytes": self._memory.bytes}  # the largest rank's
        return out

    def close(self) -> dict[str, Any] | None:
        """Log the last partial interval, write the summary (rank 0), stop threads. Collective."""
        if self._in_step:
            self.step_end()
        self._log_interval()
        if self.probe is not None:
            self.probe.finish()
        return self._shutdown(write_summary=True)

    def _shutdown(self, write_summary: bool) -> dict[str, Any] | None:
        summary = self.summary() if write_summary and self.is_main else None
        if summary is not None:
            for s in self.sinks:
                if s is not self.console:
                    s.write(summary)
            if self.console is not None:
                self.console.note(summary_line(summary))
        for h in self._hooks:
            h.remove()
        for thread in (self.monitor, self.watchdog):
            if thread is not None:
                thread.stop()
        if self.profiler is not None:
            self.profiler.stop(gather=write_summary)
        for s in self.sinks:
            s.close()
        self._hooks, self.sinks = [], []
        return summary

    def __enter__(self) -> "StepMeter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # Another rank may be gone: no collective here, just flush and stop.
            self._shutdown(write_summary=False)
