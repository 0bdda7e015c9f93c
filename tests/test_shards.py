"""Token shards and Hugging Face datasets through mg.loader: formats, the world-size-invariant order, refusals."""

import pickle

import numpy as np
import pytest
import torch

import multigpu as mg
from multigpu.data.loader import source_fingerprint

import _data_sources as src


def _dist(rank, world):
    return mg.Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                   device=torch.device("cpu"), backend="gloo")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return src.write_sources(tmp_path_factory.mktemp("sources"))


def _header(count, magic=20240520, version=1):
    h = np.zeros(256, np.int32)
    h[:3] = (magic, version, count)
    return h.tobytes()


def test_raw_headered_and_npy_shards_give_windows_that_never_cross_a_shard(root):
    ts = mg.TokenShards(root / "tokens", block_size=8)
    raw = np.fromfile(root / "tokens" / "a_train.bin", dtype=np.uint16)
    headered = np.fromfile(root / "tokens" / "b_train.bin", dtype=np.uint16, offset=1024)
    npy = np.load(root / "tokens" / "c_train.npy")
    assert [s.count for s in ts.shards] == [400, 300, 250] and ts.dtype == "uint16"
    assert len(ts) == 399 // 8 + 299 // 8 + 249 // 8
    for i, (tokens, first) in enumerate(((raw, 0), (headered, 399 // 8), (npy, 399 // 8 + 299 // 8))):
        x, y = ts[first]
        assert x.tolist() == tokens[:8].tolist() and y.tolist() == tokens[1:9].tolist() and x.dtype == torch.int64
        assert ts.locate(first) == (i, 0)
    x, y = ts[399 // 8 - 1]  # the last window of the first shard ends inside it
    assert y.tolist() == raw[49 * 8 - 7: 49 * 8 + 1].tolist()
    xs, ys = ts.read_batch([0, 49, len(ts) - 1])
    assert xs.shape == (3, 8) and torch.equal(xs[1], ts[49][0]) and torch.equal(ys[2], ts[len(ts) - 1][1])
    # The pickle (what a DataLoader worker receives) holds names and counts, not tokens or mappings.
    ts[0]
    assert len(pickle.dumps(ts)) < 2000


def test_uint32_and_llama3_headers_and_a_glob(tmp_path):
    big = np.arange(70000, 70000 + 100, dtype=np.uint32)
    big.tofile(tmp_path / "p_0.bin")
    (tmp_path / "p_1.bin").write_bytes(_header(50, magic=20240801, version=7) + big[:50].tobytes())
    ts = mg.TokenShards(str(tmp_path / "p_*.bin"), block_size=4, dtype="uint32")
    assert ts.dtype == "uint32" and ts[0][0].tolist() == [70000, 70001, 70002, 70003]
    assert len(ts) == 99 // 4 + 49 // 4


def test_token_shards_order_equals_on_1_2_4_ranks_with_0_and_2_workers_in_process(root):
    ts = mg.TokenShards(root / "tokens", block_size=8)

    def batches(world, workers):
        plan = mg.BatchPlan(12, world)
        per = [src.rank_steps("tokens", mg.loader(ts, plan, _dist(r, world), seed=2, num_workers=workers))
               for r in range(world)]
        return [sum((p[s] for p in per), []) for s in range(len(per[0]))]

    reference = batches(1, 0)
    assert len(reference) == len(ts) // 12 and len({w for b in reference for w in b}) == 12 * len(reference)
    assert batches(2, 2) == reference and batches(4, 0) == reference


def _bad(tmp_path, name, data):
    d = tmp_path / name
    d.mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "ok.bin")
    (d / "bad.bin" if not name.endswith("npy") else d / "bad.npy").write_bytes(data)
    return d


@pytest.mark.parametrize("case, line", [
    ("truncated", "bad.bin is truncated: its header promises 100 tokens (1,224 bytes) but it has 1,124 bytes"),
    ("ragged", "bad.bin has 301 bytes, not a whole number of uint16 tokens (2 bytes each); it is truncated"),
    ("mixed", "token shards mix dtypes (uint16, uint32): ok.bin holds uint16 but bad.bin holds uint32"),
    ("empty", "bad.bin is empty (0 bytes)"),
    ("short_npy", "bad.npy is truncated or not a .npy array"),
    ("version", "has llm.c's magic but version 3 (expected 1, uint16)"),
])
def test_bad_shards_are_refused_in_one_line(tmp_path, case, line):
    data = {"truncated": _header(100) + b"\0" * 100, "ragged": b"\0" * 301,
            "mixed": _header(10, magic=20240801, version=7) + b"\0" * 40, "empty": b"",
            "short_npy": np.lib.format.magic(1, 0) + b"{'descr': '<u2', 'fortran_order': False, 'shape': (50,), }"
                         + b" " * 60 + b"\n" + b"\0" * 10,
            "version": _header(10, version=3) + b"\0" * 20}[case]
    with pytest.raises(mg.UsageError) as err:
        mg.TokenShards(_bad(tmp_path, case + ("_npy" if case.endswith("npy") else ""), data), block_size=8)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_empty_sources_and_a_global_batch_larger_than_the_data_are_refused(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(mg.UsageError, match="holds no .bin or .npy token shards"):
        mg.TokenShards(tmp_path / "none", 8)
    with pytest.raises(mg.UsageError, match="no file matches"):
        mg.TokenShards(str(tmp_path / "x_*.bin"), 8)
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "tiny.bin")
    with pytest.raises(mg.UsageError, match=r"hold no window of 9 tokens \(the longest of 1 has 5\)"):
        mg.TokenShards(tmp_path / "tiny.bin", 8)
    np.arange(90, dtype=np.uint16).tofile(tmp_path / "small.bin")
    with pytest.raises(mg.UsageError, match="the dataset has 11 samples but one global batch is 16"):
        mg.loader(mg.TokenShards(tmp_path / "small.bin", 8), mg.BatchPlan(16, 1), _dist(0, 1))
    with pytest.raises(mg.UsageError, match="holds uint16 tokens but dtype=uint32 was asked for"):
        (tmp_path / "h.bin").write_bytes(_header(20) + b"\0" * 40)
        mg.TokenShards(tmp_path / "h.bin", 8, dtype="uint32")
    with pytest.raises(mg.UsageError, match="holds token id 89 but the model's vocabulary is 50"):
        mg.TokenShards(tmp_path / "small.bin", 8, vocab_size=50)


def test_a_resume_over_changed_shards_is_refused_in_one_line(tmp_path):
    for name in ("s0.bin", "s1.bin"):
        np.arange(200, dtype=np.uint16).tofile(tmp_path / name)
    train = mg.loader(mg.TokenShards(tmp_path, 8), mg.BatchPlan(4, 1), _dist(0, 1))
    next(iter(train))
    state = train.state_dict()
    assert state["source"]["shards"] == [["s0.bin", 400], ["s1.bin", 400]]
    mg.loader(mg.TokenShards(tmp_path, 8), mg.BatchPlan(4, 2), _dist(1, 2)).load_state_dict(state)  # same data
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "s1.bin")  # same count of windows? no: fewer tokens
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "s2.bin")
    changed = mg.loader(mg.TokenShards(tmp_path, 8), mg.BatchPlan(4, 1), _dist(0, 1))
    with pytest.raises(mg.UsageError) as err:
        changed.load_state_dict(state)
    assert str(err.value).startswith("the saved loader position has dataset_size=48")
    # Same window count, different files: the fingerprint tells them apart.
    (tmp_path / "s2.bin").unlink()
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "s1.bin")
    (tmp_path / "s1.bin").rename(tmp_path / "t1.bin")
    moved = mg.loader(mg.TokenShards(tmp_path, 8), mg.BatchPlan(4, 1), _dist(0, 1))
    with pytest.raises(mg.UsageError) as err:
        moved.load_state_dict(state)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith('the saved loader position is for other data (source.shards[1][0] '
                                              'was "s1.bin", is "t1.bin")'), msg


