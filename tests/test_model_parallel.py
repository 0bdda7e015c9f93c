"""Model parallelism computes the same training as one process: TP, TP + SP + loss parallel, FSDP x TP, HSDP.

Each layout trains the tiny GPT (tied embeddings) in float64 for 5 AdamW steps
with gradient accumulation 2 and clipping at 0.5 (below the gradient norm, so
it acts) on gloo CPU ranks; its full weights after training must equal one
process's within 1e-9. In float64 another summation order moves them ~1e-14
(measured: 5.6e-15 for TP 2), while a planted bug (a per-rank clip, a missing
all-reduce, a wrong accumulation divisor) moves them 1e-4 or more: in fp32 the
two overlap (a correct TP 2 missed 1e-5 by a hair on an AVX-512 CPU, because
AdamW divides by the root of a tiny gradient's second moment). The
data-parallel ranks read disjoint shares of each global batch, tensor-parallel
peers the same samples (the mesh's data-parallel rank keys the loader).
"""


import copy
import re

import pytest
import torch

import multigpu as mg
from multigpu.recipes.gpt.model import GPT, config
from multigpu.recipes.gpt.parallelize import check_layout
from multigpu.testing import spawn

import _gpt_layouts as layouts

TOL = 1e-9  # max absolute parameter difference after 5 float64 steps (see the module's docstring)
NORM_RTOL = 1e-9  # the gradient norms before clipping, relative


TWO = [{"tp": 2}, {"tp": 2, "sequence_parallel": True, "loss_parallel": True}, {"tp": 2, "activation_checkpointing": True}]
FOUR = [{"tp": 2}, {"tp": 2, "sequence_parallel": True, "loss_parallel": True}, {"dp_replicate": 2}, {"tp": 4}]
MASKED = [{"tp": 2, "masked": True}, {"dp_replicate": 2, "masked": True}]  # 4 ranks: FSDP x TP, HSDP


@pytest.fixture(scope="module")
def reference():
    return spawn(layouts.train, 1, {})[0]


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank layout, trained in one start-up of 2 processes: per layout, the ranks' results."""
    out = spawn(layouts.train_layouts, 2, TWO, timeout=240)
    return [[rank[i] for rank in out] for i in range(len(TWO))]


@pytest.fixture(scope="module")
def four_ranks():
    out = spawn(layouts.train_layouts, 4, FOUR + MASKED, timeout=300)
    return [[rank[i] for rank in out] for i in range(len(FOUR + MASKED))]


