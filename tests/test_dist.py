import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.dist import slurm_first_host
from multigpu.testing import spawn


def _ranks_and_sum(dist):
    t = torch.tensor([float(dist.rank + 1)])
    tdist.all_reduce(t)
    same_init = torch.randn(3)  # seeded identically on every rank
    # Exact dataset-level metrics from uneven eval shards (10 samples on 3 ranks).
    values = TensorDataset(torch.arange(10.0))
    local = {"sum": 0.0, "count": 0}
    for (x,) in mg.eval_loader(values, dist, batch_size=2):
        local["sum"] += x.sum().item()
        local["count"] += len(x)
    totals = mg.all_reduce_sum(local)
    return dist.rank, dist.world_size, dist.backend, str(dist.device), dist.is_main, t.item(), same_init, totals


def test_init_on_real_ranks_seeds_alike_and_reduces():
    out = spawn(_ranks_and_sum, 3)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1:4] == (3, "gloo", "cpu") for o in out)
    assert [o[4] for o in out] == [True, False, False]
    assert all(o[5] == 6.0 for o in out)
    assert all(torch.equal(o[6], out[0][6]) for o in out)
    assert all(o[7] == {"sum": 45.0, "count": 10.0} for o in out)


def _one_rank_raises(dist):
    if dist.rank == 1:
        raise ValueError("planted on rank 1")
    tdist.barrier()  # rank 0 waits for rank 1, which has gone: its error is a consequence


def test_spawn_reports_the_rank_that_failed_first_and_what_the_others_saw():
    """A rank that skips a collective leaves the others failing with a gloo read error; the cause is the
    first failure in, wherever its rank, so it leads, and every rank's traceback follows it."""
    with pytest.raises(RuntimeError) as err:
        spawn(_one_rank_raises, 2, timeout=60)
    text = str(err.value)
    assert text.startswith("rank 1 failed:\n") and "ValueError: planted on rank 1" in text.split("--- rank 0 too:")[0]
    assert "--- rank 0 too:" in text


def test_single_process_has_a_process_group_and_tears_it_down(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with mg.init(seed=1) as dist:
        assert (dist.rank, dist.world_size, dist.is_main) == (0, 1, True)
        assert tdist.is_initialized()
        t = torch.ones(2)
        tdist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    assert not tdist.is_initialized()


def test_process_group_destroyed_on_exception(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(KeyError):
        with mg.init():
            raise KeyError("boom")
    assert not tdist.is_initialized()


def test_usage_error_inside_init_is_one_line_and_exit_2(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import multigpu as mg\n"
        "with mg.init() as dist:\n"
        "    mg.BatchPlan(global_batch=10, world_size=3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "global batch 10 does not split over world_size 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_backend_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        with mg.init(backend="nccl" if not torch.cuda.is_available() else "bogus"):
            pass
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "nodelist, first",
    [("node01", "node01"), ("gpu[03-05,07],cpu1", "gpu03"), ("a1,a2", "a1"), ("rack[1-2]-n[01-04]", "rack1-n01")],
)
def test_slurm_first_host(nodelist, first):
    assert slurm_first_host(nodelist) == first