hf = pytest.mark.skipif(src.datasets is None, reason="datasets (multigpu[datasets]) is not installed")


@hf
def test_a_hugging_face_dataset_is_read_per_micro_batch_without_a_copy(root):
    ds = src.datasets.load_from_disk(str(root / "hf"))
    assert len(pickle.dumps(ds)) < 4000  # the Arrow file's name, not its rows: workers get it cheaply
    plan = mg.BatchPlan(12, 1)
    micro = next(iter(mg.loader(ds, plan, _dist(0, 1), seed=1)))[0]
    assert micro["x"].shape == (12, 3) and micro["id"].dtype == torch.int64
    assert torch.equal(micro["x"][:, 0], micro["id"].float())
    assert source_fingerprint(ds) == {"kind": "hf", "fingerprint": ds._fingerprint, "rows": 90, "columns": ["id", "x"]}

    def batches(world, workers):
        per = [src.rank_steps("hf", mg.loader(ds, mg.BatchPlan(12, world), _dist(r, world), seed=1,
                                              num_workers=workers)) for r in range(world)]
        return [sum((p[s] for p in per), []) for s in range(len(per[0]))]

    assert batches(2, 2) == batches(1, 0) == batches(4, 0)
    other = src.datasets.Dataset.from_dict({"id": list(range(90)), "x": [[0.0] * 3] * 90})
    with pytest.raises(mg.UsageError, match=r"position is for other data \(source.fingerprint was"):
        mg.loader(other, plan, _dist(0, 1)).load_state_dict(mg.loader(ds, plan, _dist(0, 1)).state_dict())


