"""Instruments: step meter, GPU monitor, straggler detection, hang reports, profiler, sinks.

See docs/observability.md. ``StepMeter`` and ``profile`` are public as ``mg.StepMeter``
and ``mg.profile``; the rest is reachable as ``multigpu.meter.<name>``.
"""

from .flops import count_flops, peak_flops
from .footprint import LiveActivations, MemoryStep, StateBytes, StepPeak, ddp_buckets, live_tensor_bytes, state_bytes
from .meter import StepMeter
from .profile import Profile, profile, summarize
from .stragglers import Straggler, find_stragglers
from .watchdog import Watchdog, flight_recorder_env, read_status

__all__ = [
    "LiveActivations", "MemoryStep", "Profile", "StateBytes", "StepMeter", "StepPeak", "Straggler", "Watchdog",
    "count_flops", "ddp_buckets", "find_stragglers", "flight_recorder_env", "live_tensor_bytes", "peak_flops", "profile",
    "read_status", "state_bytes", "summarize",
]
