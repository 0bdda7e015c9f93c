"""Pipelines of tied models: GPT-2 (its head tied to its token table, no declared ``_pp_plan``) cut by
``mg.parallel.pipeline`` trains as one process does.

The last stage holds its own copy of the tied table; after each step's backward the two copies'
gradients are summed (point to point between the two pipeline ranks, or locally where one rank holds
both stages, as V placement does), so both carry one process's gradient and stay equal under AdamW;
the clipping norm counts the table once. Float64, 5 AdamW steps, 4 micro-batches, clipping at 0.5 on
gloo ranks: every parameter within 1e-9 of one process's (another summation order moves them ~1e-15,
a bug 1e-4 or more), the gradient norms within 1e-9 relative, and the last stage's losses equal one
process's.
"""

import re
import time

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.parallel import stages
from multigpu.parallel.hf import split as hf_split
from multigpu.parallel.hf.tied import tied_groups
from multigpu.testing import spawn

import _hf_layouts as hf
import _hf_pipeline as w

TOL = 1e-9

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[datasets])")

DEEP_GPT2, DEEP_LLAMA, TIED_LLAMA = {"n_layer": 4}, {"num_hidden_layers": 4}, {"tie_word_embeddings": True}
MODELS = [("gpt2", {}), ("gpt2", DEEP_GPT2), ("llama", DEEP_LLAMA), ("llama", {}), ("llama", TIED_LLAMA),
          ("gemma2", {})]
TWO = [("gpt2", {}, {"pp": 2}),                                          # 1F1B: table on rank 0, head on rank 1
       ("gpt2", DEEP_GPT2, {"pp": 2, "schedule": "interleaved_1f1b"}),   # stages 0, 2 | 1, 3
       ("gpt2", DEEP_GPT2, {"pp": 2, "schedule": "zbv"}),                # stages 0, 3 | 1, 2: both copies on rank 0
       ("llama", DEEP_LLAMA, {"pp": 2, "schedule": "zbv"}),              # untied, declared _pp_plan, V placement
       ("gemma2", {}, {"pp": 2}),                        # a mask per layer by index, logits soft-capped after the head
       ("llama", DEEP_LLAMA, {"pp": 2, "activation_checkpointing": True})]  # pp alone still checkpoints each block
FOUR = [("gpt2", {}, {"pp": 2}),                                         # PP 2 x FSDP 2
        ("gpt2", DEEP_GPT2, {"pp": 4}),                                  # the middle ranks take no part in the sum
        ("llama", {}, {"pp": 2, "tp": 2}),                               # TP inside the stages (declared plan)
        ("llama", TIED_LLAMA, {"pp": 2, "tp": 2})]                       # tied copies sharded alike by TP


@pytest.fixture(scope="module")
def reference():
    start = time.perf_counter()
    out = spawn(w.run, 1, [(kind, o, None) for kind, o in MODELS], timeout=240)[0]
    print(f"reference: {time.perf_counter() - start:.1f} s")
    return {(kind, tuple(o.items())): r for (kind, o), r in zip(MODELS, out)}


