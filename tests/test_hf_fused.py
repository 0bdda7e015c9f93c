"""Fused nn.Linear projections under tensor parallelism, by the plan the model declares, equal one process.

Phi-3 holds q, k and v (of unequal widths under grouped-query attention) in one ``qkv_proj`` and gate and
up in one ``gate_up_proj``; its declared plan shards them column-wise with the output gathered
(``colwise_gather_output``), the row-wise projection after each taking the whole input
(``rowwise_split_input``): exact whatever the fusion. GPT-NeoX holds [q, k, v] per head in
``query_key_value`` and declares it plain ``colwise``: a split by rows is a split by heads. Float64, 5
AdamW steps with clipping at 0.5, against one process: every parameter within 1e-9 (another summation
order moves them ~1e-14), and a TP 2 checkpoint resumes under FSDP 2 on one process's weights. A fused
projection split with its output left split where the model does not declare it is refused in one line.
"""

import pytest

import multigpu as mg
from multigpu.parallel import auto
from multigpu.testing import spawn

import _hf_layouts as hf

TOL = 1e-9
KINDS = ["phi3", "gpt_neox"]

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[hf])")


@pytest.fixture(scope="module")
def reference():
    return {"phi3": spawn(hf.train_layouts, 1, [("phi3", {})], timeout=240)[0][0]}


def test_phi3s_fused_weights_saved_under_tp_2_resume_under_fsdp_2_on_one_processs_weights(reference, tmp_path):
    # (Phi-3 and GPT-NeoX under TP 2 and FSDP 2 x TP 2 against one process: the zoo, tests/test_zoo.py.)
    # The fused weights resharded by DCP: 3 steps under TP 2, the last 2 under FSDP 2.
    resumed = spawn(hf.train_in_two_layouts, 2, "phi3", {"tp": 2}, {}, str(tmp_path / "ckpt"), timeout=300)
    for r in resumed:
        assert (r["strategy"], r["start"], len(r["losses"])) == ("fsdp", 3, 2)
        assert hf.max_diff(r, reference["phi3"]) < TOL


def test_a_fused_projection_split_without_its_parts_in_mind_is_refused_in_one_line():
    model = hf.build("phi3")
    plan = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    styles = {k: auto.translate(v, k) for k, v in auto.expand(model, plan).items()}
    with pytest.raises(mg.UsageError) as e:
        auto.check_shardable(model, styles, 2)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("tensor-parallel plan shards model.layers.0.self_attn.qkv_proj column-wise with its output "
                           "left split, but it is a fused projection (several projections in one weight)")
    assert "give it 'colwise_gather_output'" in line
    # the same plan with the output gathered, and the model's own declared split, pass
    gathered = {"model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
                "model.layers.*.self_attn.o_proj": "rowwise_split_input"}
    auto.check_shardable(model, {k: auto.translate(v, k) for k, v in auto.expand(model, gathered).items()}, 2)
    neox = hf.build("gpt_neox")
    declared = auto.expand(neox, auto.declared_plan(neox))
    auto.check_shardable(neox, {k: auto.translate(v, k) for k, v in declared.items()}, 2, declared=True)
