"""`multigpu run --fault-tolerant` on separate hosts: a node's network cut mid-run costs a stall, not the job.

Two training nodes, each its own network namespace (tests/_netns.py: veth pairs on a bridge, no loopback
between them), each running one replica group of two CPU workers (tests/_ft_train.py, DDP inside the group),
and a third host running torchft's lighthouse (`torchft_lighthouse`), which both launchers are given with
--lighthouse. Each node writes its own records (separate --log-dir: nothing is shared but the script's output
folder). Node 0's eth0 goes down mid-run: nothing resets, its group just falls silent. Node 1's group commits
steps without it (the lighthouse is not on node 0); the link comes back up and node 0's group, never
restarted, heals from node 1's and rejoins. Both groups' final parameters equal one process trained on
exactly the samples the committed steps used.
Also: groups that differ across nodes are refused on both; under a real SLURM (tests/_slurm.py) each node
runs its group from SLURM's variables alone, node 0's launcher starts the lighthouse, and node 1's workers
SIGKILLed mid-run are restarted by its launcher, heal from node 0's group and rejoin while the job goes on.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import torch

import _ft_train as job
import _netns
from test_fault_tolerant import SCRIPT, _alive, _pids, _records

pytest.importorskip("torchft")
hosts = pytest.mark.skipif(_netns.unavailable() is not None, reason=str(_netns.unavailable()))

# Any port: each host has its own network stack. While a group is missing a step takes 0.5 s: the 19 steps
# after node 0's link is back leave it 9.5 s to rejoin (1.0-4.1 s seen).
GROUPS, STEPS, PORT, LIGHTHOUSE_PORT = 2, 26, 29400, 29510


def _launch(net, i, tmp_path, *args, n=2, flags=()):
    """Node i's launcher with the flags a user types on that host: node rank, node 0's address, the groups (and
    ``flags``, e.g. --lighthouse)."""
    with open(tmp_path / f"node{i}.out", "w") as out:
        return net.popen(i, [
            sys.executable, "-m", "multigpu", "run", "--cpu", "-n", str(n), "--fault-tolerant", str(GROUPS),
            "--nnodes", "2", "--node-rank", str(i), "--master", f"{net.nodes[0].addr}:{PORT}", "--log-dir",
            str(tmp_path / f"node{i}-logs"), *flags, SCRIPT, "--out", str(tmp_path), "--timeout", "3",
            *(args or ("--steps", str(STEPS), "--sleep", "0.1", "--sleep-without", "0.5"))], stdout=out, stderr=out, cwd=tmp_path)


def _lighthouse(net, i, tmp_path):
    """torchft's own lighthouse (its Rust binary, the launcher's join and heartbeat timeouts) on host i: (process,
    its HOST:PORT), once it listens."""
    from multigpu.launch import replicas

    where, log = f"{net.nodes[i].addr}:{LIGHTHOUSE_PORT}", tmp_path / "lighthouse.out"
    with open(log, "w") as out:
        proc = net.popen(i, [os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"), "--min_replicas", "1",
                             "--bind", where, "--join_timeout_ms", str(replicas.JOIN_TIMEOUT_MS),
                             "--heartbeat_timeout_ms", str(replicas.HEARTBEAT_TIMEOUT_MS)],
                         stdout=out, stderr=out, env=dict(os.environ, RUST_LOG="info"))  # info: it says it listens
    deadline = time.monotonic() + 10
    while "Lighthouse listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.02)
    return proc, where


@pytest.mark.slow
@hosts
def test_a_node_cut_off_mid_run_costs_a_stall_and_rejoins_healed_when_its_link_is_back(tmp_path):
    """Node 0 is the one cut off: with the lighthouse on a host of its own, no training node is special."""
    logs = [tmp_path / f"node{i}-logs" for i in (0, 1)]
    t0 = time.monotonic()
    with _netns.Hosts(3) as net:  # nodes 0 and 1 train; host 2 runs the lighthouse
        lighthouse, where = _lighthouse(net, 2, tmp_path)
        nodes = [_launch(net, i, tmp_path, flags=("--lighthouse", where)) for i in (0, 1)]
        deadline = time.monotonic() + 60

        def running() -> None:  # the lighthouse and both launchers, within the deadline
            assert all(p.poll() is None for p in (lighthouse, *nodes)) and time.monotonic() < deadline, \
                [(tmp_path / f"node{i}.out").read_text()[-2000:] for i in (0, 1)]
            time.sleep(0.02)

        while sum(r["groups"] == [0, 1] for r in _records(str(logs[1]), 1)) < 6:  # 6 steps together, then the cut
            running()
        net.cut(0)
        t_cut = time.time()
        while not any(r["groups"] == [1] for r in _records(str(logs[1]), 1)):  # a step without node 0, then back
            running()
        net.reconnect(0)
        t_up = time.time()
        codes = [p.wait(timeout=90) for p in nodes]
        assert lighthouse.poll() is None, (tmp_path / "lighthouse.out").read_text()[-2000:]  # it served to the end
        took = time.monotonic() - t0
    assert not _netns.leftovers()
    texts = [(tmp_path / f"node{i}.out").read_text() for i in (0, 1)]
    assert codes == [0, 0], (codes, texts[0][-2000:], texts[1][-2000:])
    for i in (0, 1):  # both nodes use the lighthouse on host 2; neither starts one
        assert (f"--fault-tolerant: node {i} of 2 (flags) runs groups {i}..{i} of {GROUPS} replica groups of 2 workers, "
                f"torchft {job_version()}, lighthouse http://{where}, each group") in texts[i], texts[i][-3000:]

    records = [_records(str(logs[g]), g) for g in (0, 1)]
    steps = _committed(records, STEPS)
    cut = [r for r in steps if 0 not in r["groups"] and r["time"] >= t_cut]
    assert cut, steps  # node 1's group went on without node 0's
    back = [h for h in records[0] if h["healed"] and h["time"] >= t_up]
    assert back, records[0]  # node 0's group, cut off but never restarted, healed once its link was back
    for i in (0, 1):  # each node's last line: its own group's record
        mine = records[i]
        without = [r for r in mine if len(r["groups"]) < GROUPS]
        heals = sum(r["healed"] for r in mine)
        assert (f"{len(mine)} steps committed, {len(without)} without every group "
                f"({sum(r['skipped'] for r in without)} samples skipped), {heals} heal{'s' if heals != 1 else ''} "
                "from a live group") in texts[i], texts[i][-2000:]

    worst = _equal_to_one_process(tmp_path, steps)
    stall = cut[0]["time"] - steps[cut[0]["step"] - 1]["time"]
    without = [r for r in steps if len(r["groups"]) < GROUPS]
    print(f"\nnode 0 cut after 6 steps together, the lighthouse on a third host: node 1's group stalled {stall:.2f} s "
          f"(last step with node 0 -> first without); node 0's link back after {t_up - t_cut:.2f} s: it healed "
          f"({back[0]['heal_s']:.2f} s) and rejoined at step {back[0]['step']}, {back[0]['time'] - t_up:.2f} s later; "
          f"{len(without)} steps without it, {sum(r['skipped'] for r in without)} samples skipped; both groups within "
          f"{worst:.1e} of one process; {took:.1f} s in all")


def _equal_to_one_process(tmp_path, steps: list[dict]) -> float:
    """Both groups' final parameters equal one process trained on exactly the committed steps' samples (float64,
    1e-9), and those steps did skip samples: training on every group's share ends elsewhere. The larger of the
    two groups' differences."""
    expected, worst = job.replay(steps, GROUPS), []
    for g in (0, 1):
        got = torch.load(tmp_path / f"group{g}.pt")
        worst.append(max((got[k] - expected[k]).abs().max().item() for k in expected))
        assert worst[-1] <= 1e-9, f"group {g}: {worst[-1]:.3g} from one process on the committed samples"
    every = job.replay([dict(r, groups=[0, 1]) for r in steps], GROUPS)  # the skipped shares matter
    assert max((every[k] - expected[k]).abs().max().item() for k in every) > 1e-6
    return max(worst)


