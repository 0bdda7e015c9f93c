"""`multigpu run`: real launches of small scripts on CPU (gloo), plus argument checks.

Every launch starts a launcher and its workers as real processes. Launches
that do not depend on each other run at the same time, which also checks that
two runs on one machine do not collide.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from multigpu.errors import UsageError
from multigpu.launch import RunConfig, resolve

from _cli import run_cli

# A torchrun-style script: reads RANK/WORLD_SIZE itself, calls init_process_group itself,
# imports a module from its own directory. It knows nothing of multigpu.
WORKER = r'''
import json, os, signal, subprocess, sys, time
from helper import GREETING

mode, out = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def put(name, obj):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(obj, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


if mode in ("raise", "kill"):
    if rank == 0:
        child = subprocess.Popen(["sleep", "300"])  # a grandchild: must die with the run too
        put("pids.json", {"rank0": os.getpid(), "grandchild": child.pid})
        time.sleep(300)
    else:
        while not os.path.exists(os.path.join(out, "go")):  # the test says when
            time.sleep(0.05)
        put("death.json", {"time": time.time(), "pid": os.getpid()})
        if mode == "raise":
            raise ValueError("boom from rank 1")
        os.kill(os.getpid(), signal.SIGKILL)

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"stdout of rank {rank}", flush=True)
print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
put(f"rank{rank}.attempt{attempt}.json", {
    "name": __name__, "argv": sys.argv[1:], "greeting": GREETING, "sum": total.item(), "world": world,
    "omp": os.environ.get("OMP_NUM_THREADS"), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "master_port": os.environ["MASTER_PORT"],
})
dist.destroy_process_group()
# Files never closed reach the disk as under `python`: one in the script's globals (which are in a
# cycle with put(); under runpy's copy they were lost), one in an imported module's.
import helper
left_open = open(os.path.join(out, f"rank{rank}.global.txt"), "w")
left_open.write("kept\n")
helper.LOG = open(os.path.join(out, f"rank{rank}.module.txt"), "w")
helper.LOG.write("kept\n")
if mode == "restart" and rank == 1:
    sys.exit(3 if attempt == 0 else 2)
'''


def _write_scripts(root: Path) -> Path:
    """worker.py + helper.py in root, and the same as package ``pkg`` (relative import) for -m."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "worker.py").write_text(WORKER)
    (root / "helper.py").write_text("GREETING = 'hi from helper'\n")
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "helper.py").write_text("GREETING = 'hi from pkg.helper'\n")
    (root / "pkg" / "worker.py").write_text(WORKER.replace("from helper import", "from .helper import"))
    return root / "worker.py"


def _start(args: list[str], cwd: Path, name: str, env: dict | None = None) -> tuple[subprocess.Popen, Path, Path]:
    out, err = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "multigpu", "run", *args], cwd=cwd, env=env or os.environ.copy(),
        stdout=out.open("w"), stderr=err.open("w"),
    )
    return proc, out, err


def _wait_all(procs: list[subprocess.Popen], timeout: float = 120) -> list[float]:
    """Wait for every process; return the wall time at which each one exited."""
    ended = [None] * len(procs)
    deadline = time.time() + timeout
    while None in ended:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        if time.time() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"launcher did not exit within {timeout} s")
        time.sleep(0.02)
    return ended


def _run_dir(stderr: str) -> Path:
    line = next(ln for ln in stderr.splitlines() if "; logs: " in ln)
    return Path(line.rsplit("; logs: ", 1)[1].strip())


