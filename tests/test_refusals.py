"""Values that cannot work are refused in one line, exit 2, no traceback, before any work.

In this process: the GPT recipe's own ``main`` (mg.init is replaced by a trap, so a refusal that came
after it would fail the test) and the ``multigpu`` CLI's ``main`` for ``tune`` and ``study``.
"""

import pytest

import multigpu as mg
from multigpu.recipes.gpt import train

from _cli import run_cli


def _no_init(*args, **kwargs):
    raise AssertionError("mg.init was reached: the refusal came after work had started")


def _empty_data(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("train.bin", "val.bin"):
        (tmp_path / "empty" / name).write_bytes(b"")
    return str(tmp_path / "empty")


def _odd_data(tmp_path):
    (tmp_path / "odd").mkdir()
    for name in ("train.bin", "val.bin"):
        (tmp_path / "odd" / name).write_bytes(b"\0" * 301)
    return str(tmp_path / "odd")


@pytest.mark.parametrize("argv, line", [
    (["--pp-splits", "1"], "--pp-splits sets the pipeline but --pp is 1 (no pipeline); add --pp 2 or more "
                           "(with --untied), or drop --pp-splits"),
    (["--schedule", "gpipe"], "--schedule sets the pipeline but --pp is 1 (no pipeline)"),
    (["--pp", "1", "--schedule", "gpipe", "--pp-splits", "1"],
     "--schedule and --pp-splits set the pipeline but --pp is 1 (no pipeline); add --pp 2 or more (with --untied), "
     "or drop --schedule and --pp-splits"),
    (["--steps", "-1"], "--steps must be a positive integer, got -1; use e.g. --steps 50"),
    (["--steps", "0"], "--steps must be a positive integer, got 0; use e.g. --steps 50"),
    (["--block-size", "0"], "--block-size must be a positive integer, got 0; omit it for the size's own (tiny: 64)"),
    (["--eval-every", "0"], "--eval-every must be a positive integer, got 0"),
    (["--eval-batches", "0"], "--eval-batches must be a positive integer, got 0; use e.g. --eval-batches 8"),
    (["--lr", "-1"], "--lr must be a positive number, got -1; use e.g. --lr 1e-3"),
    (["--clip", "-1"], "--clip is the largest global gradient norm, 0 or more (0: off), got -1"),
    (["--size", "huge"], "--size must be one of tiny, small, gpt2, got 'huge'; use e.g. --size tiny"),
    (["--data", "{empty}"], "train.bin is empty (0 bytes); write its token ids as uint16"),
    (["--data", "{odd}"], "train.bin has 301 bytes, not a whole number of uint16 tokens"),
    (["--data", "{missing}"], "missing/train.bin does not exist"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x' (see `python -m multigpu.recipes.gpt --help`)"),
    (["--ddp"], "--ddp is gone: a layout that only replicates is DDP; use --dp-replicate N on N processes"),
    (["--pp", "2"], "the token table of the GPT is tied to its head, but a pipeline puts them on different stages"),
    (["--tp", "3"], "tensor-parallel degree 3 does not divide attention heads 4, hidden units 256, vocabulary 256"),
    (["--loss-parallel"], "--loss-parallel keeps the logits split over tensor-parallel ranks but --tp is 1"),
])
def test_gpt_recipe_refuses_in_one_line_before_init(argv, line, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mg, "init", _no_init)
    where = {"{empty}": _empty_data(tmp_path), "{odd}": _odd_data(tmp_path), "{missing}": str(tmp_path / "missing")}
    with pytest.raises(SystemExit) as stop:
        train.main([where.get(a, a) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.count("\n") == 1 and err.startswith("multigpu: error: ") and "Traceback" not in err, err
    assert line in err


def test_pipeline_flags_and_good_data_still_parse(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("train.bin", "val.bin"):
        (tmp_path / "data" / name).write_bytes(b"\1\0" * 65)  # 65 tokens: one window of the tiny size's 64
    args = train.parse_args(["--pp", "2", "--untied", "--schedule", "gpipe", "--pp-splits", "1", "--data",
                             str(tmp_path / "data")])
    assert (args.layout.pp, args.layout.schedule, args.splits) == (2, "gpipe", [1])
    assert not train.parse_args([]).schedule_given  # the layout's default, 1f1b, is chosen under --pp only


def test_tune_refuses_an_unknown_size_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["tune", "--cpu", "gpt", "--size", "huge"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("multigpu tune: error: --size must be one of tiny, small, gpt2, got 'huge'")
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("budget", ["-5", "nan"])  # 0 is a budget: the --repeats rounds, none added
def test_study_refuses_a_negative_budget(budget, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["study", "--cpu", "--ci", "0.1", "--budget", budget, "digits"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"multigpu study: error: --budget is the seconds after which no round starts, 0 or more, "
                          f"got {float(budget):g}; use e.g. --budget 600")
    assert not (tmp_path / "studies").exists()
