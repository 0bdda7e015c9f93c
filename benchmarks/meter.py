"""The StepMeter's own cost: the same training loop with and without the meter.

Trials alternate bare and metered runs in ABBA order, in one process group,
so that machine noise and order effects hit both alike. Each trial times ``--steps`` steps after a
warm-up (the meter's first step counts FLOPs and is in the warm-up), with the
device synchronised at both ends. The meter runs as a user would run it:
loader wrapped by ``meter.steps``, gradient hooks (``model=``), loss summed on
the device, a JSONL record every ``--log-every`` steps, watchdog and GPU
monitor on. Printed: the overhead ratio (metered / bare - 1) per trial, its
median and spread, and an environment fingerprint.

On a shared machine the wall-clock A/B ratio is noisy (other processes take
the cores), so it is also given in CPU time of this process (``process_time``;
torch runs single-threaded here, so other processes' load does not enter it),
and the meter's cost is measured directly, in CPU time too: the same loop
with an empty body, bare and metered (per-step cost of ``steps()`` +
``step_end()`` + log steps), plus the gradient hooks' cost (backward of the
model with and without the meter's hooks). Their sum over the bare step time
is the direct overhead ratio.

    python benchmarks/meter.py                     # 1 process, CPU
    python benchmarks/meter.py --world 2           # 2 gloo ranks, DDP
    python benchmarks/meter.py --device cuda       # 1 GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types

import torch
from torch import nn

import multigpu as mg
from multigpu.runtime.fingerprint import fingerprint, format_fingerprint
from multigpu.meter import StepMeter
from multigpu.testing import spawn

WARMUP = 5


def _model(device, width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(n, batch, device):
    x = torch.randn(batch, 256, device=device)
    y = (x[:, 0] > 0).long()
    for _ in range(n):
        yield x, y


def _trial(dist, model, opt, steps, batch, metered, log_every, log_root):
    loss_fn = nn.CrossEntropyLoss()
    meter = None
    it = _batches(WARMUP + steps, batch, dist.device)
    if metered:
        meter = StepMeter(dist, samples_per_step=batch * dist.world_size, log_every=log_every, progress=False,
                          log_dir=tempfile.mkdtemp(dir=log_root), model=model)
        it = meter.steps(it)
    else:
        it = enumerate(it)
    start = None
    for step, (x, y) in it:
        if step == WARMUP:
            _sync(dist.device)
            start, cpu0 = time.perf_counter(), time.process_time()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if meter is not None:
            meter.step_end(loss=loss, lr=opt)
    _sync(dist.device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    if meter is not None:
        meter.close()
    return elapsed / steps, cpu / steps


def _empty_loop(dist, n, metered, log_every, root):
    loss = torch.zeros((), device=dist.device)
    meter = StepMeter(dist, samples_per_step=1, log_every=log_every, progress=False, flops_per_sample=None,
                      log_dir=tempfile.mkdtemp(dir=root)) if metered else None
    it = meter.steps(range(n)) if metered else enumerate(range(n))
    _sync(dist.device)
    t0 = time.process_time()
    for _ in it:
        if meter is not None:
            meter.step_end(loss=loss, lr=0.1)
    _sync(dist.device)
    dt = (time.process_time() - t0) / n
    if meter is not None:
        meter.close()
    return dt


def _backward(model, x, y, reps, hooked, dist, root):
    meter = StepMeter(dist, samples_per_step=1, progress=False, flops_per_sample=None, model=model, watchdog=None,
                      log_dir=tempfile.mkdtemp(dir=root)) if hooked else None
    loss_fn = nn.CrossEntropyLoss()
    _sync(dist.device)
    t0 = time.process_time()
    for _ in range(reps):
        if meter is not None:
            meter.step_begin()  # hooks record only inside a step
        loss_fn(model(x), y).backward()
        if meter is not None:
            meter._in_step = False  # end without the bookkeeping measured by _empty_loop
    _sync(dist.device)
    dt = (time.process_time() - t0) / reps
    if meter is not None:
        meter._shutdown(write_summary=False)
    model.zero_grad(set_to_none=True)
    return dt


def direct_cost(dist, batch, width, log_every, root):
    """Per-step seconds of the meter's own calls and of its gradient hooks.

    CPU time, minimum over interleaved repetitions of each variant: noise only adds time.
    """
    loops = [(_empty_loop(dist, 2000, False, log_every, root), _empty_loop(dist, 2000, True, log_every, root))
             for _ in range(7)]
    # The hooks cost per parameter, not per FLOP: a narrow copy of the model (same parameters
    # count, tiny matmuls) shows their cost above the noise.
    model = _model(dist.device, 8)
    x, y = next(_batches(1, 8, dist.device))
    hooks = [(_backward(model, x, y, 300, False, dist, root), _backward(model, x, y, 300, True, dist, root))
             for _ in range(15)]
    return (min(m for _, m in loops) - min(b for b, _ in loops), min(h for _, h in hooks) - min(b for b, _ in hooks))


def run(dist, trials, steps, batch, width, log_every):
    model = _model(dist.device, width)
    if dist.world_size > 1:
        model = mg.wrap(model, "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(trials):
            # ABBA order: whatever the second run of a pair gains or loses hits both variants alike.
            if i % 2 == 0:
                bare = _trial(dist, model, opt, steps, batch, False, log_every, root)
                metered = _trial(dist, model, opt, steps, batch, True, log_every, root)
            else:
                metered = _trial(dist, model, opt, steps, batch, True, log_every, root)
                bare = _trial(dist, model, opt, steps, batch, False, log_every, root)
            out.append((bare, metered))
        # On rank 0 alone, as a one-process meter (no collectives with the other ranks).
        solo = types.SimpleNamespace(rank=0, world_size=1, device=dist.device)
        cost = direct_cost(solo, batch, width, log_every, root) if dist.rank == 0 else None
    return out, cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--world", type=int, default=1, help="gloo ranks on CPU (spawned)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    args = (a.trials, a.steps, a.batch, a.width, a.log_every)
    if a.world > 1:
        results, cost = spawn(run, a.world, *args, timeout=1800)[0]
        fp = fingerprint(None, world_size=a.world, backend="gloo")
    else:
        with mg.init(device=a.device) as dist:
            results, cost = run(dist, *args)
            fp = fingerprint(dist)
    print("fingerprint:", format_fingerprint(fp))
    print(f"{a.trials} trials x {a.steps} steps, batch {a.batch}/rank, width {a.width}, log every {a.log_every}, world {a.world}")
    print(f"{'trial':>5} {'bare ms/step':>13} {'metered ms/step':>16} {'overhead':>9}   (wall clock; then cpu time)")
    ratios, cpu_ratios = [], []
    for i, ((bare, bare_cpu), (metered, metered_cpu)) in enumerate(results):
        ratios.append(metered / bare - 1)
        cpu_ratios.append(metered_cpu / bare_cpu - 1)
        print(f"{i:>5} {bare * 1e3:13.3f} {metered * 1e3:16.3f} {100 * ratios[-1]:8.2f}%   cpu time {100 * cpu_ratios[-1]:+.2f}%")
    for name, rs in (("wall clock", ratios), ("cpu time", cpu_ratios)):
        q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0]] * 3
        print(f"meter overhead ({name}): median {100 * statistics.median(rs):+.2f}% (IQR {100 * q[0]:+.2f}% .. "
              f"{100 * q[2]:+.2f}%, min {100 * min(rs):+.2f}%, max {100 * max(rs):+.2f}%, n={len(rs)})")
    bare = statistics.median(b[1] for b, _ in results)
    calls, hooks = cost
    print(f"direct: meter calls {calls * 1e6:.1f} us/step (steps()+step_end()+log every {a.log_every}), "
          f"gradient hooks {hooks * 1e6:.1f} us/step (cpu time) -> overhead ratio {100 * (calls + hooks) / bare:.2f}% "
          f"of {bare * 1e3:.2f} ms/step (bare step, cpu time)")


if __name__ == "__main__":
    main()
