"""multigpu bench: nccl-tests' formulas, patterns, and real runs on 2 and 3 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from multigpu import UsageError
from multigpu.commbench import BenchConfig, DdpConfig, algbw, bus_factor, format_table, parse_sizes, run_bench
from multigpu.commbench.ddp import bucket_sizes, build_meta_model
from multigpu.commbench.measure import _Case, counts_for, pattern
from multigpu.commbench.spec import OPS, PLACES, parse_ops
from multigpu.runtime.values import parse_size

from _cli import run_cli


def test_busbw_factors_by_hand():
    # nccl-tests doc/PERFORMANCE.md: all_reduce 2(n-1)/n; all_gather, reduce_scatter, alltoall (n-1)/n; broadcast 1.
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_reduce", 1) == 0.0
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 0.875
    assert bus_factor("all_to_all", 3) == pytest.approx(2 / 3)
    assert bus_factor("broadcast", 16) == 1.0
    with pytest.raises(UsageError):
        bus_factor("gather", 2)


def test_algbw_is_decimal_and_sizes_are_binary():
    assert algbw(10**9, 1.0) == 1.0
    assert parse_size("256M") == 268435456
    # 256 MiB in 100 ms: 2.68435456 GB/s, not 2.5 (GiB would be wrong by 7.4 %).
    assert algbw(parse_size("256M"), 0.1) == pytest.approx(2.68435456)
    # 8 ranks all-reduce of 1 GiB in 10 ms: algbw 107.374 GB/s, busbw x 1.75 = 187.9 GB/s.
    a = algbw(2**30, 0.010)
    assert a == pytest.approx(107.3741824) and a * bus_factor("all_reduce", 8) == pytest.approx(187.9048192)


def test_parse_sizes_and_ops():
    s = parse_sizes("8:256M")
    assert s[0] == 8 and s[-1] == 256 * 2**20 and len(s) == 26 and all(b == 2 * a for a, b in zip(s, s[1:]))
    assert parse_sizes("1K,4M") == [1024, 4 * 2**20]
    assert parse_sizes("1G:1G") == [2**30]
    # One size parser for every flag (values.parse_size): KiB.. binary like K, KB.. decimal (SI).
    assert parse_sizes("1KiB,1KB,1MB,2MiB") == [1024, 1000, 10**6, 2 * 2**20]
    for bad in ("8:abc", "0", "-5", "64:8", "8..64", "", "1T"):
        with pytest.raises(UsageError):
            parse_sizes(bad)
    assert parse_ops(["allreduce,all-gather", "bcast"]) == ("all_reduce", "all_gather", "broadcast")
    assert parse_ops(None) == OPS
    with pytest.raises(UsageError):
        parse_ops(["all_reduce", "gather"])


def test_config_normalises_and_validates():
    cfg = BenchConfig(ops=("allreduce", "alltoall"), sizes=(8,), dtype="bf16")
    assert cfg.ops == ("all_reduce", "all_to_all") and cfg.dtype == "bf16"
    for bad in (dict(sizes=()), dict(sizes=(0,)), dict(iters=0), dict(dtype="fp8"), dict(ops=("gather",))):
        with pytest.raises(UsageError):
            BenchConfig(**bad)


def test_counts_follow_nccl_tests():
    # all_gather/reduce_scatter/all_to_all: count is the total, a multiple of the rank count.
    assert counts_for("all_gather", 1000, 4, 3) == 249
    assert counts_for("all_reduce", 1000, 4, 3) == 250
    assert counts_for("reduce_scatter", 8, 4, 3) == 3  # at least one element per rank


@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 16), (torch.float16, 64), (torch.int8, 8), (torch.uint8, 16)])
def test_patterns_sum_exactly(dtype, n):
    total = sum(pattern(r, 4096, n, dtype, "cpu").to(torch.float64) for r in range(n))
    assert torch.equal(total.to(dtype).to(torch.float64), total)  # no rounding, no overflow


@pytest.mark.parametrize("op", OPS)
def test_wrong_counter_catches_a_missing_collective(op):
    # Without the collective, a rank's buffer holds its own input: the check must flag it.
    for place in PLACES[op]:
        case = _Case(op, place, 12, rank=1, n=3, dtype=torch.float32, device=torch.device("cpu"))
        assert case.wrong() > 0, (op, place)


def test_bench_cli_json_on_two_gloo_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "multigpu", "bench", "-n", "2", "--ops", "all_reduce", "all_gather",
                           "--sizes", "1K:8K", "--iters", "5", "--warmup", "2", "--dtype", "bf16", "--json"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["wrong"] == 0
    fp = result["fingerprint"]  # mg.fingerprint's, as the step meter's header
    assert {"torch", "git", "hostname", "python", "cpus", "devices"} <= set(fp)
    assert (fp["world_size"], fp["backend"]) == (2, "gloo")
    rows = result["rows"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in ("all_reduce", "all_gather") for s in (1024, 2048, 4096, 8192)]
    for r in rows:
        # nccl-tests: size is the total bytes, count the elements per rank for all_gather.
        assert r["type"] == "bfloat16" and r["count"] * 2 * (2 if r["op"] == "all_gather" else 1) == r["size"]
        for place in PLACES[r["op"]]:
            p = r[place]
            assert p["wrong"] == 0 and p["time_us"] > 0
            assert p["algbw"] == pytest.approx(r["size"] / (p["time_us"] * 1e-6) / 1e9)
            assert p["busbw"] == pytest.approx(p["algbw"] * bus_factor(r["op"], 2))
    assert r["out"] is not None and rows[0]["out"] is None  # all_reduce is in place by torch's API
    avg = sum(p["busbw"] for r in rows if r["op"] == "all_gather" for p in (r["out"], r["in"])) / 8
    assert result["avg_busbw"]["all_gather"] == pytest.approx(avg)


def test_bench_all_ops_on_three_gloo_ranks_with_ddp_step():
    cfg = BenchConfig(ops=OPS, sizes=(8, 1000, 65536), dtype="float32", warmup=1, iters=3)
    result = run_bench(cfg, nproc=3, ddp=DdpConfig(model="gpt2-tiny", bucket_cap_mb=0.25, warmup=1, iters=2), timeout=120)
    assert result["world_size"] == 3 and result["wrong"] == 0
    done = [r for r in result["rows"] if not r.get("unsupported")]
    assert {r["op"] for r in done} == set(OPS)  # gloo runs all five
    for r in done:
        assert r["size"] == r["count"] * 4 * (1 if r["op"] in ("all_reduce", "broadcast") else 3)
        for place in ("out", "in"):
            assert (r[place] is not None) == (place in PLACES[r["op"]])
            if r[place]:
                assert r[place]["wrong"] == 0
    d = result["ddp"]
    assert d["gradient_bytes"] == sum(d["buckets"]) == 4 * sum(p.numel() for p in build_meta_model("gpt2-tiny").parameters())
    assert d["comm_ms_per_step"] > 0 and d["busbw"] == pytest.approx(d["algbw"] * 4 / 3)
    table = format_table(result)
    assert "# Out of bounds values : 0 OK" in table and table.count("# Avg bus bandwidth") == 5
    assert "DDP-shaped step: gpt2-tiny" in table


def test_groups_of_ranks_each_run_the_collective_at_once():
    """--group-size: 4 ranks as 2 groups of 2, each group its own collective (a mesh dimension inside a bigger
    job): every result is checked against the group's own sum or gather, sizes and bus factors are the group's."""
    cfg = BenchConfig(ops=OPS, sizes=(8, 1000), dtype="float32", warmup=1, iters=2, group=2)
    result = run_bench(cfg, nproc=4, timeout=120)
    assert result["world_size"] == 4 and result["group_size"] == 2 and result["wrong"] == 0
    done = [r for r in result["rows"] if not r.get("unsupported")]
    assert {r["op"] for r in done} == set(OPS)
    for r in done:
        assert r["size"] == r["count"] * 4 * (1 if r["op"] in ("all_reduce", "broadcast") else 2)
        for place in PLACES[r["op"]]:
            assert r[place]["wrong"] == 0 and r[place]["busbw"] == pytest.approx(r[place]["algbw"] * bus_factor(r["op"], 2))
    assert "4 ranks in groups of 2, every group at once" in format_table(result)


def _ddp_buckets(dist):
    """Real DDP's buckets after its rebuild (at the third forward), to compare with our prediction."""
    from multigpu.commbench.ddp import MODELS

    model = torch.nn.parallel.DistributedDataParallel(MODELS["gpt2-tiny"](), bucket_cap_mb=0.25)
    for _ in range(3):
        model(torch.randint(0, 1000, (2, 16))).float().pow(2).mean().backward()
    return [int(s) for s in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]


