"""mg.stream_loader: the same global batches on any world size and worker count, resumes, refusals; and every
source (token shards, Hugging Face datasets, tars, JSON lines, lists) on real gloo ranks, killed and resumed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu.data.sources import RawStream, stream_shards
from multigpu.testing import spawn

import _data_sources as src
import _stream_train

SHARDS = [list(range(s * 1000, s * 1000 + n)) for s, n in enumerate((37, 50, 13, 64, 29))]  # 193 records


def _dist(rank, world):
    return mg.Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                   device=torch.device("cpu"), backend="gloo")


def _global(world, micro=None, workers=0, epochs=2, state=None, source=SHARDS, buffer=16, transform=None):
    plan = mg.BatchPlan(12, world, micro_batch=micro)
    lds = [mg.stream_loader(source, plan, _dist(r, world), seed=3, buffer=buffer, num_workers=workers,
                            transform=transform) for r in range(world)]
    for ld in lds:
        if state:
            ld.load_state_dict(state)
    out = []
    for _ in range(epochs):
        per = [[torch.cat(list(mbs)).tolist() for mbs in ld] for ld in lds]
        out.append([sum((p[s] for p in per), []) for s in range(len(per[0]))])
    return out, lds


@pytest.fixture(scope="module")
def reference():
    return _global(1)[0]


def test_the_same_global_batches_on_1_to_4_ranks_any_accumulation_and_0_or_2_workers(reference):
    seen = [i for b in reference[0] for i in b]
    assert len(seen) == len(set(seen)) == 192 and len(reference[0]) == 16  # 193 // 12 steps, remainder dropped
    assert reference[0] != reference[1]  # reshuffled every epoch, no set_epoch
    for world, micro, workers in [(2, None, 0), (2, 3, 2), (3, 2, 0), (4, 1, 2), (4, 3, 0)]:
        assert _global(world, micro, workers)[0] == reference, (world, micro, workers)


def test_resume_mid_epoch_on_another_world_size_and_worker_count(reference):
    two = [mg.stream_loader(SHARDS, mg.BatchPlan(12, 2), _dist(r, 2), seed=3, buffer=16) for r in range(2)]
    for ld in two:
        for i, _ in enumerate(ld):
            if i == 6:
                break
    state = two[0].state_dict()
    assert (state["epoch"], state["batch_index"], state["records"]) == (0, 7, None) or state["batch_index"] == 7
    rest, lds = _global(4, micro=1, workers=2, state=state)
    assert rest[0] + rest[1] == reference[0][7:] + reference[1]
    assert lds[0].state_dict()["records"] == 193 and len(lds[0]) == 16


def test_transform_runs_on_this_ranks_samples_only():
    calls = []

    def tag(x):
        calls.append(x)
        return x

    (batches,), lds = _global(3, epochs=1, transform=tag)
    assert len(calls) == 16 * 12  # each of 3 ranks transformed its third of every global batch, nothing else
    assert sorted(calls) == sorted(i for b in batches for i in b)


def test_a_resume_skips_shards_of_known_length_unread():
    opened = []

    def shard(n):
        def records():
            opened.append(n)
            return iter(range(n * 100, n * 100 + n))
        return records

    shards, _ = stream_shards([list(range(10)), shard(5), list(range(20, 27))])
    raw = RawStream(shards, [0, 2, 1], skip=14)
    assert list(raw) == [24, 25, 26, 500, 501, 502, 503, 504] and raw.skipped == 14 and opened == [5]
    raw = RawStream(shards, [1, 0, 2], skip=7)  # unknown length: read and dropped, not transformed
    assert list(raw) == list(range(2, 10)) + list(range(20, 27)) and raw.skipped == 7


@pytest.mark.parametrize("world, workers", [(1, 0), (3, 2), (4, 0)])
def test_eval_shards_cover_the_stream_exactly_once(world, workers):
    seen = []
    for r in range(world):
        for batch in mg.stream_eval_loader(SHARDS, _dist(r, world), batch_size=5, num_workers=workers):
            assert len(batch) <= 5
            seen += batch.tolist()
    assert sorted(seen) == sorted(i for s in SHARDS for i in s)


def test_model_parallel_peers_read_the_same_samples(reference):
    shares = []
    for dp in range(2):
        peers = [[torch.cat(list(mbs)).tolist() for mbs in mg.stream_loader(
            SHARDS, mg.BatchPlan(12, 2, micro_batch=3, dp_rank=dp), _dist(2 * dp + p, 4), seed=3, buffer=16)]
            for p in range(2)]
        assert peers[0] == peers[1]
        shares.append(peers[0])
    assert [a + b for a, b in zip(*shares)] == reference[0]


def test_tar_and_jsonl_shards(tmp_path):
    root = src.write_sources(tmp_path)
    ld = mg.stream_loader(root / "tars", mg.BatchPlan(8, 1), _dist(0, 1), transform=src.decode, buffer=16)
    mb = next(iter(ld))[0]
    assert mb["x"].shape == (8, 3) and torch.equal(mb["x"][:, 0].long(), mb["id"]) and mb["cls"].tolist() == [
        i % 5 for i in mb["id"].tolist()]
    assert ld.state_dict()["source"]["shards"][0] == ["shard-000.tar", (root / "tars" / "shard-000.tar").stat().st_size]
    rows = [r for mbs in mg.stream_loader([root / "rows.jsonl"], mg.BatchPlan(10, 1), _dist(0, 1), shuffle=False)
            for r in mbs]
    assert rows[0]["id"].tolist() == list(range(10)) and rows[0]["text"][3] == "xxx"


def test_bad_streams_are_refused_in_one_line(tmp_path):
    plan = mg.BatchPlan(12, 1)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "e.jsonl").write_text("")
    cases = [
        ((x for x in range(3)), "the stream source is an iterator (generator): it can be read once"),
        ([], "the stream source has no shards"),
        ([{"a": 1}], "stream shard 0 is a dict; a shard is a .tar/.jsonl path"),
        ([str(tmp_path / "a.txt")], "a.txt is neither a .tar (WebDataset) nor a .jsonl file"),
        (str(tmp_path / "missing.tar"), "missing.tar does not exist"),
        ([[]], "the stream is empty: its 1 shard(s) gave no record"),
        ([list(range(5))], "the stream has 5 records but one global batch is 12; use a global batch of at most 5"),
    ]
    for source, line in cases:
        with pytest.raises(mg.UsageError) as err:
            mg.stream_loader(source, plan, _dist(0, 1))
        assert line in str(err.value) and "\n" not in str(err.value), (line, str(err.value))
    # Lengths unknown until read: refused at the end of the first pass, in the main process, in one line.
    for source, line in (([str(tmp_path / "e.jsonl")], "the stream is empty"),
                         ([lambda: iter(range(5))], "the stream has 5 records but one global batch is 12")):
        with pytest.raises(mg.UsageError, match=line):
            list(mg.stream_loader(source, plan, _dist(0, 1), num_workers=1))
    for kwargs, line in (({"persistent_workers": True}, "drop persistent_workers=True"),
                         ({"in_order": False}, "drop in_order=False"),
                         ({"batch_size": 4}, "sets batch_size from the batch plan"),
                         ({"buffer": 0}, "buffer must be a positive integer, got 0")):
        with pytest.raises(mg.UsageError, match=line):
            mg.stream_loader(SHARDS, plan, _dist(0, 1), **kwargs)


def test_a_resume_over_a_changed_stream_is_refused():
    ld = mg.stream_loader(SHARDS, mg.BatchPlan(12, 1), _dist(0, 1), seed=3, buffer=16)
    next(iter(ld))
    state = ld.state_dict()
    other = SHARDS[:4] + [list(range(30))]
    with pytest.raises(mg.UsageError) as err:
        mg.stream_loader(other, mg.BatchPlan(12, 1), _dist(0, 1), seed=3, buffer=16).load_state_dict(state)
    assert str(err.value).startswith('the saved loader position is for other data (source.shards[4][1] was 29, is 30)')
    with pytest.raises(mg.UsageError, match="has buffer=16 but this loader has buffer=32"):
        mg.stream_loader(SHARDS, mg.BatchPlan(12, 1), _dist(0, 1), seed=3, buffer=32).load_state_dict(state)
    # A source of unknown length that gives another count than the saved one is caught when its pass ends.
    unknown = mg.stream_loader([lambda: iter(range(100))], mg.BatchPlan(12, 1), _dist(0, 1), buffer=16)
    unknown.load_state_dict(dict(unknown.state_dict(), records=120, batch_index=3))
    with pytest.raises(mg.UsageError, match="the stream gave 100 records in epoch 0 but 120 were counted before"):
        list(unknown)


# --- real ranks: every source, 1 / 2 / 4 ranks x 0 / 2 workers -------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return src.write_sources(tmp_path_factory.mktemp("sources"))


def _joined(per_rank: list[dict], key) -> list[list]:
    steps = per_rank[0][key]
    return [sum((r[key][s] for r in per_rank), []) for s in range(len(steps))]


def test_every_source_gives_the_same_global_batches_on_1_2_4_gloo_ranks_and_0_2_workers(root):
    one = {k: src.rank_steps(k, src.make_loader(k, root, mg.BatchPlan(12, 1), _dist(0, 1))) for k in src.KINDS}
    for world, micro in ((2, 3), (4, None)):
        per_rank = spawn(src.spawned_global_batches, world, str(root), 12, micro, src.KINDS, timeout=240, children=True)
        for kind in src.KINDS:
            assert len(one[kind]) >= 5, kind
            for workers in (0, 2):
                assert _joined(per_rank, (kind, workers)) == one[kind], (kind, world, workers)


def _launch(n, root, out, steps, kill_at=None):
    cmd = [sys.executable, "-m", "multigpu", "run", "-n", str(n), "--cpu", "--log-dir", str(out / f"logs-{n}"),
           _stream_train.__file__, str(root), str(out), "--steps", str(steps)]
    cmd += ["--kill-at", str(kill_at)] if kill_at is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _logged(out, world):
    logs = [[json.loads(line) for line in (out / f"log-{world}-{r}.jsonl").read_text().splitlines()]
            for r in range(world)]
    steps = [rec["step"] for rec in logs[0]]
    return steps, [{k: sum((logs[r][i]["ids"][k] for r in range(world)), []) for k in _stream_train.KINDS}
                   for i in range(len(steps))]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_on_another_world_size_continues_the_same_batches(root, tmp_path):
    steps, kill_at = 16, 4  # the tars have 103 // 12 = 8 steps an epoch: killed in the first, resumed into the second
    ref_loaders = _stream_train.loaders(root, _dist(0, 1))
    streams = {k: _stream_train.forever(ld) for k, ld in ref_loaders.items()}
    reference = [json.loads(json.dumps(_stream_train.step_ids({k: next(s) for k, s in streams.items()})))
                 for _ in range(steps)]
    killed = _launch(2, root, tmp_path, steps, kill_at=kill_at)
    assert killed.returncode != 0 and "rank 0 was killed by SIGKILL" in killed.stderr, killed.stderr[-2000:]
    assert len((tmp_path / "log-2-0.jsonl").read_text().splitlines()) == kill_at + 1
    resumed = _launch(4, root, tmp_path, steps)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert f"step {kill_at}, written by 2 ranks, now 4); continuing at step {kill_at + 1}" in output, output[-2000:]
    done, batches = _logged(tmp_path, 4)
    assert done == list(range(kill_at + 1, steps))
    assert batches == reference[kill_at + 1:]