def _committed(records: list[list[dict]], steps: int) -> list[dict]:
    """Every committed step's record, from the groups' records (each on its own node's disk): every step once,
    each group's record of a step the same and naming it, and a group left out of a step healed later (a loaded
    machine can leave either group out of a quorum: the checks follow the records, not one pattern)."""
    committed: dict[int, dict] = {}
    for g, mine in enumerate(records):
        for r in mine:
            first = committed.setdefault(r["step"], r)
            assert g in r["groups"] and (r["groups"], r["skipped"]) == (first["groups"], first["skipped"]), (g, r, first)
    assert sorted(committed) == list(range(steps)), sorted(committed)
    ordered = [committed[s] for s in range(steps)]
    for r in ordered:
        for g in set(range(len(records))) - set(r["groups"]):
            assert any(h["healed"] and h["step"] > r["step"] for h in records[g]), (g, r, records[g])
        assert r["skipped"] == job.GLOBAL_BATCH // GROUPS * (GROUPS - len(r["groups"])), r
    return ordered


def job_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchft")


@pytest.mark.slow
@hosts
def test_groups_that_differ_across_nodes_are_refused_on_every_node(tmp_path):
    """Node 1's group has a wider model. Whichever group heals from the other at the first step finds the state
    does not fit; it refuses at that step's all-reduce, where the other sees the fingerprints differ: both
    nodes stop their groups, exit 2, and the node that saw both setups names what differs. No node trains on."""
    with _netns.Hosts(2) as net:
        nodes = [_launch(net, i, tmp_path, "--steps", "5", "--wider-group", "1", n=1) for i in (0, 1)]
        codes = [p.wait(timeout=90) for p in nodes]
    lasts = [(tmp_path / f"node{i}.out").read_text().strip().splitlines()[-1] for i in (0, 1)]
    assert codes == [2, 2], lasts
    named = ("multigpu run: error: the replica groups differ (parameters: group 0 4 tensors, 178 values (rank 0's), "
             "group 1 4 tensors, 266 values (rank 0's)); every group must run the same script, layout and torchft "
             "release: start them from one launcher and environment")
    other = ("multigpu run: error: the replica groups differ (group {g} here differs from a group on another node; "
             "the other nodes' last lines say what differs); every group must run the same script, layout and "
             "torchft release: start them from one launcher and environment")
    assert lasts in ([named, other.format(g=1)], [other.format(g=0), named]), lasts
    assert not any(_records(str(tmp_path / f"node{i}-logs"), i) for i in (0, 1))  # no step committed anywhere
    assert not _netns.leftovers()


