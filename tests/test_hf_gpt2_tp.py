"""GPT-2 (transformers' Conv1D, a fused q/k/v c_attn) under tensor parallelism trains as one process does.

``mg.parallelize(gpt2, Layout(tp=2))`` shards c_attn column-wise in 3 parts (rank r holds [q_r, k_r, v_r],
DTensor's _StridedShard), c_fc column-wise and both c_proj row-wise (multigpu/parallel/hf/conv1d.py). In
float64, 5 AdamW steps with accumulation 2 and clipping at 0.5, every parameter must equal one process's
within 1e-9 (another summation order moves them ~1e-15, a bug 1e-4 or more), under TP 2, FSDP 2 x TP 2 and
after a TP 2 checkpoint is resumed under FSDP 2, TP 2 or on one process. Each fixture is one start-up of its
processes for several cases (tests/_hf_gpt2.py).
"""

import re

import pytest

from multigpu.parallel import auto
from multigpu.parallel.hf.conv1d import Conv1DColwise, Conv1DRowwise
from multigpu.testing import spawn

import _hf_gpt2 as g
import _hf_layouts as hf

TOL = 1e-9

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[datasets])")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_ckpt")
    out = spawn(g.two_ranks, 2, str(d / "ckpt"), str(d / "copy"), timeout=300)
    return out, str(d / "copy")


@pytest.fixture(scope="module")
def one(two):
    return spawn(g.one_process, 1, two[1], timeout=240)[0]


