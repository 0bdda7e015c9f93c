"""Encoders get a tensor-parallel plan found in them (their layouts against one process: the zoo,
tests/test_zoo.py, runs BERT, RoBERTa, DistilBERT, ModernBERT and ViT under TP 2, TP 2 + SP and FSDP 2 x TP 2).

BERT and RoBERTa keep q, k, v in ``attention.self`` and the projections after them each in a module of
its own (``attention.output.dense``, ``intermediate.dense`` then ``output.dense``); DistilBERT names
them q_lin, k_lin, v_lin, out_lin and ffn.lin1, lin2; ModernBERT fuses q, k, v in ``Wqkv`` and gate and
up in ``Wi``, which it cuts apart in its forward only, so they are split column-wise with the output
gathered (the row-wise ``Wo`` after them taking the whole input). Each with a per-token head of VOCAB
labels, float64, 5 AdamW steps with clipping at 0.5: every parameter within 1e-9 of one process's (a
ModernBERT Wqkv split by rows with its output left split, as a plain colwise plan does, ends 9.6e-3 off).
"""

import pytest

from multigpu.parallel import auto
from multigpu.testing import spawn

import _hf_layouts as hf

KINDS = ["bert", "roberta", "distilbert", "modernbert"]

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[hf])")


def test_the_plan_found_in_each_encoder():
    found = {}
    for kind in KINDS:
        model = hf.build(kind)
        blocks = auto.block_modules(model, auto.blocks_of(model)[0])
        found[kind] = {k.split("layer.0.")[-1].split("layers.0.")[-1]: v for k, v in auto.found_plan(model, blocks).items()
                       if ".0." in k}
    assert found["bert"] == found["roberta"] == {
        "attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
        "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}
    assert found["distilbert"] == {"attention.q_lin": "colwise", "attention.k_lin": "colwise",
                                   "attention.v_lin": "colwise", "attention.out_lin": "rowwise",
                                   "ffn.lin1": "colwise", "ffn.lin2": "rowwise"}
    assert found["modernbert"] == {"attn.Wqkv": "colwise_gather_output", "attn.Wo": "rowwise_split_input",
                                   "mlp.Wi": "colwise_gather_output", "mlp.Wo": "rowwise_split_input"}


def test_both_fsdp_entries_cut_a_vit_into_the_same_units_and_say_so(capfd):
    """mg.wrap(model, "fsdp") took attention and MLP pieces by size and said nothing, mg.parallelize whole
    ViTLayers: one rule now (the declared blocks first), one line each."""
    out = spawn(hf.fsdp_units, 2, timeout=240)
    assert out[0] == out[1]
    units = out[0]
    assert units["wrap"] == units["parallelize"] == ["", "vit.embeddings", "vit.layers.0", "vit.layers.1"]
    said = capfd.readouterr().out
    rule = "3 units of ViTEmbeddings, ViTLayer (declared _no_split_modules) + the root"
    assert f"mg.wrap: FSDP over 2 ranks: {rule}" in said
    assert f"mg.parallelize: FSDP over dp_shard 2: {rule}" in said
