"""Expert parallelism's pieces: PyTorch's all-to-all on gloo (uneven and empty splits, gradients through it),
and its refusals, one line each before any group work. Whole models under EP against one process: the zoo
(tests/test_zoo.py, layouts EP 2 and EP 2 + TP 2)."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile

import pytest
import torch

import multigpu as mg
from multigpu.testing import spawn

import _hf_layouts as hf


def _all_to_all(dist) -> dict:
    """Rank 0 sends 0 rows to itself and 3 to rank 1; rank 1 sends 2 to rank 0 and 1 to itself."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    send = [[0, 3], [2, 1]][dist.rank]
    recv = [send_r[dist.rank] for send_r in [[0, 3], [2, 1]]]
    x = (torch.arange(sum(send) * 2, dtype=torch.float64).view(-1, 2) + 100 * dist.rank).requires_grad_()
    y = all_to_all_single_autograd(x, recv, send, torch.distributed.group.WORLD)
    weights = torch.arange(1, y.numel() + 1, dtype=torch.float64).view_as(y)
    (y * weights).sum().backward()
    return {"y": y.detach().tolist(), "grad": x.grad.tolist()}


def test_gloo_all_to_all_takes_uneven_and_empty_splits_and_carries_gradients():
    out = spawn(_all_to_all, 2)
    # rank 0 receives rank 1's first 2 rows; rank 1 receives rank 0's 3 rows, then its own last one
    assert out[0]["y"] == [[100.0, 101.0], [102.0, 103.0]]
    assert out[1]["y"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [104.0, 105.0]]
    # each row's gradient is the weight its receiver gave it, sent back the way it came
    assert out[0]["grad"] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert out[1]["grad"] == [[1.0, 2.0], [3.0, 4.0], [7.0, 8.0]]


def _moe(**overrides):
    import _zoo

    model = _zoo.build("mixtral")
    for k, v in overrides.items():
        setattr(model.config, k, v)
    return model


