"""The measured parts of the cost model: one micro-batch on one process, the links, the fixed costs.

``compute`` times a micro-batch's forward and backward of the model (a ``wrappers.Subject``) in this
process (with the threads one worker gets). ``links`` measures all-reduce, all-gather, reduce-scatter and
broadcast at sizes 4 KiB..16 MiB on each group size the candidates use, every group of the ranks at once,
through ``multigpu bench``'s measurement. Everything is measured each time (it moves with the machine's
load). The fixed costs: ``loop`` runs the training
script itself on one rank (what its loop adds per micro-batch and per step), ``wrappers.overheads`` times
each wrapper on the model, and ``sync`` runs a busy step on the real ranks (what one collective adds when
every rank computes, after short and long stretches of it, and the compute's slowdown there).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..forecast.hardware import Links

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
SIZES = tuple(4096 * 4 ** k for k in range(7))  # 4 KiB .. 16 MiB
LOOP_ROUNDS = 3  # the loop probe's rounds (``loop``): each a launch of the script with 1 and with 3 micro-batches


def compute(subject, keys, threads: int, rounds: int = 7) -> dict:
    """For each (micro_batch, activation_checkpointing) in ``keys``: {"time_s": median forward+backward of
    one micro-batch of ``subject`` (``wrappers.Subject``), "optimizer_s": clipping and AdamW's step of the
    whole model} (``timed``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        models = {ac: subject.model(ac) for ac in sorted({ac for _, ac in keys})}  # the same seed: the same weights
        x, y = subject.batch(max(m for m, _ in keys))

        def step(key) -> None:
            m, ac = key
            logits = subject.logits(models[ac], x[:m])
            F.cross_entropy(logits.flatten(0, 1), y[:m].flatten()).backward()

        times, optimizer_s = timed(models[keys[0][1]], step, keys, rounds)
        return {key: {"time_s": t, "optimizer_s": optimizer_s, "rounds": rounds} for key, t in times.items()}
    finally:
        torch.set_num_threads(before)


def timed(model, step, keys, rounds: int = 7) -> tuple[dict, float]:
    """({key: median seconds of ``step(key)``}, median seconds of clipping and AdamW's step over ``model``): the
    keys timed in turn (A B C A B C ...), ``rounds`` times, after a warm-up each, so machine noise falls on all
    alike; the optimizer after each round (its state exists from the first)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for key in keys:
        step(key)  # warm-up
    times: dict = {key: [] for key in keys}
    opt_times = []
    for _ in range(rounds):
        for key in keys:
            t0 = time.perf_counter()
            step(key)
            times[key].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt_times.append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in times.items()}, statistics.median(opt_times)


def links(group_sizes: set[int], nproc: int, device: str, threads: int, say=print) -> tuple[Links, dict]:
    """The links' measured points for every group size n: each op at each size among n consecutive ranks of
    the ``nproc``, every group at once, as a mesh dimension runs them (2 ranks alone on a CPU have its cores to
    themselves; in a layout the other groups share them), measured each time (on shared cores they move with
    the load: a 4-rank reduce-scatter took 4.1 ms one day and 5.5-7 another). (Links, {n: the rows measured})."""
    from ..commbench.run import run_bench
    from ..commbench.spec import BenchConfig
    from ..runtime.contract import environ

    rows = {}
    for n in sorted(s for s in group_sizes if s > 1):
        say(f"multigpu tune: measuring the links in groups of {n} of the {nproc} ranks")
        cfg = BenchConfig(ops=OPS, sizes=SIZES, warmup=3, iters=10, check=False,
                          backend="gloo" if device == "cpu" else None, group=n if n < nproc else None)
        with environ(OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="" if device == "cpu" else None):
            result = run_bench(cfg, nproc=nproc)
        rows[n] = [{"op": r["op"], "size": r["size"], "time_s": (r["out"] or r["in"])["time_us"] / 1e6}
                   for r in result["rows"] if not r.get("unsupported")]
    return links_of(rows), rows


def links_of(rows: dict) -> Links:
    """The Links of measured rows ({group size: [{"op", "size", "time_s"}]}: ``links``' or a tune.json's)."""
    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for n, measured in rows.items():
        for r in measured:
            points.setdefault((r["op"], int(n)), []).append((r["size"], r["time_s"]))
    return Links(points)


# -- the collectives' cost inside a step: every rank busy, each collective waits for its group's slowest -------
SYNC_WORK = 256  # one matmul of SYNC_WORK^3 (33.5 MFLOP: about half a millisecond on one busy core)
# The work between two collectives, in matmuls: a collective waits longer the longer the ranks computed since the
# last (on shared cores they drift apart, up to a scheduler's slice; 4 ranks on 2 cores, a 1 KiB all-reduce added
# 5.9 ms after 0.55 ms of work, 8.5 ms after 2.5 ms, 11 ms after 10 ms and after 22 ms).
SYNC_GAPS = (1, 4, 16)


def sync_rank(group_sizes: list[int], threads: int, iters: int = 96, rounds: int = 5) -> dict | None:
    """One rank of ``sync``: the time a small all-reduce adds to a loop of compute on every rank, after each of
    ``SYNC_GAPS``' amounts of work, and its time back to back with no compute (module level, so that launched
    workers import it)."""
    import torch.distributed as tdist

    from ..dist import init

    torch.set_num_threads(threads)
    with init(seed=0) as dist:
        rank, world = dist.rank, dist.world_size
        groups = {}
        for g in group_sizes:  # every rank in its group of g consecutive ranks, as the mesh's inner dimensions
            for start in range(0, world, g):
                group = tdist.new_group(list(range(start, start + g)))  # collective: every rank makes every group
                if start <= rank < start + g:
                    groups[g] = group
        a = torch.randn(SYNC_WORK, SYNC_WORK, device=dist.device)
        t = torch.zeros(256, device=dist.device)

        def loop(g: int, work: int, n: int) -> float:
            """Seconds per iteration of ``work`` matmuls then (g > 0) the all-reduce among g, ``n`` iterations."""
            tdist.barrier()
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)
            t0 = time.perf_counter()
            for _ in range(n):
                for _ in range(work):
                    a @ a
                if g:
                    tdist.all_reduce(t, group=groups[g])
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)
            return (time.perf_counter() - t0) / n

        runs = {k: max(12, iters // k) for k in SYNC_GAPS}  # each loop about as long as the others
        loop(group_sizes[0], 1, runs[1])  # warm-up
        extra: dict = {(g, k): [] for g in group_sizes for k in SYNC_GAPS}
        gaps: dict = {k: [] for k in SYNC_GAPS}
        idle: dict = {g: [] for g in group_sizes}
        for _ in range(rounds):
            for g in group_sizes:
                for k in SYNC_GAPS:
                    base = loop(0, k, runs[k])
                    gaps[k].append(base)
                    extra[(g, k)].append(loop(g, k, runs[k]) - base)
                idle[g].append(loop(g, 0, iters))  # the same collective back to back, now
        mine = torch.tensor([statistics.median(extra[(g, k)]) for g in group_sizes for k in SYNC_GAPS]
                            + [statistics.median(idle[g]) for g in group_sizes]
                            + [statistics.median(gaps[k]) for k in SYNC_GAPS], dtype=torch.float64, device=dist.device)
        tdist.all_reduce(mine)  # the ranks' mean
        mean = (mine / world).cpu().tolist()
        if not dist.is_main:
            return None
        k, n = len(SYNC_GAPS), len(group_sizes)
        gap = mean[n * k + n:]
        return {"wait_s": {str(g): [[gap[j], max(0.0, mean[i * k + j])] for j in range(k)]
                           for i, g in enumerate(group_sizes)},
                "idle_s": {str(g): v for g, v in zip(group_sizes, mean[n * k:n * k + n])},
                "work_s": gap[0] / SYNC_GAPS[0]}  # one matmul's


def _work_alone(threads: int, iters: int = 100, rounds: int = 5) -> float:
    """Seconds of ``sync_rank``'s matmul in this one process (what the probe's compute times had)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(SYNC_WORK, SYNC_WORK)
        a @ a
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ a
            times.append((time.perf_counter() - t0) / iters)
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def sync(group_sizes: set[int], nproc: int, device: str, threads: int, say=print) -> dict:
    """A step's shared costs on the real ``nproc`` ranks, every one busy (measured each time: they depend on
    what else the machine runs now): {"wait_s": {g: [[gap, seconds a 1 KiB all-reduce among g ranks adds to a
    loop of compute after each gap seconds of it], one per ``SYNC_GAPS``]}, "idle_s": {g: its seconds back to
    back, no compute, measured beside it: the transfer, which the links count, so that a wait less idle_s is
    the wait alone}, "slowdown": how much slower each rank computes than this one process alone, "work_s",
    "alone_s": the matmul's time on the busy ranks and here}. On a CPU with more workers than cores a
    collective waits until every peer is scheduled again, the longer the ranks ran apart, and the cores are
    shared."""
    from ..commbench.launch import launch_local
    from ..runtime.contract import environ

    sizes = sorted(g for g in group_sizes if g > 1) or [1]
    if nproc <= 1:
        return {"wait_s": {}, "idle_s": {}, "slowdown": 1.0, "work_s": None, "alone_s": None}
    say(f"multigpu tune: measuring a busy step's collectives and compute on {nproc} ranks")
    alone = _work_alone(threads) if device == "cpu" else None
    with environ(OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="" if device == "cpu" else None):
        result = launch_local(sync_rank, nproc, sizes, threads, timeout=600)[0]
    if alone is not None:
        alone = statistics.median([alone, _work_alone(threads)])  # before and after: the machine's load moves
    waits = {int(g): v for g, v in result["wait_s"].items() if int(g) > 1}
    idle = {int(g): v for g, v in result["idle_s"].items() if int(g) > 1}
    # Devices do not share compute. On CPU, N workers of T threads on C cores cannot run faster than C / (N T)
    # of their speed alone: the measured matmul (cache-resident, the least slowed work) is floored there.
    from ..launch.config import cpu_count

    bound = nproc * threads / cpu_count()
    slowdown = max(1.0, result["work_s"] / alone, bound) if alone else 1.0
    return {"wait_s": waits, "idle_s": idle, "slowdown": slowdown, "work_s": result["work_s"], "alone_s": alone}


