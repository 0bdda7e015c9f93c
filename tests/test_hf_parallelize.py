"""Models people bring, spread by ``mg.parallelize``, train as one process does.

A transformers Llama (grouped-query attention: 4 heads, 2 KV heads), Qwen3 (per-head q/k norms whose weights
the heads share), GPT-2 (its head tied to the token table) and a plain nn.Module of blocks, all built from configs (no download), train 5 AdamW steps in
float64 with accumulation 2 and clipping at 0.5 on gloo ranks; their full weights must equal one
process's within 1e-9 (float64: another summation order moves them ~1e-15, a bug 1e-4 or more; see
tests/_gpt_layouts.py). The user's code differs from the one-process script by 3 lines (the layout,
``mg.parallelize``, the layout's batch plan; ``# +layout`` in tests/_hf_layouts.py).
"""

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.parallel import auto
from multigpu.testing import spawn

import _hf_layouts as hf

TOL = 1e-9

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[datasets])")

TWO = [("llama", {"tp": 2}), ("llama", {}), ("llama", {"dp_replicate": 2}), ("gpt2", {}), ("gpt2", {"dp_replicate": 2}),
       ("own", {"tp": 2}), ("own", {}), ("qwen3", {"tp": 2}), ("llama", {"pp": 2})]
FOUR = [("llama", {"tp": 2}), ("llama", {"dp_replicate": 2}), ("gpt2", {"dp_replicate": 2}), ("own", {"tp": 2}),
        ("qwen3", {"tp": 2}), ("llama", {"pp": 2})]


@pytest.fixture(scope="module")
def reference():
    kinds = ["llama", "gpt2", "own", "qwen3"]
    return dict(zip(kinds, spawn(hf.train_layouts, 1, [(k, {}) for k in kinds], timeout=240)[0]))


@pytest.fixture(scope="module")
def two_ranks():
    out = spawn(hf.train_layouts, 2, TWO, timeout=300)
    return [[rank[i] for rank in out] for i in range(len(TWO))]


