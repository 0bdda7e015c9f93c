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
    (["--schedule", "looped_bfs", "--stages-per-rank", "3"],
     "--schedule and --stages-per-rank set the pipeline but --pp is 1 (no pipeline)"),
    (["--stages-per-rank", "2"], "pipeline schedule '1f1b' runs 1 stage per rank, got stages_per_rank=2; leave "
                                 "stages_per_rank out, or use a looped schedule"),
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


# -- every value a refusal suggests is one the same command accepts ------------------------------------------
# Each case: (the model, the layout asked for, the sequence length); on its world it is refused in one line,
# and each value the line suggests (an ep or cp degree, or a sequence length) is applied to the same model on
# the same ranks and trained a step. The suggestions come from the rule that refused (experts.check with
# Layout.ep_problem, context.check_heads with Layout.resolve, context.length_refusal), never a formula of
# their own: "ep=4 does not divide the 6 experts; use ep=3" on 4 ranks, which then refused ep 3 (dp_shard 4
# is not a multiple of it), is the bug this catches.
SUGGESTING = {
    3: [("own_moe", {}, {"ep": 3}, 16), ("own_moe", {}, {"ep": 2}, 16), ("own", {"n_head": 4}, {"cp": 3}, 48),
        ("zoo:mixtral", {}, {"ep": 3}, 16)],
    4: [("own_moe", {"experts": 6}, {"ep": 4}, 16), ("own_moe", {"experts": 6}, {"ep": 3}, 16),
        ("own", {"n_head": 2}, {"cp": 4}, 32), ("own_rope", {}, {"cp": 2}, 2050), ("zoo:mixtral", {}, {"ep": 3}, 16),
        ("llama", {"num_attention_heads": 2, "num_key_value_heads": 2}, {"cp": 4}, 32),
        ("zoo:mixtral", {}, {"ep": 3, "tp": 2}, 16)],
}


def _train_step(dist, kind: str, overrides: dict, layout: dict, seq: int) -> None:
    """The model spread by ``layout`` on these ranks, one SGD step on ``seq``-token sequences (labels shared
    by mg.context_share before the forward, as a loss over mg.token_divisor counts them)."""
    import torch
    import torch.nn.functional as F

    import _hf_layouts as hf

    model = mg.parallelize(hf.build(kind, **overrides), mg.parallel.Layout(**layout), verbose=False)
    x = torch.randint(0, hf.VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    y = mg.context_share(model, torch.roll(x, -1, 1))
    logits = hf.logits_of(model, x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def _suggestions(dist) -> list[tuple[str, list[str]]]:
    """Each case of SUGGESTING[world]: its refusal, and for each value it suggests "ran" or why it did not."""
    import re

    out = []
    for kind, overrides, layout, seq in SUGGESTING[dist.world_size]:
        try:
            _train_step(dist, kind, overrides, layout, seq)
            out.append(("accepted", []))
            continue
        except mg.UsageError as e:
            line = str(e)
        runs = []
        degree = re.search(r"; use (ep|cp)(?:=(\d+)| in ([\d, ]+))$", line)
        lengths = re.search(r"\((\d+)(?: or (\d+))? tokens\)", line)
        if degree:
            tried = [(degree[1], int(v)) for v in (degree[2] or degree[3]).split(", ")]
        else:
            tried = [("seq", int(v)) for v in lengths.groups() if v] if lengths else []
        for name, value in tried:
            try:
                if name == "seq":
                    _train_step(dist, kind, overrides, layout, value)
                else:
                    _train_step(dist, kind, overrides, layout | {name: value}, seq)
                runs.append(f"{name}={value} ran")
            except Exception as e:  # noqa: BLE001 - a suggestion refused or broken is the finding
                runs.append(f"{name}={value}: {type(e).__name__}: {e}")
        out.append((line, runs))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SUGGESTING))
def test_every_suggested_degree_and_length_is_one_the_same_command_accepts(world):
    pytest.importorskip("transformers")
    from multigpu.testing import spawn

    found = spawn(_suggestions, world, timeout=600)
    assert all(f == found[0] for f in found), found  # every rank refuses and runs alike
    for (kind, _, layout, seq), (line, runs) in zip(SUGGESTING[world], found[0]):
        assert "\n" not in line and runs, (kind, layout, seq, line)
        assert all(r.endswith(" ran") for r in runs), (kind, layout, seq, line, runs)
    said = [line for line, _ in found[0]]
    print(said)
    if world == 3:
        assert said[0] == "ep=3 does not divide the 4 experts of OwnMoE; use ep=1"
        assert said[2].startswith("context parallelism trades the sequence for the heads: cp 3 must divide the "
                                  "attention heads 4 each tensor-parallel rank holds of TinyLM; use cp=1")
    else:
        assert said[0] == "ep=4 does not divide the 6 experts of OwnMoE; use ep in 1, 2"
        assert said[1].startswith("ep 3 borrows its ranks from dp_shard") and said[1].endswith("use ep in 1, 2")
        assert said[2].endswith("attention heads 2 each tensor-parallel rank holds of TinyLM; use cp in 1, 2")
        assert said[3].startswith("context_share cuts the sequence (dim 1) of a tensor of shape (2, 2050) into 2 x "
                                  "cp = 4 equal chunks, but the sequence has 2050 tokens; pad or pack the sequences "
                                  "to a multiple of 4 (2048 or 2052 tokens)")
        assert said[6].startswith("ep 3 takes every tensor-parallel rank") and said[6].endswith("use ep in 1, 2, 4")