@pytest.mark.parametrize("layout, world, model, line", [
    (mg.parallel.Layout(ep=2), 2, lambda: hf.build("llama"),
     "expert parallelism (ep=2) spreads the experts of a mixture-of-experts model, but LlamaForCausalLM has no "
     "experts module (3-D expert weights and num_experts); use ep=1"),
    # the degrees suggested are those the same ranks take: on 3, ep 2 would not divide dp_shard 3
    (mg.parallel.Layout(ep=3), 3, _moe, "ep=3 does not divide the 4 experts of MixtralForCausalLM; use ep=1"),
    (mg.parallel.Layout(ep=3), 4, _moe, "ep 3 borrows its ranks from dp_shard (dp_shard x tp = efsdp x ep), but "
                                        "dp_shard 4 is not a multiple of it; use ep in 1, 2, 4"),
    (mg.parallel.Layout(ep=4), 4, lambda: hf.build("own_moe", experts=6),
     "ep=4 does not divide the 6 experts of OwnMoE; use ep in 1, 2"),
    (mg.parallel.Layout(ep=3, tp=2), 4, _moe, "ep 3 takes every tensor-parallel rank (dp_shard x tp = efsdp x ep), "
                                              "but it is not a multiple of tp 2; use ep in 1, 2, 4"),
    (mg.parallel.Layout(ep=8, tp=2), 4, _moe, "ep / tp = 4 borrows its ranks from dp_shard (dp_shard x tp = efsdp x "
                                              "ep), but dp_shard 2 is not a multiple of it; use ep in 1, 2, 4"),
    # with TP: refused before the TP step builds a mesh (no process group here) or changes the model
    (mg.parallel.Layout(ep=2, tp=2, sequence_parallel=True), 4, _moe,
     "expert parallelism with sequence_parallel is not built yet"),
])
def test_what_expert_parallelism_cannot_spread_is_refused_in_one_line(layout, world, model, line, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr("multigpu.parallel.spread._world", lambda: (0, world))
    with pytest.raises(mg.UsageError) as err:
        mg.parallelize(model(), layout, verbose=False)
    assert line in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("factor", [0, -1.0, True, "1.25"])
def test_a_capacity_factor_is_a_positive_number_under_ep(factor, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr("multigpu.parallel.spread._world", lambda: (0, 2))
    with pytest.raises(mg.UsageError, match=r"^capacity_factor caps the tokens each expert takes under expert "
                                            r"parallelism: a number > 0 with ep > 1, got .* with ep=2; leave it out"):
        mg.parallelize(_moe(), mg.parallel.Layout(ep=2), capacity_factor=factor, verbose=False)
    with pytest.raises(mg.UsageError, match=r"got 1.25 with ep=1"):
        mg.parallelize(_moe(), mg.parallel.Layout(), capacity_factor=1.25, verbose=False)


def test_a_capacity_keeps_each_experts_first_pairs_in_token_order():
    from multigpu.parallel.experts import _kept

    flat = torch.tensor([0, 1, 0, 0, 2, 0, 1, 1])  # 8 (token, slot) pairs over 4 experts: capacity ceil(1 x 8/4) = 2
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=4)
    kept, kept_counts = _kept(flat, order, counts, 1.0)
    assert kept.tolist() == [0, 2, 1, 6, 4]  # expert 0's first two pairs, expert 1's first two, expert 2's one
    assert kept_counts.tolist() == [2, 2, 1, 0]
    assert _kept(flat, order, counts, 2.0)[0].tolist() == order.tolist()  # capacity 4: nothing dropped


def test_the_meter_says_when_accumulation_changes_the_router_loss(capsys):
    """Each micro-batch's load-balancing loss: with several a step on several ranks it is not one process's."""
    pytest.importorskip("transformers")
    from multigpu.meter.records import router_note

    model = _moe(output_router_logits=True)
    router_note(model, mg.BatchPlan(16, 2, micro_batch=2))
    out = capsys.readouterr().out.strip()
    assert out.startswith("mg.StepMeter: note: the router's load-balancing loss is each micro-batch's") and \
        "micro_batch=8" in out and "\n" not in out
    for plan, m in ((mg.BatchPlan(16, 2), model), (mg.BatchPlan(16, 1, micro_batch=2), model),
                    (mg.BatchPlan(16, 2, micro_batch=2), _moe(output_router_logits=False))):
        router_note(m, plan)  # one micro-batch a step, one rank, no router loss: nothing to say
        assert capsys.readouterr().out == ""


def test_ep_must_divide_dp_shard_and_is_a_layout_flag():
    """Which ep the other degrees take is one rule, Layout.ep_problem; mg.parallelize refuses by it beside the
    model's experts, where every degree and the experts are known (above), so its suggestions are too."""
    assert mg.parallel.Layout(ep=3, dp_shard=4).ep_problem() == (
        "ep 3 borrows its ranks from dp_shard (dp_shard x tp = efsdp x ep), but dp_shard 4 is not a multiple of it")
    # beside tensor parallelism ep takes every tp rank: a multiple of tp, the rest from dp_shard
    assert mg.parallel.Layout(ep=3, tp=2).ep_problem() == (
        "ep 3 takes every tensor-parallel rank (dp_shard x tp = efsdp x ep), but it is not a multiple of tp 2")
    assert mg.parallel.Layout(ep=8, tp=2, dp_shard=2).ep_problem().startswith(
        "ep / tp = 4 borrows its ranks from dp_shard (dp_shard x tp = efsdp x ep), but dp_shard 2 is not a multiple")
    assert mg.parallel.Layout(ep=4, tp=2, dp_shard=2).ep_problem() is None
    assert mg.parallel.Layout(ep=3).ep_problem() is None  # dp_shard left to the world: decided once it is known
    wide = mg.parallel.Layout(ep=4, tp=2, dp_shard=4)
    assert (wide.ep_dp, wide.efsdp) == (2, 2)
    layout, rest = mg.layout_from_args(["--ep", "2", "--steps", "3"])
    assert layout == mg.parallel.Layout(ep=2) and rest == ["--steps", "3"]
    resolved = layout.resolve(4)
    assert resolved.label == "dp_shard=4,ep=2" and mg.layout_from_args(resolved.flags)[0] == resolved


ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # a large share of the loss


def _mixtral(dist, layout, ckpt=None, stop_after=None):
    import transformers

    transformers.logging.set_verbosity_error()
    return hf.train(dist, "zoo:mixtral", layout, accum=1, ckpt=ckpt, stop_after=stop_after, overrides=ROUTER_LOSS)


# The slow proofs below run in one spawn per world size (on 2 cores a spawn's start-up, torch and
# transformers imported on every rank, costs as much as the runs): 2 ranks, 4 ranks, then one process.
_DIR = tempfile.mkdtemp(prefix="multigpu-experts-")  # made here: the workers import this module anew
atexit.register(shutil.rmtree, _DIR, True)


def _two(dist, where: str) -> dict:
    """EP 2: the families with their router loss; the meter dropless (a), capacity 0.5 (b) and 100 (c);
    steps 0-1 of the reshard chain."""
    reference = hf.train(dist, "own_moe", None, accum=1) if dist.rank == 0 else {}  # a user's own experts
    own = hf.train(dist, "own_moe", {"ep": 2}, accum=1)  # every rank: a collective run
    own = hf.max_diff(own, reference) if dist.rank == 0 else None
    out = {"families": _families_under(dist, [{"ep": 2}]) | {"own MoE module {'ep': 2} on 2 ranks": own},
           "meter": {name: _metered(dist, f"{where}/{name}", factor) for name, factor in (("a", None), ("b", 0.5),
                                                                                         ("c", 100.0))}}
    _mixtral(dist, {"ep": 2}, f"{where}/ckpt", 1)
    return out


def _four_ranks(dist, where: str) -> dict:
    """The 4-rank layouts (``_four``); steps 2 (EP 2 x FSDP 2) and 3 (EP 4) of the reshard chain."""
    out = {"families": _four(dist), "meter_tp": _metered(dist, f"{where}/d", None, {"ep": 2, "tp": 2})}
    _mixtral(dist, {"ep": 2}, f"{where}/ckpt", 2)
    _mixtral(dist, {"ep": 4}, f"{where}/ckpt", 3)
    _mixtral(dist, {"ep": 2, "dp_replicate": 2}, f"{where}/ckpt-hsdp", 2)  # steps 0-2 under HSDP 2 x EP 2
    return out


def _last(dist, where: str) -> dict:
    """One process: trained alone for 5 steps, step 4 of the reshard chain, and steps 3-4 after HSDP x EP."""
    return {"reference": _mixtral(dist, None), "last": _mixtral(dist, {}, f"{where}/ckpt"),
            "after_hsdp": _mixtral(dist, {}, f"{where}/ckpt-hsdp")}


@functools.cache
def _runs() -> dict:
    return {"two": spawn(_two, 2, _DIR, timeout=900)[0], "four": spawn(_four_ranks, 4, _DIR, timeout=900)[0],
            "one": spawn(_last, 1, _DIR, timeout=300)[0]}


@pytest.mark.slow
def test_expert_weights_reshard_from_ep_2_to_ep_2_x_fsdp_2_to_ep_4_to_one_process():
    """Steps 0-1 under EP 2 (2 ranks), 2 under EP 2 x FSDP 2 (4 ranks: the experts' FSDP over efsdp 2), 3
    under EP 4 (an expert each), 4 on one process, each from the last one's checkpoint, the router's loss
    included: the weights of one process trained alone for the 5 steps (DCP reshards the experts'
    DTensors, Shard(0) over ep and FSDP's strided shard over efsdp, like any other)."""
    pytest.importorskip("transformers")
    reference, last = _runs()["one"]["reference"], _runs()["one"]["last"]
    assert last["start"] == 4 and last["norms"] == pytest.approx(reference["norms"][4:], rel=1e-9)
    assert hf.max_diff(last, reference) < 1e-9
    # and from HSDP 2 x EP 2 (the experts' Replicate over dp_replicate, Shard(0) over ep) to one process
    after = _runs()["one"]["after_hsdp"]
    assert after["start"] == 3 and hf.max_diff(after, reference) < 1e-9


FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]  # three transformers MoE families, tiny configs (tests/_zoo.py)


