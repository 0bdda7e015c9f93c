"""Which rank does `multigpu run`'s failure summary blame, in the real race? Counts over many launches.

3 CPU ranks (tests/_race_worker.py): rank 1 raises while ranks 0 and 2 wait in an
all-reduce and then fail with gloo's lost-peer errors. Each launch's summary line
must name rank 1. Both kinds of script run: ``mg`` (inside ``mg.init``) and
``plain`` (torchrun-style ``init_process_group``). Launches run two at a time,
so the machine is loaded as it is in CI.

    python benchmarks/blame.py --runs 20
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RACE = ROOT / "tests" / "_race_worker.py"


def launch(kind: str, log_dir: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "multigpu", "run", "-n", "3", "--cpu", "--log-dir", log_dir,
                             str(RACE), kind], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def blamed(stderr: str) -> str:
    line = next((ln for ln in stderr.splitlines() if ln.startswith("multigpu run: rank ") and "; log: " in ln), "")
    m = re.match(r"multigpu run: rank (\d+) ", line)
    return m.group(1) if m else f"no summary ({stderr.strip().splitlines()[-1:] or ['nothing']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="launches of each kind")
    args = ap.parse_args()
    counts: dict[str, collections.Counter] = {"mg": collections.Counter(), "plain": collections.Counter()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            procs = {kind: launch(kind, os.path.join(tmp, kind)) for kind in counts}
            for kind, proc in procs.items():
                _, err = proc.communicate(timeout=180)
                counts[kind][blamed(err)] += 1
            print(f"[{i + 1}/{args.runs}] " + "; ".join(f"{k}: {dict(c)}" for k, c in counts.items()), flush=True)
    print("rank 1 named: " + ", ".join(f"{k} {c['1']}/{args.runs}" for k, c in counts.items())
          + f" ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