def _max_diff(got, ref):
    assert sorted(got["state"]) == sorted(ref["state"])
    return max((got["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])


def test_found_plan_shards_gpt2s_conv1d_and_splits_the_fused_c_attn_in_three():
    model = hf.build("gpt2")
    plan = auto.found_plan(model, auto.block_modules(model, auto.blocks_of(model)[0]))
    assert len(plan) == 8  # 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj); embeddings and the tied head stay whole
    attn, fc = plan["transformer.h.1.attn.c_attn"], plan["transformer.h.1.mlp.c_fc"]
    assert isinstance(attn, Conv1DColwise) and attn.parts == 3 and attn.label == "Conv1DColwise x3"
    assert isinstance(fc, Conv1DColwise) and fc.parts == 1  # c_fc (E -> 4E) is one projection, not fused
    assert isinstance(plan["transformer.h.0.attn.c_proj"], Conv1DRowwise)
    assert isinstance(plan["transformer.h.0.mlp.c_proj"], Conv1DRowwise)
    assert "c_fc" not in auto.FUSED_NAMES


def test_tp_shards_c_attn_as_q_k_v_per_rank_and_full_tensor_gives_one_processs_weights(two):
    out, _ = two
    for rank in out:
        s = rank["sharding"]
        assert s["placements"]["transformer.h.0.attn.c_attn.weight"] == ["_S(1, 3)"]  # _StridedShard(1, split_factor=3)
        assert s["placements"]["transformer.h.0.attn.c_attn.bias"] == ["R"]  # whole: see Conv1DColwise.placements
        assert s["placements"]["transformer.h.0.mlp.c_fc.weight"] == ["S(1)"]
        assert s["placements"]["transformer.h.0.mlp.c_fc.bias"] == ["S(0)"]
        assert s["placements"]["transformer.h.0.mlp.c_proj.weight"] == ["S(0)"]
        assert s["placements"]["transformer.h.0.attn.c_proj.bias"] == ["R"]
        assert s["local_shape"] == (32, 48) and s["local_c_attn"] == 0.0  # exactly [q_r, k_r, v_r]
        assert s["full"] == 0.0  # the state dict is one process's, bit for bit
        assert s["split_size"] == (16, 16) and s["nf"] == (96, 128)
        assert s["plain"] == ["transformer.h.0.ln_1.bias", "transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.bias"]


def test_gpt2_under_tp_2_and_a_tp_checkpoint_resumed_under_fsdp_2_tp_2_or_one_process_equal_one_process(two, one):
    out, _ = two
    ref = one["reference"]
    assert min(ref["norms"]) > 0.5  # clipping acted
    measured = {}
    for rank in out:
        tp = rank["tp"]
        assert tp["strategy"] == "none" and tp["norms"] == pytest.approx(ref["norms"], rel=1e-9)
        for key, strategy in (("resumed_fsdp", "fsdp"), ("resumed_tp", "none")):
            resumed = rank[key]
            assert (resumed["strategy"], resumed["start"], len(resumed["losses"])) == (strategy, 3, 2)  # not anew
            assert resumed["norms"] == pytest.approx(ref["norms"][3:], rel=1e-9)
        for name, r in (("TP 2", tp), ("TP 2 -> FSDP 2", rank["resumed_fsdp"]), ("TP 2 -> TP 2", rank["resumed_tp"])):
            measured[name] = max(_max_diff(r, ref), measured.get(name, 0.0))
    resumed_one = one["resumed"]
    assert (resumed_one["start"], len(resumed_one["losses"])) == (3, 2)
    assert resumed_one["norms"] == pytest.approx(ref["norms"][3:], rel=1e-9)
    measured["TP 2 -> one process"] = _max_diff(resumed_one, ref)
    print("GPT-2 max parameter difference per layout:", {k: f"{v:.1e}" for k, v in measured.items()})
    assert all(v < TOL for v in measured.values()), measured


@pytest.mark.slow
def test_gpt2_under_fsdp_2_x_tp_2_on_four_ranks_and_its_checkpoint_under_tp_4_equal_one_process(one, tmp_path):
    out = spawn(g.four_ranks, 4, str(tmp_path / "ckpt"), timeout=400)
    ref = one["reference"]
    measured = {}
    for rank in out:
        r, resumed = rank["fsdp_tp"], rank["resumed_tp4"]
        assert r["strategy"] == "fsdp" and r["norms"] == pytest.approx(ref["norms"], rel=1e-9)
        assert (resumed["strategy"], resumed["start"], len(resumed["losses"])) == ("none", 3, 2)
        assert resumed["norms"] == pytest.approx(ref["norms"][3:], rel=1e-9)
        for name, got in (("FSDP 2 x TP 2", r), ("FSDP 2 x TP 2 -> TP 4", resumed)):
            measured[name] = max(_max_diff(got, ref), measured.get(name, 0.0))
    print("GPT-2 max parameter difference per layout:", {k: f"{v:.1e}" for k, v in measured.items()})
    assert all(v < TOL for v in measured.values()), measured


def test_what_cannot_be_split_equally_is_refused_in_one_line_naming_the_module(two):
    out, _ = two
    lines = out[0]["refusals"]
    assert lines == out[1]["refusals"]  # every rank refuses alike
    assert all("\n" not in line for line in lines), lines
    expect = [
        r"^tensor-parallel degree 2 does not divide attention heads 3 of GPT2LMHeadModel; use tp=1",
        r"^tensor parallelism found transformer.h.0.attn.c_attn in GPT2LMHeadModel, a fused Conv1D of 64 outputs "
        r"that split_size 32 does not cut into 3 equal parts .*tp cannot split it equally; use tp=1",
        r"^accepted$",  # a fused nn.Linear qkv: split column-wise with its output gathered (test_hf_encoders.py)
        r"^tensor-parallel degree 2 does not divide transformer.h.0.mlp.c_fc's output features 65 \(column-wise\); "
        r"use a tp that divides 65",
        r"^tensor-parallel plan shards transformer.h.0.mlp.c_fc column-wise, but it is a Conv1D \(a Linear stored "
        r"transposed\): .*drop it from the plan \(it stays replicated\) \(the plan multigpu finds, tp_plan=None, "
        r"shards GPT-2's Conv1D\) or use tp=1",
    ]
    assert len(lines) == len(expect)
    for line, pattern in zip(lines, expect):
        assert re.search(pattern, line), (pattern, line)