def _summary(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("multigpu run: rank ") and "; log: " in ln]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["-n", "0", "{script}"], "-n/--nproc must be at least 1, got 0"),
        (["-n", "-3", "{script}"], "must be at least 1, got -3"),
        (["-n", "two", "{script}"], "invalid int value"),
        (["missing.py"], "script 'missing.py' does not exist"),
        ([], "got neither"),
        (["-m"], "-m needs a module name"),
        (["-m", "worker.py"], "drop -m to run a script file"),
        (["-m", "no_such_module_xyz"], "module 'no_such_module_xyz' was not found"),
        (["--nnodes", "2", "{script}"], "--nnodes 2 needs --master HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--master", "h:29500", "{script}"], "--node-rank must be in [0, 2)"),
        (["--node-rank", "-1", "{script}"], "--node-rank must be in [0, 1)"),
        (["--nnodes", "2", "--master", "node0", "{script}"], "--master must be HOST:PORT"),
        (["--nnodes", "2", "--master", "node0:99999", "{script}"], "port in 1..65535, got 'node0:99999'"),
        (["--nnodes", "2", "--master", "node0:http", "{script}"], "--master must be HOST:PORT"),
        (["--max-restarts", "-1", "{script}"], "--max-restarts must be 0 or more, got -1"),
        (["--nnodes", "0", "{script}"], "--nnodes needs at least 1 node, got '0'"),
        (["--log-dir", "{script}", "{script}"], "cannot create the log directory"),
        (["--find-batch", "{script}"], "--find-batch on CPU workers (--cpu) needs --memory-budget SIZE"),
        (["--memory-budget", "1GiB", "{script}"], "got it without --find-batch; add --find-batch or drop --memory-budget 1GiB"),
        (["--find-batch", "--memory-budget", "12XB", "{script}"], "--memory-budget must be a positive size like 512MB, 8GiB or a number of bytes, got '12XB'"),
        (["--find-batch", "--memory-budget", "0MB", "{script}"], "got '0MB'"),
        (["--find-batch", "--memory-budget", "1.5", "{script}"], "got '1.5'"),
        (["--cpu", "-n", "99999", "{script}"], "-n 99999 CPU workers on"),
        (["--master", "nohost.invalid:1", "{script}"], "--master host 'nohost.invalid' does not resolve"),
        (["--nnodes", "2", "--master", "nohost.invalid:29500", "{script}"], "use node 0's host name or IP address"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected, tmp_path, monkeypatch, capsys):
    script = _write_scripts(tmp_path)
    monkeypatch.chdir(tmp_path)
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    logs = tmp_path / "logs"
    args = ["run", "--cpu", "--log-dir", str(logs), *[a.format(script=script) for a in argv]]
    code, err = run_cli(args, capsys)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("multigpu") and expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert not logs.exists()  # nothing half-written


def test_bad_input_from_the_command_line(tmp_path):
    # The same check through a real `python -m multigpu run` process.
    proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", "0", "x.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "multigpu run: error: -n/--nproc must be at least 1, got 0; use e.g. -n 2"
    ], proc.stderr


