"""What `multigpu run` concludes from a run, on real launches (CPU, gloo): a crash's cause quoted, a script
that never joins the job's process group refused, a usage error's exit 2 kept whichever rank the launcher stops.

Launches go through the launcher's in-process API (``launch.once.run_once``, what verify and tune call):
the launcher's own torch import is paid once per test process, not per launch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from multigpu.launch.once import run_once


def _launch(tmp_path: Path, name: str, body: str, nproc: int = 2, **env):
    script = tmp_path / f"{name}.py"
    script.write_text(body)
    return run_once(str(script), [], module=False, log_dir=tmp_path / name, nproc=nproc, cpu=True, env=env)


def _summary(done) -> str:
    [line] = [ln for ln in done.console.read_text().splitlines() if ln.startswith("multigpu run: rank ")]
    return line


# Rank 0 all-reduces 10 floats, rank 1 1000: gloo's pair on rank 0 gets more than it expects, throws from its
# own thread, and std::terminate aborts the process; faulthandler's dump follows in the log.
MISMATCH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(10 if dist.get_rank() == 0 else 1000)
dist.all_reduce(x)
"""


def test_a_crash_summary_quotes_the_cause_not_the_dump(tmp_path):
    done = _launch(tmp_path, "mismatch", MISMATCH)
    assert done.exit_code == 128 + 6, done.console.read_text()  # SIGABRT
    log = done.run_dir / "attempt_0" / "rank0.stderr.log"
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text and text.rstrip().splitlines()[-1].startswith("Extension modules:")
    cause = ("cause: gloo::EnforceNotMet: [enforce fail at ", "Received data size doesn't match expected size. "
             "Is there a distributed collective mismatch in your code?")
    line = _summary(done)
    assert line.startswith("multigpu run: rank 0 was killed by SIGABRT on host "), line
    assert cause[0] in line and line.endswith(cause[1]), line
    # verify and tune quote the launch through Launched.failure(): the same line.
    assert done.failure() == line


# DataParallel in every worker, no process group: each worker runs the whole job alone.
ALONE = """
import sys, torch
model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
torch.save(model(torch.ones(3, 4)), sys.argv[0] + ".out.pt")
"""


def test_workers_that_never_join_a_process_group_are_refused_unless_allowed(tmp_path):
    done = _launch(tmp_path, "alone", ALONE)
    assert done.exit_code == 2
    assert done.failure() == (
        "multigpu run: the 2 workers never joined a process group: each ran the whole script alone (2 copies of one "
        "job, not one job on 2 processes); call mg.init() or torch.distributed.init_process_group() in the script, "
        "run it with -n 1, or pass --allow-no-group if the workers are meant to run independently")
    for rank in (0, 1):
        record = json.loads((done.run_dir / "attempt_0" / f"rank{rank}.nogroup.json").read_text())
        assert record["world_size"] == 2 and record["largest_group"] == 0

    from multigpu.launch import run

    code = run(str(tmp_path / "alone.py"), nproc=2, cpu=True, log_dir=str(tmp_path / "allowed"), allow_no_group=True)
    assert code == 0


@pytest.mark.parametrize("made", [0, 1, 2])
def test_the_worker_records_a_script_that_never_joined(made, tmp_path, monkeypatch):
    # In process, as the launcher starts a worker of 2: the script makes no group, a 1-rank group of its own,
    # or the job's 2-rank group (torch's fake backend: no peer needed), each destroyed before the end. The
    # join is seen as it happens, so only the first two are recorded.
    import sys

    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    from multigpu.launch import worker

    script = tmp_path / "s.py"
    script.write_text("import torch.distributed as d\n"
                      "from torch.testing._internal.distributed.fake_pg import FakeStore\n" + (
                          f"d.init_process_group('fake', store=FakeStore(), rank=0, world_size={made})\n"
                          "d.destroy_process_group()\n" if made else ""))
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("TORCHELASTIC_ERROR_FILE", str(tmp_path / "rank0.error.json"))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert worker.main(["script", str(script)]) == 0
    assert not tdist.is_initialized()
    assert distributed_c10d._update_default_pg.__module__ == distributed_c10d.__name__  # the watch is undone
    record = tmp_path / "rank0.nogroup.json"
    if made == 2:
        assert not record.exists()
    else:
        assert json.loads(record.read_text()) == {"world_size": 2, "largest_group": made, "pid": os.getpid()}