def _check(jobs, out, reference):
    measured = {}
    for j, (kind, o, layout) in enumerate(jobs):
        ref = reference[(kind, tuple(o.items()))]
        name = f"{kind}{' ' + str(o) if o else ''} {layout}"
        last = []  # the last stage's losses, one list per data-parallel rank (each its share of the batch)
        for rank in out:
            got = rank[j]
            assert sorted(got["state"]) == sorted(ref["state"]), name  # one process's keys, both of the tied pair
            diff = max((got["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])
            measured[name] = max(diff, measured.get(name, 0.0))
            assert diff < TOL, f"{name}: max parameter difference {diff:.3g}"
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-9), name  # the tied table counted once
            table = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
            if kind == "gpt2" or o.get("tie_word_embeddings"):  # the copies stayed equal: one process's one tensor
                assert torch.equal(got["state"]["lm_head.weight"], got["state"][table]), name
            if got["losses"][0] is not None:
                last.append(got["losses"])
        mean = [sum(step) / len(last) for step in zip(*last)]  # equal shares: their mean is one process's loss
        assert mean == pytest.approx(ref["losses"], rel=1e-9), name
    print("max parameter difference per layout:", {k: f"{v:.1e}" for k, v in measured.items()})
    return measured


def test_gpt2_and_llama_pipelines_on_two_ranks_equal_one_process(reference):
    start = time.perf_counter()
    out = spawn(w.run, 2, TWO, timeout=400)
    print(f"2 ranks, {len(TWO)} pipelines: {time.perf_counter() - start:.1f} s")
    _check(TWO, out, reference)
    assert [[r[j]["stages"] for r in out] for j in range(len(TWO))] == [
        [[0], [1]], [[0, 2], [1, 3]], [[0, 3], [1, 2]], [[0, 3], [1, 2]], [[0], [1]], [[0], [1]]]
    # Who holds the tied pair: the table on stage 0, the head on the last stage, both on rank 0 under zbv.
    assert [[r[j]["tied_held"] for r in out] for j in range(3)] == [
        [["transformer.wte.weight"], ["lm_head.weight"]]] * 2 + [[["lm_head.weight", "transformer.wte.weight"], []]]
    # One copy left out of the norm per pipeline: on the head's rank, or on rank 0 holding both.
    assert [[r[j]["counted_once"] for r in out] for j in range(3)] == [[0, 1], [0, 1], [1, 0]]
    assert [[r[3]["tied"], r[3]["counted_once"]] for r in out] == [[False, 0]] * 2  # Llama: untied, nothing summed
    # The layout's activation checkpointing reaches every block of every stage (each rank: 2 of the 4 layers),
    # with no data-parallel or TP step to carry it; the others recompute nothing.
    assert [[r[j]["checkpointed"] for r in out] for j in range(len(TWO))] == [[0, 0]] * 5 + [[2, 2]]
    # The last stage keeps no micro-batch's logits past the step (they were kept to be returned, unused: 4 here).
    assert all(r[j]["kept_outputs"] == 0 for r in out for j in range(len(TWO)))


@pytest.mark.slow
def test_gpt2_pipeline_by_fsdp_and_over_four_stages_and_llama_by_tp_on_four_ranks_equal_one_process(reference):
    start = time.perf_counter()
    out = spawn(w.run, 4, FOUR, timeout=500)
    print(f"4 ranks, {len(FOUR)} pipelines: {time.perf_counter() - start:.1f} s")
    _check(FOUR, out, reference)
    assert [r[0]["stages"] for r in out] == [[0], [0], [1], [1]]  # pp 2 x dp_shard 2: ranks 0, 1 the first stage
    assert [r[1]["tied"] for r in out] == [True, False, False, True]  # pp 4: only stages 0 and 3 sum
    assert [r[2]["stages"] for r in out] == [[0], [0], [1], [1]]  # pp 2 x tp 2: ranks 0, 1 TP peers of stage 0
    assert [(r[3]["tied"], r[3]["counted_once"]) for r in out] == [(True, 0)] * 2 + [(True, 1)] * 2


def test_a_causal_lm_without_pp_plan_is_split_by_its_base_model_and_later_stages_skip_its_embeddings():
    model = hf.build("gpt2", embd_pdrop=0.5)  # a dropout before the blocks: the first stage's only
    assert model._pp_plan == {} and model.config.base_model_pp_plan is None  # transformers 5.24 GPT-2: no plan
    assert tied_groups(model) == [["transformer.wte.weight", "lm_head.weight"]]
    from multigpu.parallel.hf.split import causal_lm_split

    assert causal_lm_split(model) == ("transformer", "transformer.h", ["transformer.wte", "transformer.wpe"],
                                       ["transformer.ln_f"], ["lm_head"], "found split")
    make, ranges, how = stages.split(model, mg.parallel.Layout(pp=2), 2)
    assert (ranges, how) == ([range(0, 1), range(1, 2)], "found split (transformer.h: 2 blocks)")
    first, last = make(0), make(1)
    names = [sorted(n for n, _ in p.named_parameters()) for p in (first, last)]
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" not in names[0]
    assert "lm_head.weight" in names[1] and not any(n.startswith(("transformer.wte", "transformer.wpe"))
                                                        for n in names[1])
    assert sorted(set(first.state_dict()) | set(last.state_dict())) == sorted(model.state_dict())
    assert first.lm_head is None and last.lm_head.weight is not model.lm_head.weight  # the head's own copy
    x = torch.randint(0, hf.VOCAB, (2, hf.SEQ))
    model.eval(), first.eval(), last.eval()
    ref = model(input_ids=x, use_cache=False).logits
    assert torch.equal(last(first(x)), ref)  # the position embedding added once, on the first stage
    h = first(x)
    last.train()  # the embedding dropout (p=0.5) would change every hidden state on a later stage: not applied
    assert torch.equal(last(h), ref)
    llama = hf.build("llama")
    parts = [stages.split(llama, mg.parallel.Layout(pp=2), 2)[0](i) for i in (0, 1)]
    assert torch.equal(parts[1](parts[0](x)), llama(input_ids=x, use_cache=False).logits)


@pytest.mark.parametrize("kind", ["gemma2", "granite", "llama"])
def test_stages_run_the_models_own_forward_per_layer_config_and_what_follows_the_head(kind):
    """Stage 1 of Gemma-2 starts at layer 2, a full-attention layer by config.layer_types[2] (counted from 0
    inside the stage it took layer 0's sliding-window mask); Gemma-2 soft-caps its logits and Granite
    divides them by logits_scaling after the head (a head applied alone skipped both). The stages composed
    equal the model's forward exactly, on 2 and 4 stages."""
    model = hf.build(kind, **({"num_hidden_layers": 4} if kind != "gemma2" else {}))
    x = torch.randint(0, hf.VOCAB, (2, hf.SEQ), generator=torch.Generator().manual_seed(3))
    ref = model(input_ids=x, use_cache=False).logits
    for n in (2, 4):
        make = stages.split(model, mg.parallel.Layout(pp=n), n)[0]
        h = x
        for i in range(n):
            part = make(i)
            held = sorted({int(k.split(".")[2]) for k, _ in part.named_parameters() if k.startswith("model.layers.")})
            assert held == list(stages.balance(4, n)[i]), (n, i)  # the other stages' blocks hold no weights here
            h = part(h)
        assert torch.equal(h, ref), (kind, n, (h - ref).abs().max().item())


def test_a_block_that_hands_the_next_more_than_the_hidden_states_is_refused_in_one_line():
    class Carry(nn.Module):  # returns (hidden states, a tensor the next block takes): no stage boundary can cut it
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h, carried=None):
            return self.lin(h), h.sum(-1)

    skipped = hf_split.Skipped(Carry(), 3, hf_split.BlockOutput())
    assert not list(skipped.parameters())
    with pytest.raises(mg.UsageError, match=r"^Carry returns Tensor beside the hidden states, which the next block "
                                            r"takes, but a pipeline stage passes on the hidden states only; use pp=1"):
        skipped(torch.zeros(2, 4))


def test_evaluation_under_a_zero_bubble_schedule_is_refused_on_every_rank_in_one_line():
    """torch 2.13's eval() of zbv runs the split backward anyway and fails on one rank while the other waits
    (a hang until the group's timeout); interleaved 1F1B evaluates."""
    zbv = spawn(w.evaluate_under, 2, "zbv", timeout=240)
    assert zbv[0] == zbv[1] and "\n" not in zbv[0]
    assert zbv[0].startswith("pipeline evaluation under the 'zbv' schedule is not supported by torch's schedules; "
                             "build the evaluation pipeline with schedule '1f1b' or 'interleaved_1f1b'")
    interleaved = spawn(w.evaluate_under, 2, "interleaved_1f1b", timeout=240)
    assert interleaved[0] == "no loss here" and interleaved[1].startswith("loss ")


def test_refusals_stay_one_line_with_the_fix():
    cases = [dict(kind="gpt2", layout={"pp": 2, "micro_batch": 1}, pipeline=True),
             dict(kind="flat", layout={"pp": 2, "micro_batch": 1}, pipeline=True),
             dict(kind="gpt2", layout={"pp": 2, "micro_batch": 1}, overrides={"n_layer": 1}, pipeline=True),
             dict(kind="gpt2", layout={"pp": 2, "micro_batch": 8}, pipeline=True)]
    got = spawn(w.refusals, 2, cases, timeout=240)
    assert got[0] == got[1]  # every rank refuses alike
    lines = got[0]
    assert all("\n" not in line for line in lines), lines
    expect = [
        r"^the tied parameters 0.weight = 1.weight are laid out differently on pipeline stages 0 and 1 \(0.weight "
        r"\[4, 4\] float32, 1.weight \[5, 4\] float32\), so their gradients cannot be summed; give both the same "
        r"sharding \(tensor-parallel style\), or untie them \(transformers: config.tie_word_embeddings=False\)$",
        r"^accepted$",  # GPT-2 under PP: its tie kept, its split found
        r"a pipeline cuts a model into stages of blocks, but Flat has no repeated blocks; give an nn.Sequential",
        r"2 pipeline stages \(pp 2 x 1 per rank, schedule '1f1b'\) but GPT2LMHeadModel has 1 blocks; use pp <= 1",
        r"schedule '1f1b' needs at least as many micro-batches as stages, got 1 micro-batches for 2 stages",
    ]
    assert len(lines) == len(expect)
    for line, pattern in zip(lines, expect):
        assert re.search(pattern, line), (pattern, line)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_the_pipeline_fsdp_and_back(reference, tmp_path):
    """A Llama saved by the Checkpointer (model=pipe.model) after 3 steps under PP 2 resumes under PP 2 and
    under FSDP 2, one saved under FSDP 2 resumes under PP 2, and one saved under interleaved 1F1B (two stages
    per rank, saved as one module of one process's names) under 1F1B: each ends on one process's weights.
    (The pipeline ranks hold different parameters: the optimizer's state is saved per parameter name.)"""
    jobs = [("llama", {}, {"pp": 2}, {"pp": 2}, str(tmp_path / "pp-pp")),
            ("llama", {}, {"pp": 2}, {}, str(tmp_path / "pp-fsdp")),
            ("llama", {}, {}, {"pp": 2}, str(tmp_path / "fsdp-pp")),
            ("llama", DEEP_LLAMA, {"pp": 2, "schedule": "interleaved_1f1b"}, {"pp": 2}, str(tmp_path / "v-pp"))]
    out = spawn(w.resumed_across, 2, jobs, timeout=300)
    for i, (kind, overrides, first, then, _) in enumerate(jobs):
        ref = reference[(kind, tuple(overrides.items()))]
        for rank in out:
            r = rank[i]
            assert len(r["norms"]) == 2, (first, then)  # resumed at step 3, not trained anew
            assert r["norms"] == pytest.approx(ref["norms"][3:], rel=1e-9), (first, then)
            diff = max((r["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])
            assert diff < TOL, (first, then, diff)
