"""A hang turned into a restart, and an elastic job that grows and loses a node, against one uninterrupted process.

Real launchers on loopback: ``multigpu run`` processes as nodes, one CPU
worker each, the c10d rendezvous on node 0. Each run's record
(tests/_elastic_train.py) says which samples every step trained on, at which
world size and accumulation; the last record of a step is the one the
finished run kept (steps after the newest checkpoint are trained again).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import _elastic_train as job
import _netns
import multigpu as mg
from multigpu.launch import config
from multigpu.errors import UsageError
from multigpu.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_elastic_train.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no interruption: the parameters and each step's samples."""
    tmp = tmp_path_factory.mktemp("reference")
    torch.set_num_threads(1)
    with mg.init(seed=0, device="cpu") as dist:
        params = job.train(dist, str(tmp / "ckpt"), record=str(tmp / "record.jsonl"), log_dir=str(tmp / "logs"))
    return params, _final(tmp / "record.jsonl")


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def _final(path) -> dict[int, dict]:
    """step -> the last record of that step (what the finished run trained on)."""
    return {r["step"]: r for r in _records(path)}


def _assert_same_training(out, record, reference, where=""):
    ref_params, ref_steps = reference
    steps = _final(record)
    assert sorted(steps) == sorted(ref_steps), where
    for step, rec in steps.items():
        assert rec["samples"] == ref_steps[step]["samples"], f"{where}: step {step} trained on other samples"
    # The NoiseScale's count came through every restart: one measured step per step, as uninterrupted.
    assert steps[max(steps)]["noise_measured"] == ref_steps[max(ref_steps)]["noise_measured"], where
    worst = max((a - b).abs().max().item() for a, b in zip(torch.load(out, weights_only=True), ref_params))
    assert worst < 1e-5, f"{where}: parameters differ by {worst:.2e}"
    return worst


@pytest.mark.slow
def test_a_hang_is_stopped_by_the_hang_timeout_and_the_restart_finishes_the_same_training(tmp_path, reference):
    """2 ranks, rank 1 sleeps in step 5; --hang-timeout 3 stops the job with the verdict, the restart resumes from step 4."""
    out, record = tmp_path / "params.pt", tmp_path / "record.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "multigpu", "run", "-n", "2", "--cpu", "--hang-timeout", "3", "--max-restarts", "1",
         "--log-dir", str(tmp_path / "logs"), SCRIPT, "--dir", str(tmp_path / "ckpt"), "--out", str(out),
         "--record", str(record), "--hang", "1:5"],
        capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    line = next(i for i, text in enumerate(open(SCRIPT), 1) if "time.sleep(600)" in text)
    verdict = next(ln for ln in err.splitlines() if ln.startswith("multigpu run: hang: "))
    assert verdict.startswith("multigpu run: hang: rank 1 (host "), verdict
    assert f"has been in train (_elastic_train.py:{line}) for " in verdict and ", after step 4; " in verdict, verdict
    assert "rank 0 is waiting in backward (gradient all-reduce) after step 4" in verdict, verdict
    assert "stacks: " in verdict and "/watchdog/hang1/rank1.stacks.txt" in verdict, verdict
    assert "multigpu run: --hang-timeout 3 s: stopped this node's 2 workers" in err
    assert "multigpu run: the workers were stopped for a hang (--hang-timeout); restart 1 of 1" in err
    assert "resumed from " in proc.stdout and "(step 4, written by 2 ranks, now 2); continuing at step 5" in proc.stdout
    run_dir = err.split("; logs: ", 1)[1].split()[0]
    assert not [f for f in os.listdir(os.path.join(run_dir, "watchdog")) if f.startswith("rank")]  # set aside
    worst = _assert_same_training(out, record, reference)
    print(f"\nhang stopped and restarted: {took:.1f} s in all, parameters within {worst:.1e} of one process")


