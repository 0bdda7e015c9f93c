"""Several nodes as separate hosts: each `multigpu run` in its own network namespace (tests/_netns.py).

The rendezvous, the workers' store and gloo cross a real network stack (veth
pairs on a bridge, 10.231.X.0/24), not loopback, and "a node's network is cut"
is a real case (its eth0 goes down). The launcher is given only what a user
gives on a cluster: ``--master <node 0's address>:PORT``; it finds this node's
address and gloo's interface itself (launch/network.py). The job script is
tests/_elastic_train.py in float64, compared with one uninterrupted process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

import _elastic_train as job
import _netns
import multigpu as mg

pytestmark = pytest.mark.skipif(_netns.unavailable() is not None, reason=str(_netns.unavailable()))

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_train.py")
PORT = 29400  # any port: each node has its own network stack, nothing else listens there
TOL = 1e-9  # float64: a correct run differs from one process by summation order only (~1e-16)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, float64, no interruption: the parameters and each step's samples."""
    tmp = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mg.init(seed=0, device="cpu") as dist:
            params = job.train(dist, str(tmp / "ckpt"), record=str(tmp / "record.jsonl"), dtype=torch.float64, micro=2)
    finally:
        torch.set_num_threads(threads)
    return params, {r["step"]: r for r in _records(tmp / "record.jsonl")}


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _same_training(tmp_path, reference) -> float:
    ref_params, ref_steps = reference
    steps = {r["step"]: r for r in _records(tmp_path / "record.jsonl")}
    assert sorted(steps) == sorted(ref_steps)
    for step, rec in steps.items():
        assert rec["samples"] == ref_steps[step]["samples"], f"step {step} trained on other samples"
    worst = max((a - b).abs().max().item() for a, b in zip(torch.load(tmp_path / "params.pt", weights_only=True), ref_params))
    assert worst < TOL, f"parameters differ from one process by {worst:.2e}"
    return worst


def _launch(net, i, tmp_path, *flags, micro=2):
    """Node i's `multigpu run`, inside its namespace, with the flags a user types on that host."""
    with open(tmp_path / f"node{i}.stderr", "w") as err, open(tmp_path / f"node{i}.stdout", "w") as out:
        return net.popen(i, [
            sys.executable, "-m", "multigpu", "run", "--cpu", "--node-rank", str(i), "--master", f"{net.nodes[0].addr}:{PORT}",
            "--log-dir", str(tmp_path / "logs"), *flags, SCRIPT, "--dir", str(tmp_path / "ckpt"), "--out",
            str(tmp_path / "params.pt"), "--record", str(tmp_path / "record.jsonl"), "--float64", "--micro", str(micro)],
            stdout=out, stderr=err, cwd=tmp_path)


def _stderr(tmp_path, i) -> str:
    return (tmp_path / f"node{i}.stderr").read_text()


@pytest.mark.slow
def test_two_hosts_of_two_workers_train_what_one_process_trains(tmp_path, reference):
    t0 = time.monotonic()
    with _netns.Hosts(2) as net:
        nodes = [_launch(net, i, tmp_path, "-n", "2", "--nnodes", "2") for i in (1, 0)]  # node 1 first: it waits
        codes = [p.wait(timeout=120) for p in nodes]
        took = time.monotonic() - t0
        for i, code in zip((1, 0), codes):
            assert code == 0, _stderr(tmp_path, i)[-3000:]
        addrs = [n.addr for n in net.nodes]
    assert not _netns.leftovers()
    for i in (0, 1):  # what the launcher found out on each host, and said
        err = _stderr(tmp_path, i)
        assert f"node {i} of 2 (flags, master {addrs[0]}:{PORT}, this node {addrs[i]}), world size 4" in err, err
        assert f"GLOO_SOCKET_IFNAME: unset -> 'eth0' (gloo's interface: {addrs[i]}, this node's route to the master)" in err
    assert {r["world_size"] for r in _records(tmp_path / "record.jsonl")} == {4}
    worst = _same_training(tmp_path, reference)
    print(f"\n2 hosts x 2 workers on network namespaces: {took:.1f} s, parameters within {worst:.1e} of one process")


@pytest.mark.slow
def test_an_elastic_job_goes_on_when_a_hosts_network_is_cut(tmp_path, reference):
    """Nodes 0 and 1 train at world 2; node 1's eth0 goes down mid-run. Node 0's worker waits in the gradient
    all-reduce for a peer that no longer answers (no reset: the cable is out, nothing closes), --hang-timeout
    stops it, and the rendezvous, having lost node 1's heartbeat, restarts node 0 alone from its checkpoint."""
    record = tmp_path / "record.jsonl"
    flags = ("-n", "1", "--nnodes", "1:2", "--rdzv-last-call", "2", "--node-timeout", "3", "--hang-timeout", "3")
    with _netns.Hosts(2) as net:
        host, other = _launch(net, 0, tmp_path, *flags, micro=4), _launch(net, 1, tmp_path, *flags, micro=4)
        deadline = time.monotonic() + 120
        while host.poll() is None and time.monotonic() < deadline:  # two steps at world 2, then the cut
            if sum(r["world_size"] == 2 for r in _records(record)) >= 2:
                break
            time.sleep(0.05)
        assert host.poll() is None, _stderr(tmp_path, 0)[-3000:]
        net.cut(1)
        t_cut = time.time()
        code = host.wait(timeout=120)
        took = time.time() - t_cut
        other_code = other.poll()
    assert not _netns.leftovers()
    err = _stderr(tmp_path, 0)
    assert code == 0, err[-3000:]
    assert "multigpu run: 1 node left: 2 -> 1 node, world size 2 -> 1" in err, err[-3000:]
    recs = _records(record)
    before = max(r["time"] for r in recs if r["world_size"] == 2)
    after = min(r["time"] for r in recs if r["world_size"] == 1 and r["time"] > t_cut)
    sizes = [r["world_size"] for r in recs]
    assert sizes[-1] == 1 and 2 in sizes, sizes
    worst = _same_training(tmp_path, reference)
    verdict = next((ln for ln in err.splitlines() if ln.startswith("multigpu run: hang: ")), "no hang verdict")
    print(f"\nnode 1's link cut at world 2: node 0 trained again (world 1) {after - t_cut:.1f} s after the cut "
          f"({after - before:.1f} s after the last 2-node step), finished {took:.1f} s after it; node 1's launcher "
          f"{'still running' if other_code is None else f'exited {other_code}'} then; parameters within {worst:.1e} "
          f"of one process; node 0 said: {verdict[:200]}")


def test_the_hosts_are_gone_after_a_failure_processes_included():
    """A test that fails inside the block leaves no namespace, link or process behind."""
    with pytest.raises(ZeroDivisionError):
        with _netns.Hosts(2) as net:
            sleeper = net.popen(1, ["sleep", "300"])
            child = net.popen(0, ["sh", "-c", "setsid sleep 300 & wait"])  # a grandchild in its own session
            names = [n.ns for n in net.nodes] + [net.switch]
            time.sleep(0.2)
            assert sorted(_netns.leftovers()) == sorted(names)
            1 / 0
    assert not _netns.leftovers() and sleeper.returncode == -9 and child.returncode == -9
    assert not [ns for ns in names if os.path.exists(f"/run/netns/{ns}")]