def _families_under(dist, layouts: list[dict]) -> dict:
    """Each family trained 5 AdamW steps (clipping at 0.5) with its router loss, one process and each
    layout: the largest parameter difference per (family, layout)."""
    import transformers

    transformers.logging.set_verbosity_error()
    out = {}
    for family in FAMILIES:
        kind = "zoo:" + family
        reference = hf.train(dist, kind, None, accum=1, overrides=ROUTER_LOSS) if dist.rank == 0 else {}
        for layout in layouts:
            got = hf.train(dist, kind, layout, accum=1, overrides=ROUTER_LOSS)
            out[f"{family} {layout} on {dist.world_size} ranks"] = hf.max_diff(got, reference) if dist.rank == 0 else None
    return out


def _four(dist) -> dict:
    """On 4 ranks: the families under EP 2 x FSDP 2, EP 2 over TP 2 (x FSDP 2), EP 4 over FSDP 2 x TP 2, HSDP 2 x
    EP 2, HSDP 2 x 2 and DDP 4 with their router
    loss; and Mixtral through 2 pipeline stages with EP 2 inside each (over dp_shard 2, and over TP 2), 2
    micro-batches a step (without the router loss, which a pipeline refuses)."""
    out = _families_under(dist, [{"ep": 2}, {"ep": 2, "tp": 2}, {"ep": 4, "tp": 2}, {"ep": 2, "dp_replicate": 2},
                                 {"dp_replicate": 2}, {"dp_replicate": 4}])
    reference = hf.train(dist, "zoo:mixtral", None, accum=2) if dist.rank == 0 else {}
    for degrees in ({"pp": 2, "ep": 2}, {"pp": 2, "tp": 2, "ep": 2}):  # EP over dp_shard; over each stage's tp
        got = hf.train_pipeline(dist, "zoo:mixtral", degrees, accum=2)
        out[f"mixtral {degrees}, no router loss"] = hf.max_diff(got, reference) if dist.rank == 0 else None
    return out


