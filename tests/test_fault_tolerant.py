"""`multigpu run --fault-tolerant`: replica groups that outlive a SIGKILL, against one process (torchft).

Three replica groups of two CPU workers (DDP inside each group, tests/_ft_train.py) meet at the
launcher's lighthouse. The test SIGKILLs every worker of one group while the others train; the
survivors commit steps without it, its launcher restarts it, it heals from a live group and rejoins.
The groups' records say which groups' shares each committed step used; one process replaying exactly
those samples must end with the same parameters (float64, 1e-9).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import _ft_train as job
from _cli import run_cli

pytest.importorskip("torchft")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_ft_train.py")
GROUPS, STEPS = 3, 60


def _records(out: str, group: int) -> list[dict]:
    path = [os.path.join(root, f"group{group}.jsonl") for root, _, files in os.walk(out) if f"group{group}.jsonl" in files]
    if not path:
        return []
    with open(path[0]) as fp:
        return [json.loads(line) for line in fp if line.endswith("\n")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fp:  # a zombie is gone too: it only waits for its parent to read it
        return fp.read().rsplit(")", 1)[1].split()[0] != "Z"


def _pids(out: str, group: int) -> list[int]:
    return [int(open(os.path.join(out, "pids", f"group{group}.rank{r}")).read()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("inner, ranks, sig", [("ddp", (0, 1), signal.SIGKILL), ("fsdp", (1,), signal.SIGKILL),
                                               ("ddp", (0, 1), signal.SIGSTOP)],
                         ids=["ddp-whole-group-killed", "fsdp-one-rank-killed", "ddp-group-silent"])
def test_a_group_lost_mid_run_rejoins_and_the_survivors_train_what_one_process_trains(tmp_path, inner, ranks, sig):
    """SIGKILL of a whole group (DDP inside the groups), of one of its ranks (FSDP inside), and a group gone
    silent (SIGSTOP: no connection reset, no heartbeat, as a cut link looks to the others) that wakes up again.
    A restarted group waits 4 s before it rejoins, as a replacement would: CI once saw a restart (the elastic
    agent restarts a group as soon as one rank dies) rejoin before the lighthouse's 2 s heartbeat timeout had
    dropped the old one, so the others retried instead of committing a step without it."""
    out = str(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "multigpu", "run", "--cpu", "-n", "2", "--fault-tolerant", str(GROUPS),
         "--log-dir", os.path.join(out, "logs"), SCRIPT, "--out", out, "--steps", str(STEPS), "--sleep", "0.1",
         "--sleep-without", "0.5", "--inner", inner, "--timeout", "3", "--rejoin-delay", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(_records(out, 1)) < 10:  # group 1 has committed 10 steps: hit it mid-run
            assert launcher.poll() is None and time.monotonic() < deadline, "the groups never reached step 10"
            time.sleep(0.02)
        killed = [_pids(out, 1)[r] for r in ranks]
        for pid in killed:
            os.kill(pid, sig)
        while sig == signal.SIGSTOP and sum(len(r["groups"]) < GROUPS for r in _records(out, 0)) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, "the others stopped with group 1"
            time.sleep(0.02)
        for pid in killed if sig == signal.SIGSTOP else ():  # the others went on without it: wake it up
            os.kill(pid, signal.SIGCONT)
        text, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, text[-3000:]

    survivor = _records(out, 0)
    assert [r["step"] for r in survivor] == list(range(STEPS))  # every step committed once, none twice
    records = {g: _records(out, g) for g in range(GROUPS)}
    for g in (1, 2):  # each group's record of a step it committed is the survivor's, and names it
        for r in records[g]:
            assert g in survivor[r["step"]]["groups"] and (r["groups"], r["skipped"]) == (
                survivor[r["step"]]["groups"], survivor[r["step"]]["skipped"]), (g, r, survivor[r["step"]])
    without = [r["step"] for r in survivor if len(r["groups"]) < GROUPS]
    lost = [r["step"] for r in survivor if 1 not in r["groups"]]
    assert lost and all(0 in r["groups"] for r in survivor), survivor
    rejoined = [r for r in records[1] if r["healed"]]
    assert rejoined and rejoined[-1]["step"] > max(lost), records[1]  # group 1 heals from a live group, rejoins
    assert any(1 in r["groups"] for r in survivor if r["step"] > max(lost))  # and trains with the others again
    # A machine this loaded can leave another group out of a quorum (the lighthouse's 2 s join timeout): it rejoins
    # the same way, healed.
    for r in survivor:
        for g in set(range(GROUPS)) - set(r["groups"]) - {1}:
            assert any(h["healed"] and h["step"] > r["step"] for h in records[g]), (g, r, records[g])

    # No sample twice; the skipped ones are the missing groups' shares, counted in the record and the summary.
    share = job.GLOBAL_BATCH // GROUPS
    assert all(r["skipped"] == share * (GROUPS - len(r["groups"])) for r in survivor)
    skipped = sum(r["skipped"] for r in survivor)
    heals = [r["heal_s"] for g in range(GROUPS) for r in records[g] if r["healed"]]
    assert (f"{STEPS} steps committed, {len(without)} without every group ({skipped} samples skipped), {len(heals)} "
            f"heal{'s' if len(heals) > 1 else ''} from a live group ({', '.join(f'{h:.2f}' for h in heals)} s)") \
        in text, text[-2000:]
    assert all(0 < h < 30 for h in heals)

    # The step meter of a survivor says the same: its summary counts from the record, its rate the samples trained.
    from multigpu.meter.records import read_records

    meter = read_records(os.path.join(out, "meter0", "metrics.jsonl"))
    summary = meter[-1]["replicas"]
    fewest = min(len(r["groups"]) for r in survivor)
    assert (summary["committed"], summary["without_all"], summary["skipped"], summary["fewest"]) == (
        STEPS, len(without), skipped, fewest), summary
    changes = [{"step": r["step"], "groups": r["groups"]} for i, r in enumerate(survivor)
               if i == 0 or r["groups"] != survivor[i - 1]["groups"]]
    assert summary["changes"] == changes and len(changes) >= 3, (summary, survivor)
    assert meter[-1]["samples_seen"] == STEPS * job.GLOBAL_BATCH - skipped
    steps = [r for r in meter if r["type"] == "step"]
    assert sum(r["samples"] for r in steps) == STEPS * job.GLOBAL_BATCH - skipped
    assert sum(r["steps"] for r in steps) == STEPS and sum(r["attempts"] for r in steps) == STEPS + summary["retried"]
    for c in changes:  # each quorum change a console line
        missing = sorted(set(range(GROUPS)) - set(c["groups"]))
        who = f"group{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} missing" if missing else "every group"
        assert f"[group 0] multigpu: step {c['step']}: quorum of {len(c['groups'])} of 3 replica groups ({who})" in text
    # Group 1's meter (restarted, or healed in place with its step jumping past the steps it missed): it counts
    # the job's skipped samples (the live group's count came with the heal), and rates only what it trained.
    healed = read_records(os.path.join(out, "meter1", "metrics.jsonl"))
    assert healed[-1]["samples_seen"] == STEPS * job.GLOBAL_BATCH - skipped, healed[-1]
    life = max(i for i, r in enumerate(healed) if r["type"] == "header")  # a restart appends its own records
    mine, steps = _records(out, 1), [r for r in healed[life:] if r["type"] == "step"]
    # Restarted: always after SIGKILL; after SIGSTOP only when an inner (DDP) collective in flight as the group
    # stopped timed out as it woke (CI saw it once, under load), and its launcher restarted it, as for a kill.
    restarted = life > 0
    assert restarted == ("attempt_1" in text) and (restarted or sig == signal.SIGSTOP), text[-3000:]
    if restarted:  # the restarted process's meter: the steps from its heal on
        mine = mine[min(i for i, r in enumerate(mine) if r["healed"] and r["step"] >= min(lost)):]
    assert sum(r["samples"] for r in steps) == sum(job.GLOBAL_BATCH - r["skipped"] for r in mine), healed
    assert healed[-1]["measured"]["samples"] == sum(r["samples"] for r in steps[1:]), healed  # warm-up left out
    from multigpu.report.run import run_page

    page = str(run_page(pathlib.Path(out, "meter0"), meter, {}, []))
    assert f"{len(without)} without every group ({skipped:,} samples skipped, fewest {fewest} of 3)" in page, page
    for c in changes:
        assert f"from step {c['step']}: groups {', '.join(map(str, c['groups']))} of 3" in page, page

    expected = job.replay(survivor, GROUPS)
    for g in range(GROUPS):
        got = torch.load(os.path.join(out, f"group{g}.pt"))
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-9, f"group {g}: {worst:.3g} from one process on the committed samples"
    every = job.replay([dict(r, groups=[0, 1, 2]) for r in survivor], GROUPS)  # the skipped shares matter
    assert max((every[k] - expected[k]).abs().max().item() for k in every) > 1e-6
    assert not any(_alive(p) for g in range(GROUPS) for p in _pids(out, g) + killed)


@pytest.mark.parametrize("argv, expected", [
    (["--fault-tolerant", "1"], "--fault-tolerant needs at least 2 replica groups (a lost group heals from a live "
                                "one), got 1; use --fault-tolerant 2 or more, or drop --fault-tolerant"),
    (["--lighthouse", "localhost:1"], "--lighthouse is where --fault-tolerant's groups meet, got it without "
                                      "--fault-tolerant; add --fault-tolerant G or drop --lighthouse localhost:1"),
    (["--fault-tolerant", "2", "--lighthouse", "127.0.0.1:1"], "--lighthouse 127.0.0.1:1: cannot reach a lighthouse "
     "there (Connection refused); start one (torchft_lighthouse --min_replicas 1) or drop --lighthouse"),
    (["--fault-tolerant", "3", "--nnodes", "2", "--master", "127.0.0.1:29500"], "--fault-tolerant 3 on 2 nodes: "
     "each node runs whole replica groups, the same number on every node, and 3 is not a multiple of 2; use "
     "--fault-tolerant 2 or 4"),
    (["--fault-tolerant", "2", "--nnodes", "1:2", "--master", "127.0.0.1:29500"], "--fault-tolerant keeps the live "
     "groups training without a restart; --nnodes takes one count N with it, got 1:2; use --nnodes 2"),
    (["--fault-tolerant", "2", "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:1", "--rdzv-timeout", "1"],
     "--fault-tolerant: no lighthouse answered at node 0's 127.0.0.1:1 within 1 s (Connection refused); start node "
     "0's launcher (it starts the lighthouse there), pass --lighthouse HOST:PORT, or a longer --rdzv-timeout"),
])
def test_bad_fault_tolerant_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["run", "--cpu", *argv, SCRIPT], capsys)
    assert code == 2 and err.strip() == f"multigpu run: error: {expected}", err
    assert not list(tmp_path.iterdir())  # nothing started, no log folder


def test_a_node_waiting_for_node_0s_lighthouse_says_so(tmp_path, monkeypatch, capsys):
    """A wait for node 0's lighthouse can last the whole --rdzv-timeout: past SAY_WAIT_S it is said, once."""
    from multigpu.launch import replicas

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(replicas, "SAY_WAIT_S", 0.0)
    code, err = run_cli(["run", "--cpu", "--fault-tolerant", "2", "--nnodes", "2", "--node-rank", "1", "--master",
                         "127.0.0.1:1", "--rdzv-timeout", "1", SCRIPT], capsys)
    assert code == 2 and err.splitlines() == [
        "multigpu run: --fault-tolerant: waiting up to 1 s (--rdzv-timeout) for node 0's lighthouse at 127.0.0.1:1 "
        "(Connection refused)",
        "multigpu run: error: --fault-tolerant: no lighthouse answered at node 0's 127.0.0.1:1 within 1 s (Connection "
        "refused); start node 0's launcher (it starts the lighthouse there), pass --lighthouse HOST:PORT, or a longer "
        "--rdzv-timeout"], err