def _max_diff(got, ref):
    assert sorted(got["state"]) == sorted(ref["state"])
    return max((got["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])


def _check(jobs, results, reference, measured):
    for (kind, layout), per_rank in zip(jobs, results):
        name = f"{kind} {layout or 'fsdp'}"
        for r in per_rank:
            diff = _max_diff(r, reference[kind])
            measured[name] = max(diff, measured.get(name, 0.0))
            assert diff < TOL, f"{name}: max parameter difference {diff:.3g}"
            assert r["norms"] == pytest.approx(reference[kind]["norms"], rel=1e-9), name
    print("max parameter difference per layout:", {k: f"{v:.1e}" for k, v in measured.items()})


def test_llama_gpt2_and_own_model_under_tp_fsdp_and_ddp_on_two_ranks_equal_one_process(reference, two_ranks):
    _check(TWO, two_ranks, reference, {})
    assert [r[0].get("strategy") for r in two_ranks] == ["none", "fsdp", "ddp", "fsdp", "ddp", "none", "fsdp", "none", None]
    assert [r[-1]["stages"] for r in two_ranks[-1:]] == [[1]]  # 1F1B over 2 stages: rank 1 runs the last
    assert min(reference["llama"]["norms"]) > 0.5  # clipping acted


@pytest.mark.slow
def test_fsdp_x_tp_and_hsdp_on_four_ranks_equal_one_process(reference):
    out = spawn(hf.train_layouts, 4, FOUR, timeout=400)
    results = [[rank[i] for rank in out] for i in range(len(FOUR))]
    _check(FOUR, results, reference, {})
    assert [r[0].get("strategy") for r in results] == ["fsdp", "fsdp", "fsdp", "fsdp", "fsdp", None]  # then PP 2 x FSDP 2


def test_bad_input_is_refused_in_one_line_with_the_fix():
    cases = [
        dict(kind="llama", layout={"tp": 2}, tp_plan={"model.layers.*.mlp.dwn_proj": "rowwise"}),
        dict(kind="llama", layout={"tp": 2}, overrides={"num_key_value_heads": 1}),
        dict(kind="llama", layout={"tp": 2}, overrides={"hidden_size": 48, "num_attention_heads": 3,
                                                      "num_key_value_heads": 3}),
        dict(kind="conv", layout={"tp": 2}),
        dict(kind="gpt2", layout={"tp": 2}),
        dict(kind="llama", layout={"tp": 2}, tp_plan={}),
        dict(kind="llama", layout={"tp": 2}, tp_plan={"model.norm": "colwise"}),
        dict(kind="llama", layout={"tp": 2, "dp_shard": 2}),
        dict(kind="llama", layout={"tp": 2}, tp_plan={"lm_head": "local_packed_rowwise"}),
        dict(kind="flat", layout={"pp": 2, "micro_batch": 1}, pipeline=True),
        dict(kind="gpt2", layout={"pp": 2, "micro_batch": 1}, pipeline=True),
        dict(kind="llama", layout={"pp": 2, "micro_batch": 1}, overrides={"num_hidden_layers": 1}, pipeline=True),
        dict(kind="llama", layout={"pp": 2, "micro_batch": 8}, pipeline=True),
        # The probe (parallel/probe.py) on every model, called as the user's loop calls it:
        dict(kind="heads", layout={"tp": 2}),  # an own model's view by its head count: the found plan breaks it
        dict(kind="ids", layout={"cp": 2}),  # an own model whose first argument is named input_ids
        dict(kind="blocks", layout={"tp": 2}),  # floats into a LayerNorm first: no probe batch for a found plan
        dict(kind="blocks", layout={"tp": 2}, tp_plan={"*.mlp.up": "colwise", "*.mlp.down": "rowwise"}),
        dict(kind="mixing_moe", layout={"ep": 2}),  # experts whose result depends on the rows they are given
        dict(kind="dropout", layout={}),  # FSDP 2: random draws named, not refused
        dict(kind="phimoe_jitter", layout={}),
        dict(kind="own", layout={}),  # nothing random: nothing said
    ]
    got = spawn(hf.refusals, 2, cases, timeout=240)
    assert [line.partition(" | said: ")[0] for line in got[1]] == [line.partition(" | said: ")[0] for line in got[0]]
    lines = got[0]
    assert all("\n" not in line for line in lines), lines
    expect = [
        r"plan names modules LlamaForCausalLM does not have: model.layers.\*.mlp.dwn_proj; use names from "
        r"model.named_modules\(\).*e.g. model.layers.0.self_attn.q_proj",
        r"tensor-parallel degree 2 does not divide KV heads 1 of LlamaForCausalLM; use tp=1",
        r"tensor-parallel degree 2 does not divide attention heads 3, KV heads 3 of LlamaForCausalLM; use tp=1",
        r"found no plan for ConvNet: it declares none and its blocks hold Conv2d, no q/k/v/o or gate/up/down "
        r"Linears; use tp=1 \(DDP or FSDP shard any model\)",
        r"^accepted$",  # GPT-2 under TP: its Conv1D and fused c_attn sharded (tests/test_hf_gpt2_tp.py)
        r"the tensor-parallel plan for LlamaForCausalLM is empty \(given\)",
        r"shards model.norm column-wise, but it is a LlamaRMSNorm: .*drop it from the plan",
        r"dp_shard 2 x tp 2 = 4 processes, but this job has 2; run on 4 processes",
        r"gives lm_head the style 'local_packed_rowwise', which multigpu does not translate; use one of colwise",
        r"a pipeline cuts a model into stages of blocks, but Flat has no repeated blocks; give an nn.Sequential",
        r"^accepted$",  # GPT-2 under PP: its tied head gets a copy on the last stage (tests/test_hf_pipeline.py)
        r"2 pipeline stages \(pp 2 x 1 per rank, schedule '1f1b'\) but LlamaForCausalLM has 1 blocks; use pp <= 1",
        r"schedule '1f1b' needs at least as many micro-batches as stages, got 1 micro-batches for 2 stages",
        r"^tensor-parallel plan found in the blocks breaks HeadsLM's forward on a probe batch \(RuntimeError: shape "
        r"'\[2, 16, 4, 8\]' is invalid for input of size 512\): .*; use tp=1 for this model",
        r"^accepted$",
        r"^tensor parallelism found a plan in Sequential's blocks but cannot check it on a probe batch: its forward "
        r"takes no input multigpu can make .*; pass tp_plan=.* \(a plan you give is taken unchecked\) or use tp=1$",
        r"^accepted \| said: mg.parallelize: tensor parallel 2: plan given, 2 entries on 4 modules: .*; not checked on a probe "
        r"batch \(its forward takes no input multigpu can make",
        r"^expert parallelism \(ep=2\) changes MixingMoE's output on a probe batch \(relative error \d\.\de-\d\d, "
        r"torch.float64 allows 1e-09\); use ep=1 for this model",
        r"^accepted \| said: mg.parallelize: note: DropLM draws random numbers in its training forward \(Dropout\(p=0.1\) "
        r"drop\): each of the 2 processes draws its own, .*set them to 0$",
        r"^accepted \| said: mg.parallelize: note: PhimoeForCausalLM draws random numbers in its training forward "
        r"\(router_jitter_noise=0.01\)",
        r"^accepted$",
    ]
    import re

    assert len(lines) == len(expect)
    for line, pattern in zip(lines, expect):
        assert re.search(pattern, line), (pattern, line)


def test_a_layout_for_more_ranks_than_the_job_has_and_pp_are_refused_before_any_group_work(monkeypatch):
    with pytest.raises(mg.UsageError, match=r"world size 1 is not divisible by dp_replicate 1 x tp 2 = 2"):
        mg.parallelize(hf.build("own"), mg.parallel.Layout(tp=2))
    # pp changes the loop (the schedule runs forward and backward): mg.parallelize names the call that does it.
    monkeypatch.setattr("multigpu.parallel.spread._world", lambda: (0, 2))
    with pytest.raises(mg.UsageError, match=r"pp=2 splits TinyLM into pipeline stages.*mg.parallel.pipeline"):
        mg.parallelize(hf.build("own"), mg.parallel.Layout(pp=2))


def test_blocks_and_plans_are_read_from_what_the_model_declares_or_found_in_it():
    llama, gpt2, own = hf.build("llama"), hf.build("gpt2"), hf.build("own")
    assert auto.blocks_of(llama) == ([type(llama.model.layers[0])], "declared _no_split_modules")
    assert auto.blocks_of(gpt2)[0] == [type(gpt2.transformer.h[0])]
    assert auto.blocks_of(own) == ([hf.Block], "found repeated")
    assert auto.blocks_of(hf.ConvNet()) == ([hf.ConvBlock], "found repeated")
    assert auto.blocks_of(nn.Linear(2, 2)) == ([], "none found")
    plan = auto.declared_plan(llama)
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise" and plan["lm_head"] == "colwise_gather_output"
    assert auto.declared_plan(gpt2) is None  # GPT-2 declares no plan: found or refused, never silently empty
    expanded = auto.expand(llama, plan)
    assert {k for k in expanded if k.endswith("down_proj")} == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    found = auto.found_plan(own, auto.block_modules(own, [hf.Block]))
    assert found["blocks.1.attn.o"] == "rowwise" and found["blocks.0.mlp.up"] == "colwise" and len(found) == 12
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head = auto.translate("colwise_gather_output", "lm_head")
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert isinstance(auto.translate("embedding_rowwise", "e"), RowwiseParallel)
    assert auto.translate("replicate", "x") is None
    assert auto.head_counts(llama) == {"attention heads": 4, "KV heads": 2}
    assert auto.head_counts(own) == {"attention heads": 4}


def test_the_block_stack_is_the_one_a_pipeline_cuts_and_forecast_counts():
    """auto.block_stack: the longest container whose children are (or hold) blocks_of's blocks. Forecast counted
    the longest ModuleList of all before: a block's own list of attentions (LongCat-Flash), a vision tower's
    (Phi-4-multimodal), one parallel list of two (XLM: attentions; now ffns, FSDP's unit). Mixed layers
    (Mllama), a declared class inside the layers (RoBERTa-PreLayerNorm) and one block (test_tune's OneLM) stay."""
    import _zoo
    from multigpu.recipes.gpt.model import GPT, GPTConfig

    def stack(model):
        found = auto.block_stack(model)
        return found and (found[0], len(found[1]))

    assert stack(hf.build("llama")) == ("model.layers", 2) and stack(hf.build("gpt2")) == ("transformer.h", 2)
    assert stack(GPT(GPTConfig())) == ("blocks", 2) and stack(hf.ConvNet()) == ("stage", 2)
    assert stack(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) is None  # a pipeline cuts it by its children
    with torch.device("meta"):
        built = {f: getattr(transformers, _zoo.families()[f])(_zoo.tiny_config(f)) for f in
                 ("longcat_flash", "phi4_multimodal", "xlm", "mllama", "roberta-prelayernorm") if f in _zoo.families()}
    expected = {"longcat_flash": ("model.layers", 1), "phi4_multimodal": ("model.layers", 2),
                "xlm": ("transformer.ffns", 2), "mllama": ("model.layers", 40),
                "roberta-prelayernorm": ("roberta_prelayernorm.encoder.layer", 2)}
    assert {f: stack(m) for f, m in built.items()} == {f: expected[f] for f in built}


def test_the_layout_owns_its_rules():
    L = mg.parallel.Layout

    def strategy(layout, world):
        return layout.resolve(world).strategy

    assert strategy(L(), 1) == "none" and strategy(L(), 4) == "fsdp" and strategy(L(dp_replicate=4), 4) == "ddp"
    assert strategy(L(dp_replicate=2), 4) == "hsdp" and strategy(L(dp_replicate=2, tp=2), 4) == "hsdp"
    assert strategy(L(tp=2), 4) == "fsdp" and strategy(L(tp=2), 2) == "none"
    # Resolved once: every degree set, the world and the data-parallel size its own; the same layout again.
    resolved = L(tp=2).resolve(8)
    assert resolved == L(dp_shard=4, tp=2) and (resolved.world_size, resolved.dp_size) == (8, 4)
    assert resolved.resolve(8) is resolved and L(tp=2).world_size is None
    with pytest.raises(mg.UsageError, match=r"leaves dp_shard to the world size; use layout.resolve\(world_size\)"):
        L(tp=2).strategy  # noqa: B018
    with pytest.raises(AttributeError, match=r"^Layout.shape is gone; use layout.resolve\(world_size\)"):
        L(tp=2).shape(8)
    # The data-parallel rank is the mesh's (replicate, shard) coordinate: TP peers share it.
    assert [L(tp=2).dp_rank(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [L(dp_replicate=2, tp=2).dp_rank(r, 8) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [L(pp=2).dp_rank(r, 4) for r in range(4)] == [0, 1, 0, 1]
    L(tp=2).check_sizes(heads=4, kv_heads=2, hidden=64, vocab=256)
    with pytest.raises(mg.UsageError, match="does not divide sequence length 15.*use tp=1"):
        L(tp=2, sequence_parallel=True).check_sizes(heads=4, seq=15)
    with pytest.raises(mg.UsageError, match=r"4 pipeline stages \(pp 2 x 2 per rank, schedule 'interleaved_1f1b'\) "
                                            r"but the model has 3 blocks; use pp <= 1"):
        L(pp=2, schedule="interleaved_1f1b").check_sizes(blocks=3)
    with pytest.raises(mg.UsageError, match="sequence_parallel .* but tp is 1"):
        L(sequence_parallel=True)
    with pytest.raises(mg.UsageError, match="layout tp must be a positive integer"):
        L(tp=0)
    with pytest.raises(mg.UsageError, match="unknown pipeline schedule 'fast'"):
        L(schedule="fast")
    plan = L(tp=2, micro_batch=2).plan(16, _Dist(rank=3, world_size=4))
    assert (plan.world_size, plan.dp_rank, plan.accum_steps) == (2, 1, 4)


class _Dist:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


def test_transformers_imports_beside_the_pinned_torch_and_builds_a_tiny_llama():
    model = hf.build("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    logits = model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False).logits
    assert logits.shape == (1, 4, hf.VOCAB)


def test_conv_net_under_ddp_and_fsdp_equals_one_process():
    ref = spawn(hf.train_image_layouts, 1, [("conv", {})])[0][0]
    out = spawn(hf.train_image_layouts, 2, [("conv", {"dp_replicate": 2}), ("conv", {})], timeout=240)
    for i, strategy in enumerate(["ddp", "fsdp"]):
        for rank in out:
            assert rank[i]["strategy"] == strategy
            assert _max_diff(rank[i], ref) < TOL, strategy


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf_resnet18", "resnet18"])
def test_resnet18_under_ddp_and_fsdp_equals_one_process(kind):
    """ResNet-18 with BatchNorm (synchronised across the ranks, so its statistics span one process's batch):
    transformers' (no torchvision needed), and torchvision's where its wheel works beside the CPU torch."""
    problem = hf.torchvision_problem() if kind == "resnet18" else None
    if problem:
        pytest.skip(problem)
    ref = spawn(hf.train_image_layouts, 1, [(kind, {})], timeout=300)[0][0]
    out = spawn(hf.train_image_layouts, 2, [(kind, {"dp_replicate": 2}), (kind, {})], timeout=300)
    diffs = {}
    for i, strategy in enumerate(["ddp", "fsdp"]):
        for rank in out:
            assert rank[i]["strategy"] == strategy
            diffs[strategy] = max(diffs.get(strategy, 0.0), _max_diff(rank[i], ref))
            assert diffs[strategy] < TOL, (strategy, diffs[strategy])
    print(f"{kind}: max parameter difference from one process {diffs}")


@pytest.mark.slow
def test_a_checkpoint_saved_under_one_layout_resumes_under_another(reference, tmp_path):
    """Llama: 3 steps under TP 2, saved (DCP), resumed under FSDP 2 for the last 2: one process's weights."""
    out = spawn(hf.train_in_two_layouts, 2, "llama", {"tp": 2}, {}, str(tmp_path / "ckpt"), timeout=300)
    for r in out:
        assert (r["strategy"], r["start"], len(r["losses"])) == ("fsdp", 3, 2)  # resumed, not trained anew
        assert r["norms"] == pytest.approx(reference["llama"]["norms"][3:], rel=1e-9)  # (losses are per rank's share)
        assert _max_diff(r, reference["llama"]) < TOL, _max_diff(r, reference["llama"])


def test_the_random_draws_probe_leaves_the_model_and_the_generator_as_they_were():
    """mg.parallelize's note runs the model in training mode from two seeds on more than one process only: the
    generator's state, the modules' modes and the buffers (BatchNorm's statistics) must be as before, or the
    processes would go on from another state than one process's."""
    from multigpu.parallel import probe

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(16), nn.Dropout(0.5)).double()
    model[1].eval()
    before, stats = torch.get_rng_state(), model[1].running_mean.clone()
    assert probe.random_draws(model, probe.probe_batch(model, 2)) == "Dropout(p=0.5) 2"
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(model[1].running_mean, stats)
    assert [m.training for m in model] == [True, False, True] and int(model[1].num_batches_tracked) == 0
    model[2].p = 0.0  # still drawn from? nothing reaches the output: nothing to say
    assert probe.random_draws(model, probe.probe_batch(model, 2)) is None
    assert probe.random_draws(hf.build("own"), None) is None  # no batch, no dropout declared
    assert probe.random_draws(hf.PROBED["dropout"]().double(), None) == "Dropout(p=0.1) drop"  # declared