def test_bucket_prediction_matches_ddp():
    from multigpu.testing import spawn

    real = spawn(_ddp_buckets, 2)[0]
    ours = bucket_sizes(build_meta_model("gpt2-tiny"), 0.25)
    # DDP rebuilds in the order gradients actually arrive; we use reverse definition order:
    # same number of buckets, same bytes, each bucket within 2 %.
    assert len(ours) == len(real) and sum(ours) == sum(real)
    for a, b in zip(sorted(ours), sorted(real)):
        assert abs(a - b) / b < 0.02
    big = bucket_sizes(build_meta_model("gpt2-small"))
    assert len(big) > 10 and big[0] <= 2**20 + 4 * 768 * 3072 and max(big) <= 25 * 2**20 + 4 * 50257 * 768


@pytest.mark.parametrize("argv", [["bench", "--sizes", "8:abc"], ["bench", "--ops", "gather"], ["bench", "--dtype", "float8"],
                                  ["bench", "-n", "0"], ["bench", "--iters", "0"], ["bench", "--ddp", "nosuch"],
                                  ["bench", "--ddp", "os:nothing_here"], ["bench", "-n", "3", "--group-size", "2"],
                                  ["bench", "-n", "2", "--group-size", "0"]])
def test_bench_usage_errors(argv, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.gpu
def test_bench_on_gpus():
    n = torch.cuda.device_count()
    result = run_bench(BenchConfig(ops=OPS, sizes=(1024, 2**20, 64 * 2**20), iters=5), nproc=n)
    assert result["backend"] == "nccl" and result["wrong"] == 0