def test_a_lighthouse_that_cannot_start_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Node 0 starts the lighthouse on --master's port: another program listening there is one line, exit 2,
    before anything is made or started (no log folder, so no group, and nothing left on the port)."""
    monkeypatch.chdir(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, err = run_cli(["run", "--cpu", "--fault-tolerant", "2", "--nnodes", "2", "--node-rank", "0",
                             "--master", f"127.0.0.1:{port}", SCRIPT], capsys)
        assert code == 2 and err.strip() == (
            f"multigpu run: error: --fault-tolerant: node 0 starts the torchft lighthouse on --master's port {port}, "
            f"and it could not listen there (Address already in use (os error 98)); free port {port} or name another "
            "in --master, or pass --lighthouse HOST:PORT to use a lighthouse already running"), err
        assert not list(tmp_path.iterdir())
    socket.create_server(("0.0.0.0", port)).close()  # and no lighthouse was left on the port


@pytest.mark.slow
def test_groups_that_differ_are_stopped_with_one_line_and_exit_2(tmp_path):
    """Group 1's model is wider: it cannot heal from group 0 nor average with it. Every group is stopped at
    once (no restart can fix it), the launcher's last line says what differs, exit 2, nothing left running."""
    done = subprocess.run([sys.executable, "-m", "multigpu", "run", "--cpu", "-n", "1", "--fault-tolerant", "2",
                           "--log-dir", str(tmp_path / "logs"), SCRIPT, "--out", str(tmp_path), "--steps", "5",
                           "--wider-group", "1"], capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last == (
        "multigpu run: error: the replica groups differ (parameters: group 0 4 tensors, 178 values (rank 0's), "
        "group 1 4 tensors, 266 values (rank 0's)); every group must run the same script, layout and torchft "
        "release: start them from one launcher and environment"), done.stderr[-3000:]
    assert "attempt_1" not in done.stdout + done.stderr  # stopped, not restarted
    assert not any(_alive(int(open(tmp_path / "pids" / f).read())) for f in os.listdir(tmp_path / "pids"))


def test_without_torchft_installed_it_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["run", "--cpu", "--fault-tolerant", "2", SCRIPT], capsys)
    assert code == 2 and err.strip() == ("multigpu run: error: --fault-tolerant needs torchft, which is not installed; "
                                         "pip install 'multigpu[ft]'"), err


