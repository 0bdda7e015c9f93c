"""Per-rank bytes of training state: parameters, gradients, optimizer state.

Counted from the tensors' storage (each storage once), so sharded strategies
show what they really keep: an FSDP parameter counts its local shard
(``DTensor.to_local()``, including FSDP's padding), a ZeRO-1 optimizer only
the state of the parameters this rank steps. Buffers the strategies keep
besides these (DDP's gradient buckets, FSDP's transient all-gather buffers)
are not included: they are transient or implementation-defined, and the
CUDA allocator (``mg`` meters) sees them.

``StepPeak`` measures what a training step holds at most, on any device: the
state at its start plus the most the step allocated at once (CUDA: the
caching allocator's peak; CPU: the profiler's memory reporter). ``multigpu
tune`` compares its prediction with it; ``MemoryStep`` takes it inside a
StepMeter (any script's step) when the launch asks.

``LiveActivations`` counts the peak storage bytes of the tensors autograd
saves for the backward, on any device. A storage counts once per saved tensor
that refers to it, so an input saved by several ops counts several times: an
upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = _local(t).untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """This rank's parameter, gradient and optimizer-state bytes.

    >>> state_bytes(model, opt).as_dict()
    {'params': 1056768, 'grads': 1056768, 'optimizer': 2113540, 'total': 4227076}
    """
    seen: set = set()
    params = list(model.parameters())
    p = _storage_bytes(params, seen)
    g = _storage_bytes([q.grad for q in params if q.grad is not None], seen)
    o = 0
    if optimizer is not None:
        # ZeroRedundancyOptimizer keeps this rank's state in its inner optimizer.
        inner = getattr(optimizer, "optim", optimizer)
        o = _storage_bytes([v for s in inner.state.values() for v in s.values()], seen)
    return StateBytes(p, g, o)


def ddp_buckets(model: nn.Module) -> int:
    """Bytes DDP's reducer keeps beside the gradients: a bucket copy of each (none under
    ``gradient_as_bucket_view``, where the gradients are views into the buckets); 0 for other models."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class StepPeak:
    """The most bytes this rank held in tensors during a window (one training step), on any device.

    CUDA: the caching allocator's peak of allocated bytes over the window (reset at its start, so a later
    ``torch.cuda.max_memory_allocated`` reads the peak since the window: the StepMeter's interval that holds
    it too). CPU, where no
    allocator keeps a peak: what was live at the start that ``state_bytes`` sees (``base``: parameters,
    gradients, optimizer state) plus the highest running total of the allocations and frees PyTorch's
    profiler records inside the window (its CPU memory reporter sees every tensor the CPU allocator makes,
    a wrapper's buffers and the collectives' outputs too). Blind spot on CPU: tensors made before the window
    that are neither state nor in ``base`` (add DDP's buckets: ``ddp_buckets``). ``total`` is None where the
    profiler cannot run (another one active).

    >>> with StepPeak(device, state_bytes(model, opt).total + ddp_buckets(model)) as peak:
    ...     train_step()
    >>> peak.total
    """

    def __init__(self, device: torch.device, base: int) -> None:
        self.device, self.base, self.total = device, base, None
        self._prof = None

    def __enter__(self) -> "StepPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        try:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        except RuntimeError:  # a profiler is already running (the user's): no measurement
            self._prof = None
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
            return
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.total = self.base + _highest_total(self._prof)


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of every tensor storage on ``device``'s kind that Python objects hold now, each storage once (a
    DTensor's local shard): parameters, gradients, optimizer state, a wrapper's buffers, the batch; and the
    buckets of every DDP module alive, which only C++ holds (``ddp_buckets``)."""
    import gc
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    found, buckets = [], 0
    with warnings.catch_warnings():  # the scan touches deprecated objects (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == device.type:
                    # A tensor with no memory (a fake one: torch.compile's caches keep some alive) has a null data
                    # pointer, or one that raises.
                    if _local(obj).untyped_storage().data_ptr():
                        found.append(obj)
                elif isinstance(obj, DistributedDataParallel):
                    buckets += ddp_buckets(obj)
            except Exception:  # noqa: BLE001 - a half-built, fake or exotic tensor subclass: not counted
                continue
    return _storage_bytes(found, set()) + buckets


class MemoryStep:
    """A StepMeter's measurement of one step's real peak memory (``StepPeak``), when the launch asks
    (``MULTIGPU_MEMORY_STEP``: ``multigpu tune`` runs a script so), or its owner asks (``StepMeter(step_peak=True)``):
    the meter's ``min(2, log_every - 1, total_steps - 1)``-th step from its start, in its first interval, which the step time leaves out as
    warm-up (the profiler the CPU measurement runs slows it). The base is every live tensor at the step's
    start and DDP's buckets (``live_tensor_bytes``); ``bytes`` is the largest rank's (None: not measured, or
    the profiler was busy on some rank), ``step`` the step's index."""

    def __init__(self, device: torch.device, log_every: int, total_steps: int | None = None) -> None:
        # The third step: the optimizer's state exists, and DDP has rebuilt its buckets (in the second step's
        # forward, new ones allocated while the old are live, which a steady step does not hold).
        self.device, self._at = device, min(2, log_every - 1, (total_steps or 3) - 1)
        self._seen = 0
        self._peak: StepPeak | None = None
        self.bytes: int | None = None
        self.step: int | None = None

    def begin(self, step: int) -> None:
        self._seen += 1
        if self._seen - 1 == self._at:  # CUDA's allocator counts everything itself: no base to find
            base = 0 if self.device.type == "cuda" else live_tensor_bytes(self.device)
            self.step, self._peak = step, StepPeak(self.device, base).__enter__()

    def end(self, distributed: bool) -> None:
        """Collective at the measured step's end (every rank ends it)."""
        if self._peak is None:
            return
        self._peak.__exit__(None, None, None)
        got = float(self._peak.total if self._peak.total is not None else -1)  # -1: this rank could not measure
        self._peak = None
        both = torch.tensor([got, -got], dtype=torch.float64, device=self.device)
        if distributed:
            import torch.distributed as tdist

            tdist.all_reduce(both, op=tdist.ReduceOp.MAX)  # the largest peak, and minus the smallest
        largest, smallest = both[0].item(), -both[1].item()
        self.bytes = int(largest) if smallest >= 0 else None


def _highest_total(prof) -> int:
    """The most bytes allocated at once inside the profiled window beyond what was allocated at its start: the
    memory reporter's running total (kept across windows, so read against its value before the first event)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.total_allocated, event.extra_fields.alloc_size))
        stack.extend(event.children)
    if not events:
        return 0
    events.sort()
    _, total, size = events[0]
    return max(0, max(t for _, t, _ in events) - (total - size))


class LiveActivations:
    """Peak bytes autograd holds for the backward (saved tensors that are not parameters), live:
    each saved tensor is wrapped, and its bytes leave the count when autograd frees the wrapper."""

    def __init__(self, params) -> None:
        self.params = {_local(p).untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def hooks(self):
        """The context inside which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if _local(t).untyped_storage().data_ptr() in self.params:
            return t  # a weight saved for its gradient: held anyway
        return _Held(t, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h


class _Held:
    __slots__ = ("t", "n", "owner")

    def __init__(self, t: torch.Tensor, owner: LiveActivations) -> None:
        self.t, self.n, self.owner = t, _local(t).untyped_storage().nbytes(), owner
        owner.live += self.n
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.n