@pytest.mark.slow
def test_three_moe_families_with_their_router_loss_equal_one_process_under_ep_layouts():
    """EP 2 (2 ranks; and a user's own experts module, tests/_hf_layouts.py's OwnMoE); EP 2 x FSDP 2, EP 2 +
    TP 2 (ep over the tp ranks), EP 4 over dp_shard 2 x tp 2, HSDP 2 x EP 2, and without EP HSDP 2 x 2 and DDP 4
    (4 ranks: the router's
    loss over the batch under every data-parallel group); EP 2 inside 2 pipeline stages (Mixtral): within
    1e-9 of one process on every parameter. A
    planted bug fails it: the router loss averaged per rank (7e-3), tokens returned to the wrong rank (1e-2),
    the experts' gradient not divided (1e-3), under HSDP x EP divided as without the replicas (1.7e-4), under
    EP over TP the shares' input gradient not gathered back (5.9e-3)."""
    pytest.importorskip("transformers")
    diffs = _runs()["two"]["families"] | _runs()["four"]["families"]
    print(diffs)
    assert len(diffs) == 3 * 7 + 3
    assert all(d < 1e-9 for d in diffs.values()), diffs


def _metered(dist, log_dir: str, capacity_factor=None, degrees: dict | None = None) -> dict:
    """Mixtral under EP 2 (or ``degrees``), 4 steps through mg.StepMeter (log every 2), with a capacity factor
    or dropless."""
    import transformers

    transformers.logging.set_verbosity_error()
    import torch.nn.functional as F

    model = hf.build("zoo:mixtral")
    layout = mg.parallel.Layout(**(degrees or {"ep": 2}))
    model = mg.parallelize(model, layout, capacity_factor=capacity_factor, verbose=False)
    plan = layout.plan(hf.GLOBAL_BATCH, dist)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mg.StepMeter(dist, plan, log_every=2, log_dir=log_dir, model=model, progress=False, watchdog=None) as meter:
        for _, micro_batches in meter.steps(mg.loader(hf.tokens(), plan, dist, seed=0)):
            for x, y in micro_batches:
                loss = F.cross_entropy(hf.logits_of(model, x).flatten(0, 1), y.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            meter.step_end(loss=loss)
            if meter.step == 4:
                break
    records = [json.loads(line) for line in open(f"{log_dir}/metrics.jsonl")] if dist.rank == 0 else []
    config = mg.unwrap(model).config
    state = {k: hf.full(v) for k, v in mg.unwrap(model).state_dict().items()}
    return {"steps": [r for r in records if r.get("type") == "step"], "state": state,
            "pairs": hf.GLOBAL_BATCH * hf.SEQ * config.num_experts_per_tok * config.num_hidden_layers}


@pytest.mark.slow
def test_the_meter_records_tokens_per_expert_imbalance_drops_and_the_all_to_all_share():
    """Dropless: each interval's tokens per expert add up to every routed (token, slot) pair of its 2 steps
    (summed over the layers, counted once), the imbalance is max/mean >= 1, nothing dropped, the all-to-all a
    share of the step in (0, 1). A capacity factor of 0.5 drops pairs and counts them; one of 100 drops none
    and trains exactly the dropless weights. The run's summary and `multigpu report` carry the figures."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from multigpu.report.run import write_run_report

    runs, where = _runs()["two"]["meter"], Path(_DIR)
    dropless, capped, roomy = runs["a"], runs["b"], runs["c"]
    assert len(dropless["steps"]) == 2
    # under EP over the tp ranks each tp rank routes a share of their common tokens: still each pair once
    over_tp = _runs()["four"]["meter_tp"]
    assert [sum(r["experts"]["tokens"]) for r in over_tp["steps"]] == [2 * over_tp["pairs"]] * 2
    for rec in dropless["steps"]:
        e = rec["experts"]
        assert sum(e["tokens"]) == 2 * dropless["pairs"] and len(e["tokens"]) == 4
        assert e["imbalance"] == max(e["imbalance_by_layer"]) >= 1.0 and len(e["imbalance_by_layer"]) == 2
        assert e["dropped"] == 0 and 0 < e["a2a_share"] < 1 and e["a2a_s"] > 0
    # the summary adds up the measured intervals (the second: the first is the warm-up) and the report says so
    summary = json.loads((where / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["experts"]["tokens"] == dropless["steps"][1]["experts"]["tokens"]
    assert summary["experts"]["a2a_share"] == pytest.approx(dropless["steps"][1]["experts"]["a2a_s"]
                                                            / summary["measured"]["time_s"])
    _, md = write_run_report(where / "a", where / "a" / "report.html")
    page = Path(md).read_text()
    assert "Experts" in page and "tokens per expert" in page and "all-to-all share of step time" in page
    # each rank's expert takes at most ceil(half its pairs / 4 experts): at least half of the interval's pairs
    # go, less one per (expert, layer, rank, step) for the rounding up
    routed = 2 * capped["pairs"]
    assert all(routed / 2 - 4 * 2 * 2 * 2 <= r["experts"]["dropped"] < routed for r in capped["steps"])
    assert all(r["experts"]["dropped"] == 0 for r in roomy["steps"])
    assert hf.max_diff(roomy, dropless) == 0.0 and hf.max_diff(capped, dropless) > 1e-6


def _router_loss(dist) -> dict:
    """Each rank's router logits (1 and 2 sequences of 4 tokens: uneven), a mask, through the gathered loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as original

    from multigpu.parallel.hf import router

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(12, 4, generator=g, dtype=torch.float64) for _ in range(2)]  # 2 layers, 12 tokens, 4 experts
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1]])  # one process: 3 sequences of 4 tokens
    rows, seqs = (slice(0, 4), slice(0, 1)) if dist.rank == 0 else (slice(4, 12), slice(1, 3))
    mine = tuple(f[rows].clone().requires_grad_() for f in full)
    loss = router.batch_loss(original, mine, 4, 2, mask[seqs], torch.distributed.group.WORLD)
    loss.backward()
    whole = tuple(f.clone().requires_grad_() for f in full)
    expected = original(whole, 4, 2, mask)
    expected.backward()
    return {"loss": float(loss), "expected": float(expected),
            "grad": max(float((m.grad - 2 * w.grad[rows]).abs().max()) for m, w in zip(mine, whole))}