def test_resolve_gpus_and_slurm(tmp_path, monkeypatch):
    script = str(_write_scripts(tmp_path))
    two_gpus = lambda: 2  # noqa: E731 - the GPU count is injected; a CPU machine has none
    assert resolve(RunConfig(script), environ={}, gpu_count=two_gpus).nproc == 2
    assert resolve(RunConfig(script), environ={}, gpu_count=lambda: 0).nproc == 2
    assert resolve(RunConfig(script, nproc=1), environ={}, gpu_count=two_gpus).nproc == 1
    with pytest.raises(UsageError, match="-n 3 is more than the 2 visible GPUs; use -n 2 or fewer, or --cpu"):
        resolve(RunConfig(script, nproc=3), environ={}, gpu_count=two_gpus)
    # --cpu never asks for GPUs and allows any count.
    assert resolve(RunConfig(script, nproc=3, cpu=True), environ={}, gpu_count=lambda: 1 / 0).nproc == 3

    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_NTASKS": "3",
             "SLURM_JOB_NODELIST": "gpu[07-09],cpu1"}
    place = resolve(RunConfig(script, cpu=True), environ=slurm)
    assert (place.nnodes, place.node_rank, place.master_addr, place.master_port, place.source) == (3, 2, "gpu07", 24242, "slurm")
    assert place.run_id == "slurm-4242"
    # Explicit flags win over SLURM's variables.
    place = resolve(RunConfig(script, cpu=True, nnodes=2, node_rank=1, master="10.0.0.1:1234"), environ=slurm)
    assert (place.nnodes, place.node_rank, place.master_addr, place.master_port, place.source) == (2, 1, "10.0.0.1", 1234, "flags")
    with pytest.raises(UsageError, match="one srun task per node, got SLURM_NTASKS=6 on 3 nodes"):
        resolve(RunConfig(script, cpu=True), environ={**slurm, "SLURM_NTASKS": "6"})
    # A one-node allocation is an ordinary standalone run.
    assert resolve(RunConfig(script, cpu=True), environ={**slurm, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1"}).source == "standalone"
    place = resolve(RunConfig(script, cpu=True, nnodes=2, node_rank=0, master="[::1]:29500"), environ={})
    assert (place.master_addr, place.master_port) == ("::1", 29500)


def _budget(text: str) -> int | None:
    return RunConfig("train.py", find_batch=True, memory_budget=text).memory_budget_bytes  # values.parse_size's


def test_memory_budget_sizes_and_find_batch_on_gpus(tmp_path):
    assert [_budget(t) for t in ("4096", "512MB", "512mb", "8GiB", "1.5GiB", "2KiB", "1TB")] == [
        4096, 512 * 10**6, 512 * 10**6, 8 << 30, 3 << 29, 2048, 10**12]
    for bad in ("", "-1GB", "1e9", "12 MB", "GiB", "1.5.2GB", "0", "0.0000001KB", "1.5B", "2GiBs"):
        with pytest.raises(UsageError, match="--memory-budget must be a positive size"):
            _budget(bad)
    # With GPUs the search has CUDA's out-of-memory error; a budget is optional there.
    script = str(_write_scripts(tmp_path))
    assert resolve(RunConfig(script, find_batch=True), environ={}, gpu_count=lambda: 2).nproc == 2
    with pytest.raises(UsageError, match=r"--find-batch on CPU workers \(no visible GPU\)"):
        resolve(RunConfig(script, find_batch=True), environ={}, gpu_count=lambda: 0)


# --------------------------------------------------------------------------- real launches


def test_two_runs_at_once_console_logs_and_torchrun_script(tmp_path):
    script = _write_scripts(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env_a = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher picks it
    a = _start(["-n", "2", "--log-dir", str(tmp_path / "logs"), str(script), "ok", str(tmp_path / "a"), "--lr", "0.1 0.2"], tmp_path, "a", env_a)
    b = _start(["--cpu", "--all-ranks", "--log-dir", str(tmp_path / "logs"), str(script), "ok", str(tmp_path / "b")], tmp_path, "b")
    _wait_all([a[0], b[0]])
    out_a, err_a, out_b, err_b = (p.read_text() for p in (a[1], a[2], b[1], b[2]))
    assert a[0].returncode == 0, err_a
    assert b[0].returncode == 0, err_b

    # Rank 0 on the console, unprefixed, stdout and stderr apart; rank 1 only in its log files.
    assert out_a.splitlines() == ["stdout of rank 0"]
    assert "stderr of rank 0" in err_a.splitlines() and "of rank 1" not in out_a + err_a
    run_a = _run_dir(err_a)
    assert (run_a / "attempt_0" / "rank1.stdout.log").read_text() == "stdout of rank 1\n"
    assert (run_a / "attempt_0" / "rank1.stderr.log").read_text() == "stderr of rank 1\n"
    assert (run_a / "attempt_0" / "rank0.stdout.log").read_text() == "stdout of rank 0\n"
    assert (run_a / "launcher.log").stat().st_size > 0  # torch's agent log, kept off the console
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"multigpu run: OMP_NUM_THREADS: unset -> '{threads}'" in err_a
    # --all-ranks: every rank, prefixed; --cpu hides GPUs from the workers, and says so.
    assert sorted(out_b.splitlines()) == ["[rank0] stdout of rank 0", "[rank1] stdout of rank 1"]
    assert "[rank1] stderr of rank 1" in err_b.splitlines()
    assert "CUDA_VISIBLE_DEVICES:" in err_b and "-> ''" in err_b
    assert _run_dir(err_b) != run_a

    records = {(d, r): json.loads((tmp_path / d / f"rank{r}.attempt0.json").read_text()) for d in "ab" for r in (0, 1)}
    for (d, r), rec in records.items():
        assert rec["name"] == "__main__" and rec["greeting"] == "hi from helper"
        assert rec["world"] == 2 and rec["sum"] == 3.0
        assert rec["argv"] == ["ok", str(tmp_path / d)] + (["--lr", "0.1 0.2"] if d == "a" else [])
    assert records["a", 0]["omp"] == str(threads)
    assert records["b", 0]["omp"] == os.environ.get("OMP_NUM_THREADS")  # the user's value is kept
    assert records["b", 0]["cvd"] == "" and records["b", 1]["cvd"] == ""
    assert records["a", 0]["master_port"] != records["b", 0]["master_port"]
    for d in "ab":
        for r in (0, 1):
            assert [(tmp_path / d / f"rank{r}.{k}.txt").read_text() for k in ("global", "module")] == ["kept\n"] * 2


def test_failed_worker_stops_the_run(tmp_path):
    # Rank 1 raises (module run, -m) or is SIGKILLed (script run) while rank 0 sleeps
    # with a child of its own; a third run is stopped by SIGTERM to the launcher (Ctrl-C, a
    # scheduler). All must end fast, leave no process behind and say why in one line.
    script = _write_scripts(tmp_path)
    runs = {}
    for name, mode, target in (("raise", "raise", ["-m", "pkg.worker"]), ("kill", "kill", [str(script)]), ("term", "kill", [str(script)])):
        out = tmp_path / name
        out.mkdir()
        runs[name] = (*_start(["-n", "2", "--log-dir", str(tmp_path / "logs"), *target, mode, str(out)], tmp_path, name), out)
    descendants = {}
    for mode, (proc, _, _, out) in runs.items():
        deadline = time.time() + 60
        while not (out / "pids.json").exists():
            assert proc.poll() is None and time.time() < deadline, (runs[mode][2].read_text())
            time.sleep(0.05)
        descendants[mode] = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants[mode]) >= 3  # two workers and rank 0's child
    for mode, (_, _, _, out) in runs.items():
        if mode == "term":
            (out / "death.json").write_text(json.dumps({"time": time.time(), "pid": None}))
            runs[mode][0].send_signal(signal.SIGTERM)
        else:
            (out / "go").write_text("")
    ended = dict(zip(runs, _wait_all([r[0] for r in runs.values()])))

    for mode, (proc, _, err_path, out) in runs.items():
        err = err_path.read_text()
        death = json.loads((out / "death.json").read_text())
        delay = ended[mode] - death["time"]
        said = err_path.stat().st_mtime - death["time"]  # the summary is the launcher's last write
        print(f"{mode}: worker death -> summary line {said:.2f} s, -> launcher exit {delay:.2f} s")
        assert delay < 20, err
        survivors = [p for p in descendants[mode] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert survivors == [], survivors
        if mode == "term":
            assert proc.returncode == 128 + signal.SIGTERM, err
            assert err.splitlines()[-1] == "multigpu run: stopped by SIGTERM; all workers were stopped", err
            continue
        summary = _summary(err)
        assert len(summary) == 1, err
        line = summary[0]
        log = _run_dir(err) / "attempt_0" / "rank1.stderr.log"
        assert f"on host {socket.gethostname()} (pid {death['pid']}); log: {log}" in line
        assert "Traceback" not in err  # rank 1's traceback stays in its log; rank 0 was asleep
        if mode == "raise":
            assert proc.returncode == 1
            assert line.startswith("multigpu run: rank 1 failed with exit code 1 on host")
            assert line.endswith("; last line: ValueError: boom from rank 1")
        else:
            assert proc.returncode == 128 + 9
            assert line.startswith("multigpu run: rank 1 was killed by SIGKILL on host")


def test_max_restarts_and_the_python_api(tmp_path, capsys):
    script = _write_scripts(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "api").mkdir()
    proc, _, err_path = _start(["-n", "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), str(script), "restart", str(tmp_path / "out")], tmp_path, "r")

    # Meanwhile, in this process, the API `multigpu study` will use: it must leave the
    # environment, the signal handlers and torch's loggers as it found them.
    import logging

    import torch.distributed.run  # noqa: F401 - importing it sets its loggers' levels; we check what run() does after

    from multigpu.launch import run

    env_before = dict(os.environ)
    handlers_before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.run")]
    loggers_before = [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    code = run(str(script), ["ok", str(tmp_path / "api")], nproc=2, cpu=True, log_dir=str(tmp_path / "api-logs"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "stdout of rank 0\n"
    assert json.loads((tmp_path / "api" / "rank1.attempt0.json").read_text())["cvd"] == ""
    assert dict(os.environ) == env_before
    assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before
    assert [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers] == loggers_before

    _wait_all([proc])
    err = err_path.read_text()
    run = _run_dir(err)
    # Attempt 0: rank 1 exits 3 -> one restart; attempt 1 runs collectives again, then rank 1 exits 2.
    assert f"multigpu run: rank 1 failed (exit code 3); restart 1 of 1, logs in {run / 'attempt_1'}" in err.splitlines()
    for attempt in (0, 1):
        for rank in (0, 1):
            assert json.loads((tmp_path / "out" / f"rank{rank}.attempt{attempt}.json").read_text())["sum"] == 3.0
            assert (run / f"attempt_{attempt}" / f"rank{rank}.stdout.log").read_text() == f"stdout of rank {rank}\n"
    assert proc.returncode == 2, err
    [line] = _summary(err)
    pid = re.search(r"\(pid (\d+)\)", line).group(1)
    assert line == (f"multigpu run: rank 1 failed with exit code 2 on host {socket.gethostname()} (pid {pid}); "
                    f"log: {run / 'attempt_1' / 'rank1.stderr.log'}; last line: stderr of rank 1")


def test_two_nodes_on_loopback(tmp_path):
    script = _write_scripts(tmp_path)
    (tmp_path / "out").mkdir()
    master = f"127.0.0.1:{_free_port()}"
    nodes = [
        _start(["-n", "1", "--nnodes", "2", "--node-rank", str(r), "--master", master, "--log-dir", str(tmp_path / "logs"),
                str(script), "ok", str(tmp_path / "out")], tmp_path, f"node{r}")
        for r in (1, 0)  # the non-host node first: it waits for node 0's store
    ]
    _wait_all([n[0] for n in nodes])
    for proc, _, err in nodes:
        assert proc.returncode == 0, err.read_text()
    for rank in (0, 1):
        rec = json.loads((tmp_path / "out" / f"rank{rank}.attempt0.json").read_text())
        assert rec["world"] == 2 and rec["sum"] == 3.0
    # nodes were started as (1, 0): each names its run folder after its own node rank.
    dirs = [_run_dir(err.read_text()).name for _, _, err in nodes]
    assert "-node1-" in dirs[0] and "-node0-" in dirs[1]
    # Global rank 0 prints on whichever node the rendezvous gave it to; the other node's console stays quiet.
    outs = sorted(out.read_text() for _, out, _ in nodes)
    assert outs == ["", "stdout of rank 0\n"]


# --------------------------------------------------------------------------- summary rules, in process


def _rank_logs(tmp_path, lines):
    from multigpu.launch.logs import RankLogsSpecs

    specs = RankLogsSpecs(str(tmp_path))
    for rank, text in lines.items():
        specs.stderr_paths[rank] = str(tmp_path / f"rank{rank}.stderr.log")
        (tmp_path / f"rank{rank}.stderr.log").write_text(f"Traceback (most recent call last):\n{text}\n" if text else "")
    return specs


def _failed(**codes):
    """torch's record of a failed group: rank -> exit code, all seen in the same second, in this order."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {}
    for key, code in codes.items():
        f = ProcessFailure(local_rank=int(key[1:]), pid=100 + int(key[1:]), exitcode=code, error_file="/nonexistent")
        f.timestamp = 1_000
        failures[int(key[1:])] = f
    return ChildFailedError("worker.py", failures)


LOST_PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2948"


def test_summary_names_the_first_real_failure(tmp_path):
    from multigpu.launch.logs import failure_summary

    specs = _rank_logs(tmp_path, {0: LOST_PEER, 1: "ValueError: boom", 2: "", 3: ""})
    # A lost-peer report listed first is a symptom; the agent's own SIGTERM victims are not failures.
    code, line = failure_summary(_failed(r0=1, r1=1, r3=-signal.SIGTERM), specs)
    assert code == 1
    assert line.startswith("rank 1 failed with exit code 1 on host ") and "(pid 101)" in line
    assert line.endswith(f"log: {tmp_path / 'rank1.stderr.log'}; last line: ValueError: boom; also failed: rank 0 (exit code 1)")
    code, line = failure_summary(_failed(r3=-signal.SIGTERM, r2=-signal.SIGKILL), specs)
    assert (code, line.split(" on host")[0]) == (137, "rank 2 was killed by SIGKILL")
    assert "last line" not in line  # its stderr is empty
    code, line = failure_summary(_failed(r2=2), specs)
    assert (code, line.split(" on host")[0]) == (2, "rank 2 failed with exit code 2")


def test_summary_takes_the_workers_records_over_the_agents_view(tmp_path, monkeypatch):
    # The real race, frozen: rank 1 raised first, rank 0's lost-peer error then ended rank 0, and the agent
    # stopped rank 1 (SIGTERM) while it was still exiting. torch's view alone names rank 0.
    from multigpu.runtime.contract import failure_path, record_failure
    from multigpu.launch.logs import failure_summary

    specs = _rank_logs(tmp_path, {0: LOST_PEER, 1: "ValueError: boom", 2: "KeyError: 'later'"})
    without = failure_summary(_failed(r0=1, r1=-signal.SIGTERM), specs)[1]
    assert without.startswith("rank 0 failed with exit code 1")  # the fallback: no records to go by
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # where worker.py's records go
    for rank, err in ((1, ValueError("boom")), (0, RuntimeError(LOST_PEER)), (2, KeyError("later"))):
        monkeypatch.setenv("RANK", str(rank))
        record_failure(err)  # what worker.py calls where the exception is caught, stamped with the time
        time.sleep(0.01)
    assert all(os.path.isfile(failure_path(str(tmp_path), r)) for r in (0, 1, 2))
    code, line = failure_summary(_failed(r0=1, r1=-signal.SIGTERM), specs)
    assert code == 1 and line.startswith("rank 1 failed (ValueError; the launcher stopped it while it was exiting) "
                                          "on host "), line
    assert line.endswith("also failed: rank 0 (exit code 1)")
    # Two real errors: the one raised first names the rank, whichever ended first.
    code, line = failure_summary(_failed(r2=1, r1=1), specs)
    assert (code, line.split(" on host")[0]) == (1, "rank 1 failed with exit code 1")


def test_launcher_failure_is_one_line(tmp_path, monkeypatch, capsys):
    # A rendezvous that cannot reach node 0 takes torch two 60 s tries; its handling is checked with
    # torch's own exception, raised where elastic_launch would raise it.
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from multigpu.launch import run

    class Unreachable:
        def __init__(self, config, entrypoint):
            pass

        def __call__(self, *args):
            try:
                raise TimeoutError("The client socket has timed out after 60000ms while trying to connect to (10.9.9.9, 29500).")
            except TimeoutError as cause:
                raise RendezvousConnectionError("The connection to the C10d store has failed.") from cause

    monkeypatch.setattr(launcher_api, "elastic_launch", Unreachable)
    script = _write_scripts(tmp_path)
    code = run(str(script), nproc=1, cpu=True, nnodes=2, node_rank=1, master="10.9.9.9:29500", log_dir=str(tmp_path / "logs"))
    err = capsys.readouterr().err.splitlines()
    assert code == 1
    [run_dir] = (tmp_path / "logs").iterdir()
    assert err[-1] == (
        "multigpu run: launcher failed: RendezvousConnectionError: The connection to the C10d store has failed. <- "
        "The client socket has timed out after 60000ms while trying to connect to (10.9.9.9, 29500). "
        f"(details in {run_dir}/launcher.log)"
    )
    assert "RendezvousConnectionError" in (run_dir / "launcher.log").read_text()  # the traceback is kept there


# --------------------------------------------------------------------------- --find-batch


def test_find_batch_reported_by_the_launcher(tmp_path):
    # Four real launches at once: a script that runs the search, one that searches sequence lengths, one
    # that ignores the request,
    # and a bad budget from the command line (one line, exit 2, nothing started).
    script = Path(__file__).with_name("_find_batch_worker.py")
    logs = tmp_path / "logs"
    common = ["-n", "2", "--cpu", "--find-batch", "--log-dir", str(logs)]
    # 2 MiB per sample against 75 MiB: about 37 per rank fits (CPU peaks are exact to a few hundred KB).
    search = _start([*common, "--memory-budget", "75MiB", str(script), "search"], tmp_path, "search")
    ignore = _start([*common, "--memory-budget", "75MiB", str(script), "ignore"], tmp_path, "ignore")
    sequence = _start([*common, "--memory-budget", "75MiB", str(script), "sequence"], tmp_path, "sequence")
    bad = _start(["--cpu", "--find-batch", "--memory-budget", "75 MiB", "--log-dir", str(tmp_path / "bad-logs"), str(script)],
                 tmp_path, "bad")
    _wait_all([search[0], ignore[0], sequence[0], bad[0]])

    err = search[2].read_text()
    assert search[0].returncode == 0, err
    run_dir = _run_dir(err)
    assert f"multigpu run: MULTIGPU_MEMORY_BUDGET: unset -> '{75 << 20}' (--memory-budget 75MiB in bytes)" in err
    assert "multigpu run: MULTIGPU_FIND_BATCH: unset -> '1'" in err
    result = json.loads((run_dir / "find_batch.json").read_text())
    found = result["micro_batch"]
    assert 32 <= found < 64, result  # below the rank's share of 64, so accumulation must rise
    assert result["plan"] == {"global_batch": 128, "world_size": 2, "micro_batch": 32, "accum_steps": 2}
    assert result["limit"] == "cpu-budget" and result["memory_budget"] == 75 << 20 and result["world_size"] == 2
    assert [t["micro_batch"] for t in result["trials"]][:6] == [1, 2, 4, 8, 16, 32]
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]  # written atomically
    assert search[1].read_text().splitlines() == ["plan: 2 ranks x 32 x 2 accumulation"]  # the global batch is kept
    assert err.splitlines()[-1] == (
        f"multigpu run: --find-batch: micro-batch {found} per rank fits on all 2 ranks (limit: cpu-budget, budget 75.0 MiB, "
        f"{len(result['trials'])} trials); plan: global batch 128 = 2 ranks x 32 x 2 accumulation; details: {run_dir / 'find_batch.json'}")

    err = ignore[2].read_text()
    assert ignore[0].returncode == 0, err  # the workers' code: the run itself succeeded
    assert not (_run_dir(err) / "find_batch.json").exists()
    assert ignore[1].read_text().splitlines() == ["plan: 2 ranks x 64 x 1 accumulation"]
    assert err.splitlines()[-1] == (
        "multigpu run: --find-batch: _find_batch_worker.py did not call mg.find_micro_batch (or mg.find_sequence_length), so "
        "nothing was searched; in the script, call it when mg.find_batch_requested() is true (docs/batch-size.md)")

    err = sequence[2].read_text()  # mg.find_sequence_length: 16 KiB per token against 75 MiB: 37 x 128 tokens
    assert sequence[0].returncode == 0, err
    result = json.loads((_run_dir(err) / "find_batch.json").read_text())
    assert result["sequence_length"] == 37 * 128 and sequence[1].read_text().splitlines()[0] == "longest: 4736", result
    assert err.splitlines()[-1] == (
        f"multigpu run: --find-batch: a sequence of 4736 tokens fits on all 2 ranks (limit: cpu-budget, budget 75.0 MiB, "
        f"{len(result['trials'])} trials); details: {_run_dir(err) / 'find_batch.json'}")

    assert bad[0].returncode == 2
    assert bad[2].read_text().splitlines() == [
        "multigpu run: error: --memory-budget must be a positive size like 512MB, 8GiB or a number of bytes, got '75 MiB'; "
        "use e.g. --memory-budget 8GiB"]
    assert not (tmp_path / "bad-logs").exists()


def test_the_raising_rank_is_named_in_the_real_race(tmp_path):
    # Not a fabricated failure list: 3 ranks, rank 1 raises while ranks 0 and 2 wait in an
    # all-reduce and then fail with gloo's lost-peer errors, often within the same second.
    # Both kinds at once (the load makes the race tighter); each summary must name rank 1.
    # benchmarks/blame.py runs it 20 times each and counts.
    race = Path(__file__).with_name("_race_worker.py")
    runs = [_start(["-n", "3", "--cpu", "--log-dir", str(tmp_path / "logs"), str(race), kind], tmp_path, kind)
            for kind in ("mg", "plain")]
    _wait_all([r[0] for r in runs])
    for proc, _, err_path in runs:
        err = err_path.read_text()
        [line] = _summary(err)
        assert proc.returncode == 1, err
        assert line.startswith(("multigpu run: rank 1 failed with exit code 1 on host",
                                "multigpu run: rank 1 failed (ValueError; the launcher stopped it while it was exiting)")), err
        run = _run_dir(err)
        rec = json.loads((run / "attempt_0" / "rank1.failure.json").read_text())
        assert rec["type"] == "ValueError" and rec["message"] == "boom from rank 1"


@pytest.mark.parametrize("ending", ["pass", "sys.exit(0)", "sys.exit(3)", "raise ValueError('late')"])
def test_worker_destroys_a_process_group_the_script_left_alive(ending, tmp_path, monkeypatch, capsys):
    # The gloo exit abort needs a group alive at interpreter exit (docs/launcher.md): worker.py
    # must destroy it however the script ends. In process, on a one-rank group.
    import torch.distributed as tdist

    from multigpu.launch import worker

    script = tmp_path / "s.py"
    script.write_text("import sys, torch.distributed as d\n"
                      "d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1)\n" + ending + "\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "rank0.error.json"))
    monkeypatch.setenv("RANK", "0")
    try:
        code = worker.main(["script", str(script)])
    except SystemExit as exit_:
        code = exit_.code
    assert not tdist.is_initialized()
    assert code == {"pass": 0, "sys.exit(0)": 0, "sys.exit(3)": 3, "raise ValueError('late')": 1}[ending]
    failure = tmp_path / "rank0.failure.json"
    assert failure.exists() == (code != 0)
    if ending.startswith("raise"):
        assert json.loads(failure.read_text())["type"] == "ValueError" and "ValueError: late" in capsys.readouterr().err