def loop(workload: str, args: list[str], compute_parts: dict, micro_batch: int, cpu: bool, threads: int, root,
         steps: int = 32, accums=(1, 3), module: bool = True) -> dict:
    """The training loop's own cost on one process, measured: what it adds to the probe's forward+backward and
    optimizer (the loader, the step meter, the loss's reduction, Python per micro-batch).

    ``workload`` (the recipe's module, or with ``module=False`` a script that follows the layout contract)
    runs through the launcher on 1 rank for ``steps`` steps of ``micro_batch`` sequences with 1 and with 3
    micro-batches per step (its StepMeter's step time, as a candidate's run is measured), the two in turn
    ``LOOP_ROUNDS`` times (``loop_costs`` reads them)."""
    from pathlib import Path

    from ..launch.once import run_once
    from ..study.measure import measure_run

    # The recipe's evaluation is pushed past the run and its log kept frequent; a script takes the contract's flags.
    own = ["--log-every", "2", "--eval-every", str(10 * steps), "--eval-batches", "1"] if module else []
    measured: dict = {k: [] for k in accums}
    for r in range(LOOP_ROUNDS):
        for k in accums:
            where = Path(root) / f"loop-accum{k}-{r}"
            argv = [*args, "--global-batch", str(micro_batch * k), "--micro-batch", str(micro_batch),
                    "--steps", str(steps), *own]
            done = run_once(workload, argv, module=module, log_dir=where, nproc=1, cpu=cpu,
                            env={"OMP_NUM_THREADS": str(threads) if cpu else None})
            if done.exit_code != 0 or done.run_dir is None:
                raise RuntimeError(f"the loop probe failed: {done.failure() or 'no output'} (console {done.console})")
            run = measure_run(done.run_dir, None, steps)
            if run["thin"]:
                raise RuntimeError(f"the loop probe is too short to time: {run['thin']} (console {done.console})")
            measured[k].append(run["step_time_s"])
    return loop_costs(measured, compute_parts[(micro_batch, False)]) | {
        "step_time_s": {str(k): v for k, v in measured.items()}, "micro_batch": micro_batch, "steps": steps}


def loop_costs(measured: dict, part: dict) -> dict:
    """{"micro_s": a further micro-batch's time less the probe's forward+backward, "step_s": the rest of the step
    less the probe's clipping and AdamW}, from ``measured`` ({micro-batches: [step time of each round]}, two
    counts) and ``part`` (``compute``'s figures of that micro-batch). Each round's pair is differenced on its
    own (the two ran back to back, in one phase of the machine's load) and the medians taken: one slow round
    moves nothing. A further micro-batch costs at least its forward+backward: a pair that says less was
    timed across a change of load, and the floor keeps its difference out of the per-step part."""
    (k1, t1s), (k2, t2s) = sorted(measured.items())
    per = [max((t2 - t1) / (k2 - k1), part["time_s"]) for t1, t2 in zip(t1s, t2s)]
    rest = [t1 - k1 * p for t1, p in zip(t1s, per)]
    return {"micro_s": statistics.median(per) - part["time_s"],
            "step_s": max(0.0, statistics.median(rest) - part["optimizer_s"])}
