"""The layout contract: a script reads its Layout from its command line, and verify and tune run it in any layout."""

from __future__ import annotations

import pytest

import multigpu as mg
from multigpu.parallel.flags import describe, layout_flags, parse_layouts, world_of


def test_layout_from_args_reads_every_flag_and_leaves_the_rest():
    layout, rest = mg.layout_from_args(["--tp", "2", "--steps", "5", "--pp=2", "--dp-replicate", "1", "--dp-shard", "2",
                                        "--micro-batch", "4", "--activation-checkpointing", "--schedule", "gpipe",
                                        "--compile", "--seed", "3"])
    assert layout == mg.parallel.Layout(tp=2, pp=2, dp_replicate=1, dp_shard=2, micro_batch=4,
                                        activation_checkpointing=True, schedule="gpipe", compile=True)
    assert rest == ["--steps", "5", "--seed", "3"]
    # a flag left out keeps the script's default; none given is one process's layout
    assert mg.layout_from_args(["--tp", "2"], default=mg.parallel.Layout(micro_batch=2))[0].micro_batch == 2
    assert mg.layout_from_args([]) == (mg.parallel.Layout(), [])
    # the script's own flags are never read as abbreviations of the layout's
    assert mg.layout_from_args(["--sched", "x"])[1] == ["--sched", "x"]


def test_layout_flags_round_trip_through_the_verbs_spelling():
    layouts = parse_layouts("tp=2; dp_shard=2,tp=2 ;pp=2,micro_batch=1,schedule=gpipe;dp_replicate=2,activation_checkpointing=true")
    assert [world_of(l) for l in layouts] == [2, 4, 2, 2]
    assert [describe(l) for l in layouts] == ["tp=2", "dp_shard=2,tp=2", "pp=2,micro_batch=1,schedule=gpipe",
                                              "dp_replicate=2,activation_checkpointing=true"]
    for layout in layouts:
        assert mg.layout_from_args(layout_flags(layout)) == (layout, [])


@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "0"], "--tp takes a positive integer, got '0'; use e.g. --tp 2"),
    (["--micro-batch", "x"], "--micro-batch takes a positive integer, got 'x'"),
    (["--schedule", "zigzag"], "--schedule takes one of gpipe, 1f1b"),
    (["--pp"], "argument --pp: expected one argument"),
])
def test_bad_layout_flags_are_one_line(argv, fragment):
    with pytest.raises(mg.UsageError) as err:
        mg.layout_from_args(argv)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, fragment", [
    ("tp=0", '--layouts tp takes a positive integer, got \'0\'; use e.g. --layouts "tp=2"'),
    ("tpp=2", "--layouts takes field=value pairs of"),
    (";", "--layouts names no layout"),
    ("pp=2,schedule=zigzag", "unknown pipeline schedule 'zigzag'"),
    ("activation_checkpointing=maybe", "activation_checkpointing takes true or false"),
])
def test_bad_layouts_are_one_line(text, fragment):
    with pytest.raises(mg.UsageError) as err:
        parse_layouts(text)
    assert fragment in str(err.value) and "\n" not in str(err.value)