@hf
def test_a_hugging_face_dataset_is_evaluated_as_mg_loader_formats_it():
    """In memory (no Arrow file): mg.eval_loader handed the model Python lists where mg.loader gives tensors."""
    ds = src.datasets.Dataset.from_dict({"id": list(range(101)), "x": [[float(i)] * 3 for i in range(101)]})
    train = next(iter(mg.loader(ds, mg.BatchPlan(8, 1), _dist(0, 1), shuffle=False)))[0]
    seen = []
    for rank in range(2):
        for batch in mg.eval_loader(ds, _dist(rank, 2), batch_size=8):
            assert sorted(batch) == sorted(train) == ["id", "x"]
            for name, column in batch.items():
                assert isinstance(column, torch.Tensor), f"{name}: {type(column).__name__}"
                assert column.dtype == train[name].dtype and column.shape[1:] == train[name].shape[1:]
            assert torch.equal(batch["x"][:, 0], batch["id"].float())
            seen += batch["id"].tolist()
    assert seen == list(range(101))


@hf
def test_a_token_column_packs_into_windows_per_arrow_chunk(tmp_path):
    rows = [list(range(i, i + 10 + i % 4)) for i in range(40)]
    src.datasets.Dataset.from_dict({"input_ids": rows, "n": list(range(40))}).save_to_disk(str(tmp_path / "tok"))
    ds = src.datasets.load_from_disk(str(tmp_path / "tok"))
    ts = mg.TokenShards.from_hf(ds, block_size=6)
    flat = [t for r in rows for t in r]
    assert ts.tokens == len(flat) and ts.dtype in ("int32", "int64")  # the Arrow type datasets chose
    assert ts[1][0].tolist() == flat[6:12] and ts[1][1].tolist() == flat[7:13]
    assert len(pickle.dumps(ts)) < 4000
    loader = mg.loader(ts, mg.BatchPlan(8, 1), _dist(0, 1), num_workers=2)
    assert len(list(loader)) == len(ts) // 8
    with pytest.raises(mg.UsageError, match=r"has columns \['n'\] but no token-id column"):
        mg.TokenShards.from_hf(ds.remove_columns("input_ids"), 6)
    with pytest.raises(mg.UsageError, match="column 'n' holds int64, not lists of integer token ids"):
        mg.TokenShards.from_hf(ds, 6, column="n")
    with pytest.raises(mg.UsageError, match="call ds.flatten_indices"):
        mg.TokenShards.from_hf(ds.shuffle(seed=0), 6)


# --- the GPT recipe's --data: train.bin/val.bin, a directory of shards, a datasets folder ------------------

