"""How long a lost replica group stalls the others, and how long it takes to rejoin (`multigpu run --fault-tolerant`).

3 replica groups of 2 CPU ranks train tests/_ft_train.py (DDP inside a group, torchft across groups). When
group 1 has committed ``--kill-at`` steps, this SIGKILLs its workers (both: ``group``; rank 1 only: ``rank``),
or SIGSTOPs both for ``--silent-for`` seconds, then SIGCONTs them (``silent``: no connection resets, no
heartbeat, as a cut link looks to the survivors; the group rejoins without a restart).
From the groups' step records (the time each committed step was recorded by a group's rank 0):

- **stall**: from the survivors' last committed step with group 1 to their first committed without it
  (one ordinary step interval, ``--sleep`` + compute, is part of it; the interval is printed beside it);
- **rejoin**: from the SIGKILL (the SIGCONT) to group 1's first committed step after it (restart, quorum, healing
  from a live group).

    python benchmarks/fault_tolerance.py [--repeats 3] [--kill group,rank,silent]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_ft_train.py"
GROUPS = 3


def _records(out: Path, group: int) -> list[dict]:
    for path in out.rglob(f"group{group}.jsonl"):
        return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return []


def one_run(kill: str, steps: int, kill_at: int, sleep: float, silent_for: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "multigpu", "run", "--cpu", "-n", "2", "--fault-tolerant", str(GROUPS), "--log-dir",
             str(out / "logs"), str(SCRIPT), "--out", str(out), "--steps", str(steps), "--sleep", str(sleep),
             "--sleep-without", str(5 * sleep)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            while len(_records(out, 1)) < kill_at:
                if launcher.poll() is not None:
                    raise RuntimeError(launcher.stdout.read()[-2000:])
                time.sleep(0.01)
            pids = [int((out / "pids" / f"group1.rank{r}").read_text()) for r in ((1,) if kill == "rank" else (0, 1))]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP if kill == "silent" else signal.SIGKILL)
            killed_at = time.time()
            if kill == "silent":
                time.sleep(silent_for)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                killed_at = time.time()
            text, _ = launcher.communicate(timeout=300)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        if launcher.returncode != 0:
            raise RuntimeError(text[-2000:])
        survivor = _records(out, 0)
        lost = next(i for i, r in enumerate(survivor) if len(r["groups"]) < GROUPS)
        healed = next(r for r in _records(out, 1) if r["healed"])
        intervals = [b["time"] - a["time"] for a, b in zip(survivor[:lost], survivor[1:lost])]
        return {"stall": survivor[lost]["time"] - survivor[lost - 1]["time"], "rejoin": healed["time"] - killed_at,
                "interval": statistics.median(intervals), "steps_without": sum(len(r["groups"]) < GROUPS for r in survivor),
                "skipped": sum(r["skipped"] for r in survivor)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill", default="group,rank,silent",
                   help="group (both ranks SIGKILLed), rank (rank 1), silent (both SIGSTOPped, then SIGCONT)")
    p.add_argument("--silent-for", type=float, default=20.0, help="seconds a silent group stays stopped")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-at", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds per step on top of the compute")
    args = p.parse_args()
    import multigpu as mg
    from multigpu.runtime.fingerprint import format_fingerprint

    print("env:", format_fingerprint(mg.fingerprint(None, world_size=2, backend="gloo")), flush=True)
    for kill in args.kill.split(","):
        runs = []
        for i in range(args.repeats):
            runs.append(one_run(kill, args.steps, args.kill_at, args.sleep, args.silent_for))
            r = runs[-1]
            print(f"{kill} killed, run {i + 1}: stall {r['stall']:.2f} s (step interval {r['interval']:.3f} s), rejoin "
                  f"{r['rejoin']:.2f} s, {r['steps_without']} steps without it ({r['skipped']} samples skipped)", flush=True)
        for key in ("stall", "rejoin"):
            values = [r[key] for r in runs]
            print(f"{kill} killed: {key} median {statistics.median(values):.2f} s, range {min(values):.2f}-"
                  f"{max(values):.2f} s over {len(values)} runs", flush=True)


if __name__ == "__main__":
    main()