def test_the_router_loss_is_the_familys_own_over_every_ranks_tokens_and_mask():
    """The family's own function on the ranks' logits gathered in rank order (with the attention mask),
    each rank's gradient the batch loss's times the ranks (the data-parallel mean divides it again)."""
    pytest.importorskip("transformers")
    for out in spawn(_router_loss, 2):
        assert out["loss"] == out["expected"] and out["grad"] < 1e-15


@pytest.mark.gpu
@pytest.mark.slow
def test_expert_parallelism_on_two_gpus_trains_what_one_gpu_trains(tmp_path, monkeypatch):
    """The CUDA path: NCCL's all-to-all, the experts module's own kernels on the GPU, CUDA events for the
    all-to-all's time. examples/hf_model.py --moe (a Mixtral with its router loss, fp32) under EP 2 on 2 GPUs
    against one GPU, by `multigpu verify` (written for a 2-GPU machine: never run here, none was lent)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs; fewer are visible")
    from pathlib import Path

    from multigpu.verify import verify

    example = str(Path(__file__).resolve().parents[1] / "examples" / "hf_model.py")
    monkeypatch.chdir(tmp_path)  # the example prepares its token file under ./data
    said: list[str] = []
    report = verify(example, args=("--moe",), layouts="dp_shard=2,ep=2", steps=5, out=str(tmp_path / "v"),
                    say=said.append)
    assert report["same"], said


@pytest.mark.parametrize("family, line", [
    ("llama4_text", "expert parallelism (ep=2) sends each routed row to its expert's rank and calls the experts module "
                    "as experts(hidden, top_k_index, top_k_weights), but Llama4ForCausalLM's Llama4TextExperts takes "
                    "(hidden_states): which expert each row is for is not in its call; use ep=1 for this model"),
    ("jetmoe", "but JetMoeForCausalLM's JetMoeParallelExperts takes (inputs, expert_size): which expert each row is for"),
])
def test_experts_called_without_their_routing_are_refused_before_anything_changes(family, line, monkeypatch):
    """Llama-4 calls its experts with the hidden states alone (rows already scaled by the router), JetMoE with
    rows sorted by expert and their counts: the dispatch cannot tell which expert a row is for, so the finder
    leaves them out and ep refuses them in one line (they crashed at the first forward: a TypeError). Whatever
    else the dispatch cannot drive, the probe batch after it refuses (tests/test_hf_parallelize.py, MixingMoE)."""
    pytest.importorskip("transformers")
    import _zoo

    from multigpu.parallel import experts

    model = _zoo.build(family)
    assert experts._candidates(model) and not experts.expert_modules(model)
    assert len(experts.expert_modules(_moe())) == 2  # Mixtral's, called with the routing, still found
    monkeypatch.setattr("multigpu.parallel.spread._world", lambda: (0, 2))
    with pytest.raises(mg.UsageError) as err:
        mg.parallelize(model, mg.parallel.Layout(ep=2), verbose=False)
    assert line in str(err.value) and "\n" not in str(err.value)
