"""`multigpu run` under a real SLURM: sbatch and srun on a controller and two slurmd (tests/_slurm.py), each
node its own network namespace (tests/_netns.py).

The nodes' SLURM names (n0, n1) resolve nowhere; slurm.conf's NodeAddr says where
they are. So the launcher must ask SLURM where the first node is (launch/slurm.py),
and say so in one line, exit 2, when it cannot.
"""

from __future__ import annotations

import shutil
import sys
import time

import pytest

import _netns
import _slurm
from test_hosts import SCRIPT, _records, _same_training, reference  # noqa: F401 - the fixture, float64 one process

_why = _netns.unavailable() or _slurm.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))

@pytest.fixture(scope="module", autouse=True)
def slurm_installed():
    failed = _slurm.install()
    if failed:
        pytest.skip(failed)


BATCH = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output={out} --error={err}
srun {python} -m multigpu run -n 2 --cpu --log-dir {logs} {script} --dir {ckpt} --out {params} --record {record} --float64 --micro 2
"""


@pytest.mark.slow
def test_sbatch_srun_two_nodes_of_two_workers_train_what_one_process_trains(tmp_path, reference):  # noqa: F811
    batch = tmp_path / "train.sbatch"
    batch.write_text(BATCH.format(out=tmp_path / "job.out", err=tmp_path / "job.err", python=sys.executable,
                                  logs=tmp_path / "logs", script=SCRIPT, ckpt=tmp_path / "ckpt",
                                  params=tmp_path / "params.pt", record=tmp_path / "record.jsonl"))
    with _netns.Hosts(2) as net, _slurm.Cluster(net, tmp_path / "slurm") as cluster:
        t0 = time.monotonic()
        proc = cluster.run(0, ["sbatch", "--parsable", str(batch)], capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        job = int(proc.stdout.strip().split(";")[0])
        state = cluster.wait(job, timeout=180)  # not sbatch --wait: it polls every few seconds, ~20 s late here
        took = time.monotonic() - t0
        addr0 = net.nodes[0].addr
    assert not _netns.leftovers()
    err = (tmp_path / "job.err").read_text() if (tmp_path / "job.err").exists() else ""
    assert state == ("COMPLETED", "0:0"), f"{state}\n{err[-3000:]}"
    port = 20000 + job % 20000
    for i in (0, 1):
        assert f"node {i} of 2 (slurm, master {addr0}:{port}, this node {net.nodes[i].addr}), world size 4" in err, err
    assert f"multigpu run: the job's first node n0 is at {addr0} (`scontrol show node n0`: NodeAddr)" in err, err
    assert {r["world_size"] for r in _records(tmp_path / "record.jsonl")} == {4}
    worst = _same_training(tmp_path, reference)
    print(f"\nsbatch: srun multigpu run -n 2 on 2 SLURM nodes: {took:.1f} s, parameters within {worst:.1e} of one process")


@pytest.mark.slow
def test_a_first_node_slurm_cannot_place_is_one_line_and_exit_2(tmp_path):
    """Without scontrol (a compute node without SLURM's client commands) n0 is only a name: every node refuses
    at once, before torch, instead of waiting 60 s for a store that cannot be found."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "train.py").write_text("print('never runs')\n")
    path = str(tmp_path / "bin")  # nothing on the workers' PATH: python is named by its full path
    assert shutil.which("scontrol", path=path) is None
    with _netns.Hosts(2) as net, _slurm.Cluster(net, tmp_path / "slurm") as cluster:
        t0 = time.monotonic()
        # srun's own environment is the tasks' (srun --export=ALL,PATH=... keeps srun's PATH in 22.05)
        proc = cluster.run(0, [shutil.which("srun"), "-N", "2", "--ntasks-per-node=1", sys.executable, "-m", "multigpu",
                               "run", "--cpu", "train.py"], env={"PATH": path}, capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)
        took = time.monotonic() - t0
    lines = proc.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("multigpu run: error: ")]
    assert len(errors) == 2 and len(set(errors)) == 1, proc.stderr  # one line per node, the same on both
    assert errors[0].startswith("multigpu run: error: the job's first SLURM node 'n0', where node 0 hosts the "
                                "rendezvous, does not resolve ("), errors[0]
    assert "and no scontrol on this node; give its address yourself on every node: multigpu run --nnodes 2 " \
           "--node-rank $SLURM_NODEID --master ADDRESS:" in errors[0], errors[0]
    assert "n0: task 0: Exited with exit code 2" in proc.stderr and "n1: task 1: Exited with exit code 2" in proc.stderr
    assert "Traceback" not in proc.stderr and "[W" not in proc.stderr, proc.stderr  # no C++ store warnings either
    assert not (tmp_path / "multigpu_logs").exists()  # nothing started
    assert took < 20, took
    print(f"\nunplaceable first node: refused on both nodes in {took:.1f} s")