def _node(tmp_path, master, node_rank, *args, env=None, net=None):
    """Node ``node_rank``'s launcher: inside its network namespace when ``net`` (tests/_netns.py), else here."""
    argv = [sys.executable, "-m", "multigpu", "run", "-n", "1", "--cpu", "--nnodes", "1:2", "--node-rank", str(node_rank),
            "--master", master, "--rdzv-last-call", "1", "--node-timeout", "3", "--log-dir",
            str(tmp_path / "logs"), SCRIPT, "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "params.pt"),
            "--record", str(tmp_path / "record.jsonl"), "--step-time", "0.1", *args]
    with open(tmp_path / f"node{node_rank}.stderr", "w") as log, open(tmp_path / f"node{node_rank}.stdout", "w") as out:
        kwargs = dict(stdout=out, stderr=log, env={**os.environ, **(env or {})})
        return net.popen(node_rank, argv, **kwargs) if net is not None else subprocess.Popen(argv, **kwargs)


def _hosts():
    """Two separate hosts (network namespaces on a bridge) where this is root with iproute2, else loopback."""
    return _netns.Hosts(2) if _netns.unavailable() is None else contextlib.nullcontext()


@pytest.mark.slow
def test_an_elastic_job_grows_then_loses_a_node_in_a_save_and_trains_what_one_process_trains(tmp_path, reference):
    """Node 0 alone (world 1) to step 4, node 1 joins (world 2) and dies inside its second save (step 8); node 0
    finishes alone from step 6."""
    record = tmp_path / "record.jsonl"
    with _hosts() as net:
        master = f"{net.nodes[0].addr}:29400" if net is not None else f"127.0.0.1:{free_port()}"
        took, lost, host = _grow_then_lose(tmp_path, master, net)
    err = (tmp_path / "node0.stderr").read_text()
    where = "separate hosts (network namespaces)" if net is not None else "loopback"
    assert host.returncode == 0, err[-3000:]
    assert lost == -signal.SIGKILL  # node 1's launcher died with its worker
    assert "world size 1..2 (elastic, --max-restarts 3)" in err
    assert "multigpu run: 1 node joined: 1 -> 2 nodes, world size 1 -> 2" in err, err[-3000:]
    assert "multigpu run: 1 node left: 2 -> 1 node, world size 2 -> 1" in err, err[-3000:]
    ckpt, out = tmp_path / "ckpt", (tmp_path / "node0.stdout").read_text()
    # Node 1 died inside the save of step 8: the survivor's save failed and discarded it; step 6 is used.
    assert f"resumed from {ckpt}/step-6 (step 6, written by 2 ranks, now 1); continuing at step 7" in out, out[-2000:]
    sizes = [(r["world_size"], r["accum_steps"]) for r in _records(record)]
    assert (1, 6) in sizes and (2, 3) in sizes and sizes[-1] == (1, 6), sizes
    worst = _assert_same_training(tmp_path / "params.pt", record, reference, where=f"sizes {sizes}")
    recs = _records(record)
    i = next(i for i in range(1, len(recs)) if recs[i - 1]["world_size"] == 2 and recs[i]["world_size"] == 1)
    # Node 1 died in the save after step recs[i-1]; the survivor trains again from the checkpoint before it.
    recovery, redone = recs[i]["time"] - recs[i - 1]["time"], recs[i - 1]["step"] - recs[i]["step"] + 1
    assert redone == 2, [(r["step"], r["world_size"]) for r in recs]  # steps 7 and 8: since checkpoint step-6
    print(f"\nelastic 1 -> 2 -> 1 nodes on {where}: {took:.1f} s from node 1's start to the end; node lost in a save -> "
          f"training again in {recovery:.1f} s, {redone} steps trained again; parameters within {worst:.1e} of one process")


