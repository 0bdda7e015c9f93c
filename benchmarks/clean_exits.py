"""Do finished multi-rank gloo runs exit 0? Counts aborts at exit over many launches.

The script runs five all-reduces (``bare``, 2 ranks), or trains a few DDP steps
(2 ranks) or FSDP steps (4 ranks), and returns
*without* ``destroy_process_group`` (as many torchrun scripts do): the case in
which a gloo worker thread can drop a finished collective's tensors after the
interpreter began to finalize, and abort the process ("terminate called
without an active exception", exit 134). Launched by plain ``torchrun``
(the hazard) and by ``multigpu run`` (whose worker.py destroys the process
group while the interpreter is alive), alternating, with the counts printed.

    python benchmarks/clean_exits.py --runs 50 [--layouts 2:bare,2:ddp,4:fsdp]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch import nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if sys.argv[1] == "bare":  # collectives only: the shortest way from the last one to interpreter exit
        t = torch.ones(1000)
        for _ in range(5):
            dist.all_reduce(t)
        print("done", flush=True)
        sys.exit(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    if sys.argv[1] == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(20):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
    print("done", flush=True)  # and no destroy_process_group()
""")


HUNG = -999  # the exit code recorded for a launch that did not end within --timeout


def launch(how: str, n: int, kind: str, script: str, log_dir: str, timeout: float,
           run_args: list[str] = ()) -> tuple[int, bool, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script, kind]
    else:
        cmd = [sys.executable, "-m", "multigpu", "run", "-n", str(n), "--cpu", "--log-dir", log_dir, *run_args,
               script, kind]
    # its own session, so a hung launch can be stopped with all its workers and counted, not end the series
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        text += f"\n[clean_exits] no exit after {timeout:.0f} s: stopped (SIGKILL to the launch's session)\n"
        code = HUNG
    if how != "torchrun":  # the workers' stderr is in their log files
        text += "".join(p.read_text(errors="replace") for p in Path(log_dir).rglob("*.stderr.log"))
    return code, "terminate called" in text, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="launches per (launcher, layout)")
    ap.add_argument("--launchers", default="torchrun,multigpu")
    ap.add_argument("--layouts", default="2:bare,2:ddp,4:fsdp", help="ranks:kind, comma-separated (kinds: bare, ddp, fsdp)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds before a launch counts as hung (a normal one takes 5-25 s)")
    ap.add_argument("--run-args", default="", help="more multigpu run flags, e.g. '--max-restarts 1' (then each "
                    "attempt gets a store of its own, hosted by rank 0: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
    ap.add_argument("--keep", default="clean-exits-failures", help="where the logs and output of a run that exited non-zero are kept")
    args = ap.parse_args()
    layouts = [(int(n), kind) for n, kind in (item.split(":") for item in args.layouts.split(","))]
    cases = [(how, n, kind) for n, kind in layouts for how in args.launchers.split(",")]
    bad: dict[tuple, collections.Counter] = {c: collections.Counter() for c in cases}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        Path(script).write_text(SCRIPT)
        for i in range(args.runs):
            for case in cases:  # interleaved: a busy moment hits every case alike
                with tempfile.TemporaryDirectory(dir=tmp) as logs:
                    code, terminate, text = launch(*case, script, logs, args.timeout, args.run_args.split())
                    if code != 0:  # keep what it said, for the diagnosis
                        kept = Path(args.keep) / f"{case[0]}-{case[1]}x{case[2]}-round{i + 1}-exit{code}"
                        shutil.copytree(logs, kept)
                        (kept / "output.txt").write_text(text)
                        print(f"    {case[0]} {case[1]}x{case[2]} exited {code}: kept in {kept}", flush=True)
                bad[case]["runs"] += 1
                bad[case]["nonzero exit"] += code != 0
                bad[case]["terminate called"] += terminate
                bad[case]["hung"] += code == HUNG
            print(f"[{i + 1}/{args.runs}] " + "; ".join(
                f"{h} {n}x{k}: {c['nonzero exit']} bad ({c['terminate called']} terminate, {c['hung']} hung)"
                for (h, n, k), c in bad.items()), flush=True)
    for (how, n, kind), c in bad.items():
        print(f"{how:9s} {n} ranks {kind}: {c['nonzero exit']}/{c['runs']} runs exited non-zero, "
              f"{c['terminate called']} said 'terminate called', {c['hung']} hung")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
