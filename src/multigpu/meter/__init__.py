"""Instruments: step meter, GPU monitor, straggler detection, hang reports, profiler, sinks.

See docs/observability.md. ``StepMeter`` and ``profile`` are public as ``mg.StepMeter``
and ``mg.profile``; the rest is reachable as ``multigpu.meter.<name>``.
"""

from .flops import count_flops, peak_flops
from .meter import StepMeter
from .profile import Profile, profile, summarize
from .stragglers import Straggler, find_stragglers
from .watchdog import HangMonitor, Watchdog, flight_recorder_env, hang_verdict

__all__ = [
    "HangMonitor", "Profile", "StepMeter", "Straggler", "Watchdog", "count_flops", "find_stragglers",
    "flight_recorder_env", "hang_verdict", "peak_flops", "profile", "summarize",
]