def _grow_then_lose(tmp_path, master, net):
    """Node 0 alone, node 1 joins and dies in its second save: (seconds from the join to the end, node 1's exit
    code, node 0's process)."""
    record = tmp_path / "record.jsonl"
    host = _node(tmp_path, master, 0, "--hold", "5", net=net)  # alone, it waits in step 5 for the join
    joiner = None
    try:
        deadline = time.monotonic() + 90
        while not record.exists() and time.monotonic() < deadline and host.poll() is None:
            time.sleep(0.1)  # node 0 trains alone before node 1 starts
        assert record.exists(), (tmp_path / "node0.stderr").read_text()[-3000:]
        t_join = time.monotonic()
        joiner = _node(tmp_path, master, 1, env={"ELASTIC_DIE_IN_SAVE": "2"}, net=net)
        host.wait(timeout=180)
        return time.monotonic() - t_join, joiner.wait(timeout=30), host
    finally:
        for p in (host, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("nnodes, extra, expected", [
    ("3:2", [], "--nnodes MIN:MAX needs MIN <= MAX, got '3:2'; use --nnodes 2:3"),
    ("0:2", [], "--nnodes needs at least 1 node, got '0:2'; use e.g. --nnodes 2 or --nnodes 1:2"),
    ("1:x", [], "--nnodes takes N or MIN:MAX (e.g. 2, or 1:3 for an elastic job), got '1:x'"),
    ("1:2", [], "--nnodes 1:2 needs --master HOST:PORT (node 0's address and a free port, where the rendezvous is hosted), or run inside srun"),
    ("1:2", ["--master", "127.0.0.1:29500", "--hang-timeout", "0"], "--hang-timeout takes seconds, more than 0, got 0.0; use e.g. --hang-timeout 60"),
])
def test_bad_elastic_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, nnodes, extra, expected):
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["run", "--cpu", "--nnodes", nnodes, *extra, SCRIPT])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"multigpu run: error: {expected}", err
    assert not list(tmp_path.iterdir())  # nothing started, no log folder


def test_elastic_placement_and_the_torchrun_rendezvous_it_asks_for():
    cfg = config.RunConfig(SCRIPT, nnodes="1:3", node_rank=1, master="127.0.0.1:29500", cpu=True, rdzv_last_call=5)
    place = config.resolve(cfg, environ={})
    assert (place.min_nodes, place.nnodes, place.max_restarts, place.nodes_text, place.elastic) == (1, 3, 3, "1:3", True)
    from multigpu.launch.start import _torchrun_argv

    argv = _torchrun_argv(cfg, place)
    assert "--nnodes=1:3" in argv and "--max-restarts=3" in argv
    assert "--rdzv-conf=is_host=false,join_timeout=600,last_call_timeout=5,keep_alive_interval=5,keep_alive_max_attempt=3" in argv
    quick = config.RunConfig(SCRIPT, nnodes="1:3", master="127.0.0.1:29500", node_timeout=4)
    assert quick.keep_alive == (1, 4)
    fixed = config.resolve(config.RunConfig(SCRIPT, nnodes=2, master="127.0.0.1:29500", cpu=True), environ={})
    assert (fixed.elastic, fixed.max_restarts, fixed.nodes_text) == (False, 0, "2")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    inside = config.resolve(config.RunConfig(SCRIPT, nnodes="2:4", cpu=True), environ=slurm)
    assert (inside.source, inside.master_addr, inside.node_rank, inside.nodes_text) == ("slurm", "gpu01", 2, "2:4")
    with pytest.raises(UsageError, match="MIN <= MAX"):
        config.resolve(config.RunConfig(SCRIPT, nnodes="4:2", master="127.0.0.1:29500"), environ={})


def test_noise_scale_state_survives_a_checkpoint_round_trip():
    """What an elastic restart keeps: the EMAs, the counts and the step count behind ``every``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    plan = mg.BatchPlan(8, 1, micro_batch=2)
    noise = mg.NoiseScale(plan, every=2, sync_every=1).attach(model)
    for _ in range(7):
        for x in torch.randn(plan.accum_steps, 2, 6):
            (model(x).pow(2).mean() / plan.accum_steps).backward()
        model.zero_grad()
    state = {k: v.clone() for k, v in noise.state_dict().items()}
    again = mg.NoiseScale(plan, every=2, sync_every=1).attach(torch.nn.Linear(6, 1))
    again.load_state_dict(state)
    assert noise.measured == 4 and again.measured == 4
    assert again.metrics() == noise.metrics() and again._rounds == noise._rounds == 7