# Rank 1 raises a UsageError first and is still exiting (an atexit handler) when rank 0's UsageError ends
# rank 0: torch's agent then stops rank 1 with SIGTERM. Its record names it, and its exit code must stay 2.
STOPPED_WHILE_EXITING = """
import atexit, os, time
from multigpu.errors import UsageError
from multigpu.runtime.contract import failure_path

rank = int(os.environ["RANK"])
attempt_dir = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])


def refuse():
    if rank == 1:
        atexit.register(time.sleep, 120)  # still exiting when the launcher stops it
        raise UsageError("--tp 3 does not divide 2 processes; use --tp 2")
    while not os.path.exists(failure_path(attempt_dir, 1)):  # rank 1's refusal is recorded: it raised first
        time.sleep(0.02)
    raise UsageError("--tp 3 does not divide 2 processes; use --tp 2")


if {in_init}:
    import multigpu as mg

    with mg.init(device="cpu"):
        refuse()
else:
    refuse()
"""


@pytest.mark.parametrize("where", ["mg.init", "plain"])
def test_a_usage_error_exits_2_when_its_rank_is_stopped_while_exiting(where, tmp_path):
    done = _launch(tmp_path, "refuse", STOPPED_WHILE_EXITING.replace("{in_init}", str(where == "mg.init")))
    line = _summary(done)
    assert done.exit_code == 2, line
    assert line.startswith("multigpu run: rank 1 failed (UsageError; the launcher stopped it while it was exiting)"), line
    assert line.endswith("; last line: multigpu: error: --tp 3 does not divide 2 processes; use --tp 2; "
                         "also failed: rank 0 (exit code 2)"), line
    assert "Traceback" not in (done.run_dir / "attempt_0" / "rank0.stderr.log").read_text()


# Every rank refuses inside mg.init, as the GPT recipe does for --tp 3 on 4 processes: the rank the
# launcher names is the one whose refusal was recorded first, often one it stopped while it was exiting.
EVERY_RANK_REFUSES = """
import multigpu as mg

with mg.init(device="cpu") as dist:
    raise mg.UsageError(f"mesh tp 3 does not divide world size {dist.world_size}; use --tp 1")
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_usage_errors_exit_2_in_the_real_race(tmp_path):
    # 12 real 3-rank launches, about 5.6 s each on 2 cores (the suite's budget: it was 20 until expert
    # parallelism's proofs joined the suite; 50 of 50 exited 2 when this was run 50 times). Before the records
    # kept the exit code, 3 of 16 such launches exited 1 (2 of 10 with 3 ranks, 1 of 6 with 4): 12 correct
    # launches in a row had an 8 % chance under that bug (20: 1.5 %).
    script = tmp_path / "refuse_everywhere.py"
    script.write_text(EVERY_RANK_REFUSES)
    codes, stopped, runs = {}, 0, 12
    for i in range(runs):
        done = run_once(str(script), [], module=False, log_dir=tmp_path / f"run{i}", nproc=3, cpu=True)
        codes.setdefault(done.exit_code, []).append(done.failure())
        stopped += "the launcher stopped it while it was exiting" in done.failure()
    print(f"{runs} launches: exit codes {sorted((c, len(v)) for c, v in codes.items())}; "
          f"{stopped} named a rank the launcher stopped while it was exiting")
    assert list(codes) == [2], {code: lines[:2] for code, lines in codes.items()}
