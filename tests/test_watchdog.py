"""Hang reports: the verdict from per-rank status files, and a real hang on 3 ranks."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from multigpu.launch.hang import hang_verdict, last_collective
from multigpu.meter.profile import parse_steps
from multigpu.meter.watchdog import flight_recorder_env, read_status
from multigpu.runtime.contract import worker_env

HERE = os.path.dirname(os.path.abspath(__file__))


def write_status(d, rank, **kw):
    os.makedirs(d / "watchdog", exist_ok=True)
    s = {"rank": rank, "host": "a" if rank < 2 else "b", "last_step": 1580, "stalled_s": 300.4, "function": "?",
         "file": "/x/train.py", "line": 40, "collective": None, "in_backward": False,
         "stacks": str(d / "watchdog" / f"rank{rank}.stacks.txt")} | kw
    (d / "watchdog" / f"rank{rank}.json").write_text(json.dumps(s))


def test_verdict_names_the_rank_outside_the_collective(tmp_path):
    write_status(tmp_path, 1, function="DataLoader.__next__", line=12, last_step=1579)
    for r in (0, 2, 3):
        write_status(tmp_path, r, function="all_reduce", collective="all_reduce")
    v = hang_verdict(str(tmp_path), world_size=4)
    assert v.startswith("rank 1 (host a) has been in DataLoader.__next__ (train.py:12) for 300 s, after step 1579; "
                        "ranks 0,2,3 are waiting in all_reduce after step 1580")
    assert "rank1.stacks.txt" in v


def test_verdict_when_everyone_waits_and_one_is_behind(tmp_path):
    # Rank 2 skipped a step: it waits in a collective its peers already left (a mismatch).
    for r in (0, 1):
        write_status(tmp_path, r, collective="all_reduce", last_step=10)
    write_status(tmp_path, 2, collective="broadcast", last_step=9)
    v = hang_verdict(str(tmp_path), world_size=4)
    assert v.startswith("rank 2 (host b) has been in broadcast (train.py:40) for 300 s, after step 9; "
                        "ranks 0,1 are waiting in all_reduce after step 10; rank 3 wrote no report")


def test_verdict_counts_ddp_backward_as_waiting_and_reads_the_flight_recorder(tmp_path):
    trace = tmp_path / "watchdog" / "nccl_trace_rank_0"
    write_status(tmp_path, 0, in_backward=True, function="_engine_run_backward", nccl_trace=str(trace))
    write_status(tmp_path, 1, function="slow_step", line=7)
    trace.write_bytes(pickle.dumps({"version": "2.4", "entries": [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 1580, "state": "completed"},
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 1581, "state": "started"}]}))
    assert last_collective(str(trace)) == "nccl:all_reduce #1581 (started)"
    v = hang_verdict(str(tmp_path), world_size=2)
    assert v.startswith("rank 1 (host a) has been in slow_step (train.py:7)")
    assert "rank 0 is waiting in backward (gradient all-reduce) after step 1580" in v
    assert "nccl_trace_rank_*" in v and "#1581 (started)" in v
    assert hang_verdict(str(tmp_path / "nothing")) is None


def test_worker_env_carries_run_dir_profile_and_flight_recorder():
    env = flight_recorder_env("/runs/x")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/x/watchdog/nccl_trace_rank_"
    # The launcher's two halves (launch/start.py): the contract's variables, the recorder's on GPU.
    assert worker_env("/runs/x", profile=parse_steps("10:15")) == {"MULTIGPU_RUN_DIR": "/runs/x", "MULTIGPU_PROFILE": "10:15"}
    with pytest.raises(Exception, match="START:STOP"):
        parse_steps("ten")  # a bad --profile fails in the launcher, before any worker starts


def test_real_hang_under_multigpu_run_gives_the_verdict_and_the_profile_and_hang_timeout_ends_it(tmp_path):
    """`multigpu run -n 3 --cpu --profile 1:3 --hang-timeout 2`: rank 1 stops in step 3, the others wait in
    all_reduce; the verdict stops the workers and, with no restart left, is the summary (exit 124)."""
    err_path = tmp_path / "launcher.stderr"
    out_path = tmp_path / "launcher.stdout"
    t_start = time.time()
    launcher = subprocess.run(
        [sys.executable, "-m", "multigpu", "run", "-n", "3", "--cpu", "--log-dir", str(tmp_path / "logs"),
         "--profile", "1:3", "--hang-timeout", "2", os.path.join(HERE, "_hang_worker.py"), "1", "3"],
        cwd=tmp_path, stdout=out_path.open("w"), stderr=err_path.open("w"), timeout=180)
    t_verdict = time.time()
    err = err_path.read_text()
    verdict = next((ln for ln in err.splitlines() if ln.startswith("multigpu run: hang: ")), None)
    assert verdict and launcher.returncode == 124, err
    assert err.splitlines()[-1] == f"{verdict}; stopped after --hang-timeout 2 s"
    assert "multigpu run: --hang-timeout 2 s: stopped this node's 3 workers" in err
    line = next(i for i, l in enumerate(open(os.path.join(HERE, "_hang_worker.py")), 1) if "time.sleep(600)" in l)
    run_dir = next(ln for ln in err.splitlines() if "; logs: " in ln).rsplit("; logs: ", 1)[1].strip()
    status = read_status(os.path.join(run_dir, "watchdog", "hang1"))  # set aside when the workers were stopped
    assert verdict.startswith(f"multigpu run: hang: rank 1 (host {status[1]['host']}) has been in slow_step "
                              f"(_hang_worker.py:{line}) for "), verdict
    assert "after step 2; ranks 0,2 are waiting in all_reduce after step 2" in verdict
    assert "slow_step" in open(os.path.join(run_dir, "watchdog", "hang1", "rank1.stacks.txt")).read()
    assert f"MULTIGPU_RUN_DIR: unset -> '{run_dir}'" in err  # the channel to the workers is logged
    # --profile reached every worker's meter: steps 1..2 profiled before the hang, table on rank 0's console.
    summaries = json.loads(open(os.path.join(run_dir, "profile", "summary.json")).read())
    assert [s["steps"] for s in summaries] == [2, 2, 2]
    assert "profile of steps 1..2" in out_path.read_text()
    assert json.loads(open(os.path.join(run_dir, "metrics.jsonl")).readline())["fingerprint"]["world_size"] == 3
    hang_start = min(s["time"] - s["stalled_s"] for s in status.values())
    print(f"\njob ended {t_verdict - hang_start:.1f} s after the hang began (--hang-timeout 2 s), "
          f"{t_verdict - t_start:.1f} s after launch: {verdict}")


def test_watchdog_reports_a_stall_and_withdraws_it_when_steps_resume(tmp_path):
    from multigpu.meter.watchdog import Watchdog

    wd = Watchdog(str(tmp_path / "watchdog"), rank=0, host="h", timeout=0.3, poll=0.05).start()
    try:
        wd.beat(0)
        report = str(tmp_path / "watchdog" / "rank0.json")
        deadline = time.monotonic() + 20  # the report comes after 0.3 s, later on a busy machine
        # Only C calls while waiting, so the reported frame is this function's own line.
        while not os.access(report, os.F_OK) and time.monotonic() < deadline:
            time.sleep(0.05)
        st = read_status(str(tmp_path))
        assert st[0]["last_step"] == 0 and st[0]["stalled_s"] >= 0.3
        assert st[0]["function"] == "test_watchdog_reports_a_stall_and_withdraws_it_when_steps_resume"
        line = open(os.path.join(HERE, "test_watchdog.py")).read().splitlines()[st[0]["line"] - 1]
        assert "time.sleep(0.05)" in line or "os.access" in line, line
        wd.beat(1)
        assert read_status(str(tmp_path)) == {}
    finally:
        wd.stop()


def test_a_report_written_while_the_stall_ends_is_withdrawn(tmp_path):
    from multigpu.meter.watchdog import Watchdog

    wd = Watchdog(str(tmp_path / "watchdog"), rank=0, host="h", timeout=1000)
    os.makedirs(wd.out_dir)
    wd.beat(0)
    stalled_since = wd._last_beat
    wd.beat(1)  # a step completes while the watchdog thread is still writing its report
    wd.dump(5.0, beat_at=stalled_since)
    assert read_status(str(tmp_path)) == {}
    wd.dump(5.0, beat_at=wd._last_beat)  # a real stall stays reported
    assert read_status(str(tmp_path))[0]["last_step"] == 1