SBATCH = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output={out}
srun bash -c '{python} -m multigpu run -n 2 --cpu --fault-tolerant 2 --log-dir {logs}/node$SLURM_NODEID {script} \
--out {tmp} --steps {steps} --sleep 0.1 --sleep-without 1 --timeout 3 --rejoin-delay 4'
"""
# While group 1 is missing a step takes 1 s: 34 s for node 1's launcher to restart it (8-21 s seen on a
# loaded machine) before node 0's group ends; once it is back a step takes 0.1 s.
SLURM_STEPS = 40


@pytest.mark.slow
@hosts
def test_under_slurm_a_node_whose_workers_are_killed_rejoins_and_both_train_what_one_process_trains(tmp_path):
    """sbatch + srun on a real SLURM cluster of two namespace hosts (tests/_slurm.py): node rank, node count and
    node 0's address come from SLURM (its NodeAddr: the node names resolve nowhere), the lighthouse listens on
    the job's port on node 0. After 6 steps together node 1's workers are SIGKILLed: the job goes on, node 0's
    group commits without it, node 1's launcher restarts its group, which heals from node 0's and rejoins."""
    import _slurm

    why = _slurm.unavailable() or _slurm.install()
    if why:
        pytest.skip(why)
    (tmp_path / "job.sbatch").write_text(SBATCH.format(out=tmp_path / "job.out", python=sys.executable,
                                                       logs=tmp_path / "logs", script=SCRIPT, tmp=tmp_path,
                                                       steps=SLURM_STEPS))
    logs = [tmp_path / "logs" / f"node{g}" for g in (0, 1)]
    with _netns.Hosts(2) as net, _slurm.Cluster(net, tmp_path / "slurm") as cluster:
        t0 = time.monotonic()
        proc = cluster.run(0, ["sbatch", "--parsable", str(tmp_path / "job.sbatch")], capture_output=True, text=True,
                           timeout=30, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        jobid = int(proc.stdout.strip().split(";")[0])
        deadline = time.monotonic() + 90
        while sum(r["groups"] == [0, 1] for r in _records(str(logs[0]), 0)) < 6:  # 6 steps together, then the kill
            state = cluster.wait(jobid, timeout=0)  # as it is now
            assert state[0] in ("PENDING", "CONFIGURING", "RUNNING", "?") and time.monotonic() < deadline, \
                f"{state}\n{(tmp_path / 'job.out').read_text()[-3000:] if (tmp_path / 'job.out').exists() else ''}"
            time.sleep(0.05)
        killed = _pids(str(tmp_path), 1)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        state = cluster.wait(jobid, timeout=180)
        took = time.monotonic() - t0
        addr0 = net.nodes[0].addr
    assert not _netns.leftovers()
    text = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-3000:]}"
    lighthouse = f"lighthouse http://{addr0}:{20000 + jobid % 20000}"
    assert f"node 0 of 2 (slurm) runs groups 0..0 of 2 replica groups of 2 workers, torchft {job_version()}, " \
           f"{lighthouse} (started here)" in text, text[-3000:]
    assert f"node 1 of 2 (slurm) runs groups 1..1 of 2 replica groups of 2 workers, torchft {job_version()}, " \
           f"{lighthouse}, each" in text, text[-3000:]
    assert re.search(r"\[group 1\] multigpu run: rank \d failed \(SIGKILL\); restart 1 of 3", text), text[-3000:]

    # What was committed, from both nodes' records (each on its own node's disk): every step once, each group's
    # record of a step the same. A loaded machine can leave either group out of a quorum (it then heals), so
    # the checks follow the records, not one pattern.
    records = [_records(str(logs[g]), g) for g in (0, 1)]
    steps = _committed(records, SLURM_STEPS)
    lost = [r["step"] for r in steps if 1 not in r["groups"] and r["time"] >= t_kill]
    assert lost, steps  # node 0's group went on without node 1's (its rejoin, healed: _committed and `heal` below)
    worst = _equal_to_one_process(tmp_path, steps)
    assert not any(_alive(p) for p in killed + _pids(str(tmp_path), 1))
    heal = [h for h in records[1] if h["healed"] and h["step"] > max(lost)][0]
    print(f"\nsbatch: --fault-tolerant 2 on 2 SLURM nodes, node 1's workers killed after 6 steps together: "
          f"{len(lost)} steps without it, healed {heal['heal_s']:.2f} s and rejoined at step {heal['step']}, "
          f"{took:.1f} s in all; both groups within {worst:.1e} of one process")


def test_a_node_that_cannot_tell_its_own_address_is_one_line(tmp_path, monkeypatch, capsys):
    """Node 0's name mapped to a loopback address on node 0 itself (Debian's 127.0.1.1 in /etc/hosts): the groups
    would advertise an address no other node reaches. Refused before anything starts, exit 2."""
    from _cli import run_cli
    from multigpu.launch import replicas

    monkeypatch.setattr(replicas, "node_address", lambda host, port: None)
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["run", "--cpu", "--fault-tolerant", "2", "--nnodes", "2", "--master", "127.0.0.1:29500",
                         SCRIPT], capsys)
    assert code == 2 and err.strip() == (
        "multigpu run: error: --fault-tolerant on 2 nodes: cannot tell this node's address toward node 0's "
        "127.0.0.1:29500 (no route to it, or this host's name maps to a loopback address); give --master as node "
        "0's IP address, or fix the route or the name in /etc/hosts"), err
    assert not list(tmp_path.iterdir())  # nothing started