def test_without_the_launcher_the_script_is_one_group_that_uses_every_sample(tmp_path):
    """The same script under plain python: one replica group, no torchft, every share of every global batch."""
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--steps", "5"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchft" not in done.stderr
    got, expected = torch.load(tmp_path / "group0.pt"), job.replay([{"step": s, "groups": [0]} for s in range(5)], 1)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-9


def test_doctor_names_torchft_and_a_lighthouse_it_cannot_reach():
    """`multigpu doctor`: torchft's release, and TORCHFT_LIGHTHOUSE checked with a real connection."""
    import importlib.metadata
    import socket

    from multigpu.doctor.checks import check_torchft, torchft_status

    version = importlib.metadata.version("torchft")
    with socket.socket() as listener:  # a port that answers, then one that does not
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        up = check_torchft(*torchft_status({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}))
    down = check_torchft(*torchft_status({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}))
    assert [f.what for f in up] == [f"torchft {version}", f"lighthouse http://127.0.0.1:{port} answers"]
    assert down[1].status == "problem" and down[1].what == (
        f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port} cannot be reached (Connection refused)")
    assert [f.what for f in check_torchft(*torchft_status({}))] == [f"torchft {version}"]


def test_a_loader_not_built_on_the_replicas_plan_is_one_line(tmp_path):
    """Group 1 of 2 handed a loader over its own ranks only (it would read group 0's share): exit 2, one line."""
    from torchft._torchft import LighthouseServer

    from multigpu.testing import free_port

    script = tmp_path / "wrong.py"
    script.write_text(
        "import torch, multigpu as mg\n"
        "from torch.utils.data import TensorDataset\n"
        "with mg.init(seed=0, device='cpu') as dist:\n"
        "    net = torch.nn.Linear(2, 1)\n"
        "    replicas = mg.fault_tolerant(net, torch.optim.SGD(net.parameters(), lr=0.1), dist)\n"
        "    data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))\n"
        "    for step, batches in replicas.steps(mg.loader(data, mg.BatchPlan(8, 1), dist), 3):\n"
        "        pass\n")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        env = dict(os.environ, MULTIGPU_REPLICA_GROUP="1", MULTIGPU_REPLICA_GROUPS="2", RANK="0", WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RUST_LOG="warn",
                   TORCHFT_LIGHTHOUSE=f"http://localhost:{lighthouse.address().rsplit(':', 1)[1]}")
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    finally:
        lighthouse.shutdown()
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "multigpu: error: the loader's plan (world_size 1, dp_rank 0) is not replica group 1's share of 2 groups; "
        "build it with mg.loader(data, replicas.plan(global_batch), dist)"), done.stderr[-2000:]