def _recipe_shards(directory):
    """The built-in text as modded-nanogpt's layout: headered uint16 shards named *train* and *val*."""
    from multigpu.recipes.gpt.data import builtin_text

    directory.mkdir()
    tokens = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8).astype(np.uint16)[:60000]
    for name, part in (("pydoc_train_000000.bin", tokens[:25000]), ("pydoc_train_000001.bin", tokens[25000:50000]),
                       ("pydoc_val_000000.bin", tokens[50000:])):
        (directory / name).write_bytes(_header(len(part)) + part.tobytes())
    return directory, tokens


def test_the_gpt_recipe_reads_a_shard_directory_and_a_datasets_folder(tmp_path, monkeypatch):
    from multigpu.recipes.gpt import train
    from multigpu.recipes.gpt.data import token_sets

    monkeypatch.delenv("RANK", raising=False)
    shards, tokens = _recipe_shards(tmp_path / "shards")
    tr, va = token_sets(shards, 32, vocab_size=256)
    assert [s.name for s in tr.shards] == ["pydoc_train_000000.bin", "pydoc_train_000001.bin"] and len(va) == 9999 // 32
    assert tr[0][0].tolist() == tokens[:32].tolist()
    args = ["--steps", "2", "--block-size", "32", "--global-batch", "8", "--eval-batches", "1", "--warmup-steps", "1"]
    result = train.main([*args, "--data", str(shards), "--log-dir", str(tmp_path / "log-shards")])
    assert 0 < result["loss"] < 6
    if src.datasets is None:
        pytest.skip("datasets (multigpu[datasets]) is not installed")
    rows = lambda t: {"input_ids": [t[i:i + 500].tolist() for i in range(0, len(t), 500)]}  # noqa: E731
    splits = {"train": rows(tokens[:50000]), "validation": rows(tokens[50000:])}
    src.datasets.DatasetDict({k: src.datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "hf"))
    tr, va = token_sets(tmp_path / "hf", 32, vocab_size=256)
    assert tr[0][0].tolist() == tokens[:32].tolist() and va.tokens == 10000
    result = train.main([*args, "--data", str(tmp_path / "hf"), "--log-dir", str(tmp_path / "log-hf")])
    assert 0 < result["loss"] < 6


def _no_init(*args, **kwargs):
    raise AssertionError("mg.init was reached: the refusal came after work had started")


def _layouts(tmp_path):
    (tmp_path / "only_train").mkdir()
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "only_train" / "x_train_0.bin")
    cut = tmp_path / "cut"
    _recipe_shards(cut)
    with open(cut / "pydoc_train_000001.bin", "r+b") as f:
        f.truncate(5000)
    out = {"{only_train}": str(tmp_path / "only_train"), "{cut}": str(cut)}
    if src.datasets is not None:
        one = src.datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 40, "n": list(range(40))})
        one.save_to_disk(str(tmp_path / "one_split"))
        src.datasets.DatasetDict(train=one, extra=one).save_to_disk(str(tmp_path / "no_val"))
        src.datasets.DatasetDict(train=one.remove_columns("input_ids"),
                                 validation=one.remove_columns("input_ids")).save_to_disk(str(tmp_path / "no_ids"))
        out |= {k: str(tmp_path / k.strip("{}")) for k in ("{one_split}", "{no_val}", "{no_ids}")}
    return out


@pytest.mark.parametrize("data, line", [
    ("{only_train}", "only_train has train shards but no *val* shard; add one (e.g. fineweb_val_000000.bin)"),
    ("{cut}", "pydoc_train_000001.bin is truncated: its header promises 25,000 tokens (51,024 bytes) but it has "
              "5,000 bytes"),
    pytest.param("{one_split}", "one_split holds one split; save a DatasetDict with a train and a validation split",
                 marks=hf),
    pytest.param("{no_val}", "no_val has splits ['extra', 'train']; it needs train and one of validation, val, test",
                 marks=hf),
    pytest.param("{no_ids}", "has columns ['n'] but no token-id column", marks=hf),
])
def test_the_gpt_recipe_refuses_a_bad_data_layout_in_one_line_before_init(data, line, tmp_path, monkeypatch, capsys):
    from multigpu.recipes.gpt import train

    monkeypatch.setattr(mg, "init", _no_init)
    with pytest.raises(SystemExit) as stop:
        train.main(["--data", _layouts(tmp_path)[data]])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert line in err