def _max_diff(got, ref):
    assert sorted(got["state"]) == sorted(ref["state"])
    return max((got["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])


def _check(results, ref, names):
    for name, per_rank in zip(names, results):
        for r in per_rank:  # every rank ends with the same full weights
            assert _max_diff(r, ref) < TOL, f"{name}: max parameter difference {_max_diff(r, ref):.3g}"
            assert r["norms"] == pytest.approx(ref["norms"], rel=NORM_RTOL), name
            assert r["tied"], f"{name}: the embedding and the head no longer share their weight"


def test_tensor_parallel_with_and_without_sequence_and_loss_parallel_equals_one_process(reference, two_ranks):
    _check(two_ranks[:2], reference, TWO[:2])
    assert "tp=2" in two_ranks[0][0]["mesh"]
    # Clipping acted: the norm before clipping is above the threshold.
    assert min(reference["norms"]) > 0.5


@pytest.mark.slow
def test_fsdp_x_tp_hsdp_and_tp4_equal_one_process(reference, four_ranks):
    _check(four_ranks[:len(FOUR)], reference, FOUR)
    assert [re.sub(r",micro_batch=\d+", "", r[0]["mesh"]) for r in four_ranks[:len(FOUR)]] == [
        "dp_shard=2,tp=2", "dp_shard=2,tp=2,sequence_parallel=true", "dp_replicate=2,dp_shard=2", "tp=4"]


@pytest.mark.slow
def test_masked_targets_over_the_global_token_count_equal_one_process(four_ranks):
    """Sequences ignoring 0-15 of their 16 targets: 2 ranks x 2 micro-batches of 2 train as 1 x 2 of 4."""
    masked_reference = spawn(layouts.train, 1, {"masked": True})[0]
    _check(four_ranks[len(FOUR):], masked_reference, MASKED)


def test_token_divisor_makes_the_gradient_independent_of_the_split():
    """One process: 1, 2, 4 and 8 micro-batches of masked sequences give the same gradient over the global
    token count; the mean of micro-batch means does not (so the multi-rank test above can fail)."""
    import torch.nn.functional as F

    x, y = layouts.tokens(8, masked=True).tensors
    torch.manual_seed(0)
    model = GPT(config("tiny", block_size=layouts.BLOCK))

    def grads(n_micro, exact):
        model.zero_grad()
        micro = list(zip(x.chunk(n_micro), y.chunk(n_micro)))
        for xb, yb in micro:
            logits = model(xb).flatten(0, 1)
            if exact:
                loss = F.cross_entropy(logits, yb.flatten(), reduction="sum") / mg.token_divisor([t for _, t in micro])
            else:
                loss = F.cross_entropy(logits, yb.flatten()) / n_micro
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = grads(1, True)
    for n in (2, 4, 8):
        assert (grads(n, True) - whole).abs().max() < 1e-6
    # Counted targets per sequence: 4 5 11 5 | 9 3 8 5 (the halves hold 25 each, by chance).
    for n in (4, 8):
        assert (grads(n, False) - whole).abs().max() > 1e-3   # the mean of means weighs tokens unequally
    assert float(mg.token_divisor([y])) == float((y != -100).sum())
    assert float(mg.token_divisor([torch.full((2, 3), -100)])) == 1.0   # nothing counted: a zero loss, not 0/0
    with pytest.raises(mg.UsageError, match=r"pass \[y for _, y in micro_batches\]"):
        mg.token_divisor([(x, y)])


def test_mesh_degrees_are_checked_before_any_group_work():
    L = mg.parallel.Layout
    assert L(tp=2, dp_replicate=2).resolve(8) == L(dp_replicate=2, dp_shard=2, tp=2)
    assert L(tp=2).resolve(4).dp_size == 2 and L().resolve(1).world_size == 1
    with pytest.raises(mg.UsageError, match="world size 6 is not divisible by dp_replicate 1 x tp 4 = 4; use tp in 1, 2, 3, 6"):
        L(tp=4).resolve(6)
    with pytest.raises(mg.UsageError, match="use dp_replicate in 1, 2, 4"):
        L(dp_replicate=3).resolve(4)
    with pytest.raises(mg.UsageError, match=r"dp_replicate 1 x dp_shard 4 x tp 2 = 8 processes, but this job has 4"):
        L(tp=2, dp_shard=4).resolve(4)
    with pytest.raises(mg.UsageError, match="tp must be a positive integer"):
        L(tp=0)


def test_tp_degree_must_divide_what_it_shards():
    check_layout(config("tiny"), mg.parallel.Layout(tp=2))
    with pytest.raises(mg.UsageError, match=r"tensor-parallel degree 3 does not divide attention heads 4.*of the GPT; use tp=2"):
        check_layout(config("tiny"), mg.parallel.Layout(tp=3))
    # the sequence only under sequence parallelism, which splits it
    check_layout(config("tiny", block_size=66), mg.parallel.Layout(tp=4))
    with pytest.raises(mg.UsageError, match=r"tensor-parallel degree 4 does not divide sequence length 66 of the GPT; use tp=2"):
        check_layout(config("tiny", block_size=66), mg.parallel.Layout(tp=4, sequence_parallel=True))
    with pytest.raises(mg.UsageError, match="n_embd 65 is not divisible by n_head 4"):
        config("tiny", n_embd=65)


def test_flops_per_token_is_palms_formula_and_the_flop_counter_agrees():
    """6N + 12·L·h·s against torch's FlopCounterMode on a forward + backward (math attention, which it can count)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = config("tiny")
    model = GPT(cfg)
    assert cfg.parameters == sum(p.numel() for p in model.parameters()) < 1_000_000
    assert config("gpt2").parameters == 124_475_904  # GPT-2 small with its vocabulary padded to 50304
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    tokens = x.numel()
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert counter.get_total_flops() == (6 * matmul_weights + attention) * tokens
    # The formula also counts biases and norms in N: within 2 % here, less for larger models.
    assert cfg.flops_per_token() * tokens == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_token_files_and_windows(tmp_path):
    from multigpu.recipes.gpt.data import TokenWindows, builtin_text, prepare_tokens

    directory = prepare_tokens(tmp_path / "tok")
    train = TokenWindows(directory / "train.bin", block_size=32, vocab_size=256)
    val = TokenWindows(directory / "val.bin", block_size=32, vocab_size=256)
    text = builtin_text().encode("utf-8")
    assert len(train.tokens) + len(val.tokens) == len(text)
    assert len(val.tokens) == pytest.approx(0.1 * len(text), abs=1)
    x, y = train[1]
    assert bytes(x.tolist()) == text[32:64] and bytes(y.tolist()) == text[33:65]
    assert len(train) == (len(train.tokens) - 1) // 32
    prepare_tokens(directory)  # kept as it is
    with pytest.raises(mg.UsageError, match="holds token id .* but the model's vocabulary is 100"):
        TokenWindows(directory / "val.bin", block_size=32, vocab_size=100)
    with pytest.raises(mg.UsageError, match="does not exist"):
        TokenWindows(tmp_path / "nope.bin", block_size=32)


def _expected_param_bytes(tp: int, dp_shard: int) -> float:
    """float64 parameter bytes per rank by the reference's formula: TP divides what it shards, FSDP divides the rest.

    Sharded by TP: q, k, v (weights and biases), attention out and MLP down weights, MLP up, and the
    (tied) token table; replicated: the biases after a row-wise layer, the norms, the position table.
    """
    cfg = config("tiny", block_size=layouts.BLOCK)
    h, L = cfg.n_embd, cfg.n_layer
    sharded = L * (12 * h * h + 7 * h) + cfg.vocab_size * h
    replicated = L * 6 * h + cfg.block_size * h + 2 * h
    return 8 * (sharded / tp + replicated) / dp_shard


@pytest.mark.slow
def test_memory_per_rank_follows_the_layout(reference, two_ranks, four_ranks):
    """Parameters, gradients and AdamW state per rank, counted from the tensors each rank holds."""
    ref = reference["bytes"]
    assert ref["params"] == _expected_param_bytes(1, 1)
    measured = [(two_ranks[0][0], 2, 1), (four_ranks[0][0], 2, 2), (four_ranks[2][0], 1, 2), (four_ranks[3][0], 4, 1)]
    for result, tp, shard in measured:
        got = result["bytes"]
        assert got["params"] == pytest.approx(_expected_param_bytes(tp, shard), rel=0.02), (tp, shard)
        assert got["grads"] == pytest.approx(got["params"], rel=0.02)
        # AdamW: two moments per parameter (and a step counter per tensor).
        assert 2 * got["params"] <= got["optimizer"] <= 2 * got["params"] * 1.05
    # FSDP 2 x TP 2 holds about a quarter of one process's state.
    assert four_ranks[0][0]["bytes"]["total"] / ref["total"] == pytest.approx(0.254, abs=0.005)


def test_activation_checkpointing_computes_the_same_and_saves_less(reference, two_ranks):
    """Per-block checkpointing under TP=2: the same weights as one process, a fraction of the saved activations."""
    _check(two_ranks[2:], reference, TWO[2:])
    with_ac, without = two_ranks[2][0]["saved"], two_ranks[0][0]["saved"]
    assert with_ac < 0.5 * without, (with_ac, without)


@pytest.mark.slow
def test_compiled_blocks_compute_the_same(reference, tmp_path, monkeypatch):
    """torch.compile per block (in place: parameter names unchanged) on one process, in fp32 (Inductor's
    CPU kernels are what a user runs): as close to the float64 weights as eager fp32 is.

    The tolerance is what fp32 can hold on this very training, measured, not guessed: eager fp32's
    distance from float64 (1.2e-5 here; AdamW turns a 1e-7 change in a tiny gradient into up to lr).
    Fused kernels round differently, so the compiled weights may sit anywhere in that band, not at
    eager's point in it; 3x the band still refuses a real change of the math (a dropped term or a
    wrong scale moves weights by 1e-3 after 5 steps of lr 1e-3).
    """
    # A cache of its own: Inductor's cache key leaves out ATEN_CPU_CAPABILITY, so kernels generated under
    # avx2 were reused under "default" and failed to build ("'at::vec' has not been declared"; torch 2.13).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fp32 = {"dtype": torch.float32}
    eager, compiled = spawn(layouts.train_layouts, 1, [fp32, {**fp32, "compile": True}], timeout=280)[0]
    assert sorted(compiled["state"]) == sorted(reference["state"])
    band = _max_diff(eager, reference)
    assert 1e-8 < band < 1e-4, band  # fp32 rounding, neither absent nor a bug of its own
    assert _max_diff(compiled, reference) < 3 * band, (_max_diff(compiled, reference), band)


def test_shard_blocks_refuses_block_classes_like_wrap_does():
    """mg.parallelize's FSDP (parallel.fsdp.shard_blocks, not a public way in) checks as mg.wrap(model, 'fsdp')
    does, before any FSDP work (no process group needed to refuse)."""
    from multigpu.parallel.fsdp import shard_blocks

    assert not hasattr(mg.parallel, "shard_blocks")  # one way in: mg.parallelize
    with pytest.raises(mg.UsageError, match="block_classes must be a list of module classes"):
        shard_blocks(torch.nn.Linear(2, 2), None, block_classes=torch.nn.Linear)
    with pytest.raises(mg.UsageError, match=r"block_classes \[Conv2d\] matched no module of Sequential"):
        shard_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), None, block_classes=[torch.nn.Conv2d])


class _Block(torch.nn.Module):
    """A block that counts its forwards: a checkpointed one runs twice a step (the forward, then its recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.runs = torch.nn.Linear(6, 6), 0

    def forward(self, x):
        self.runs += 1
        return x + torch.tanh(self.linear(x))


def test_checkpoint_blocks_recomputes_the_first_k_and_computes_the_same(capsys):
    """Layout(checkpoint_blocks=k): only the first k blocks recompute (Megatron's --recompute-method block), in
    float64 the same gradients as the model without checkpointing; k above the blocks checkpoints them all."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[_Block() for _ in range(4)]).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    plain(x).square().sum().backward()
    for k, runs, line in ((1, [2, 1, 1, 1], "activation checkpointing on the first 1 of 4 blocks"),
                          (5, [2, 2, 2, 2], "activation checkpointing per block")):
        model = copy.deepcopy(plain)
        model.zero_grad(set_to_none=True)
        for block in model:
            block.runs = 0
        layout = mg.parallel.Layout(activation_checkpointing=True, checkpoint_blocks=k)
        mg.parallelize(model, layout, block_classes=[_Block])(x).square().sum().backward()
        assert [block.runs for block in model] == runs, k
        assert line in capsys.readouterr().out
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p.grad - q.grad).abs().max() <= TOL, name
    for bad, fragment in (({"checkpoint_blocks": 2}, "but activation_checkpointing is off; add activation_checkpointing"),
                          ({"activation_checkpointing": True, "checkpoint_blocks": 0},
                           "layout checkpoint_blocks must be a positive integer, got 0")):
        with pytest.raises(mg.UsageError, match=fragment):
            mg.parallel.Layout(**bad)
