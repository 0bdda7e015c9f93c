"""Gradient noise scale: estimator against known answers, on 1 process and on gloo ranks.

Known answers:
* synthetic per-example gradients g = mu + L z (covariance Sigma = L L^T): |G|^2 = |mu|^2, tr(Sigma);
* least squares with x ~ N(0, I_d), y = x.w* + eps, eps ~ N(0, s2), at w = w* + delta:
  per-example gradient x (x.delta - eps), so G = delta and
  Sigma = (|delta|^2 + s2) I + delta delta^T  ->  tr(Sigma) = d (|delta|^2 + s2) + |delta|^2.
Tolerances are 4 standard errors, from the spread of the per-step estimates.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as tdist

import multigpu as mg
from multigpu import noise as nz
from multigpu.noise.formulas import DebiasedEMA
from multigpu.testing import spawn

D, S2 = 4, 0.25
DELTA = torch.tensor([0.6, -0.8, 0.0, 0.0])  # |delta|^2 = 1
TRUE_G = float(DELTA.square().sum())
TRUE_T = D * (TRUE_G + S2) + TRUE_G
TRUE_B = TRUE_T / TRUE_G  # 6.0


def _check(values, truth, name):
    """Mean within 4 standard errors of the truth; returns the relative error."""
    v = np.asarray(values, dtype=float)
    se = v.std(ddof=1) / math.sqrt(len(v))
    assert abs(v.mean() - truth) < 4 * se, f"{name}: mean {v.mean():.4g} vs true {truth:.4g} (4 SE = {4 * se:.3g})"
    return abs(v.mean() - truth) / truth


# ---- synthetic gradients (numpy, no model) ---------------------------------------
def _synthetic(rng, trials, k, b, mu, chol):
    z = rng.standard_normal((trials, k, b, len(mu)))
    per_example = mu + z @ chol.T
    g = per_example.mean(axis=2)                 # each rank's gradient
    local = (g**2).sum(-1).mean(1)               # mean_i |g_i|^2, before the all-reduce
    total = (g.mean(1) ** 2).sum(-1)             # |mean_i g_i|^2, after
    return nz.estimate(local, total, b_small=b, b_big=k * b)


def test_synthetic_gradients_match_true_grad_sq_and_trace():
    rng = np.random.default_rng(0)
    mu = np.array([0.5, -1.0, 0.25, 0.0, 2.0])
    chol = np.tril(rng.standard_normal((5, 5)))  # a correlated covariance
    true_t = float(np.trace(chol @ chol.T))
    for k, b in ((2, 16), (4, 8), (8, 4)):
        grad_sq, trace = _synthetic(rng, 20000, k, b, mu, chol)
        _check(grad_sq, float(mu @ mu), f"|G|^2 K={k}")
        _check(trace, true_t, f"tr(Sigma) K={k}")
    # The naive reading (|g|^2 of the big batch as |G|^2) is biased by tr(Sigma)/B: the test can fail.
    z = rng.standard_normal((20000, 32, 5))
    naive = ((mu + z @ chol.T).mean(1) ** 2).sum(-1)
    assert naive.mean() - mu @ mu > 10 * naive.std() / math.sqrt(len(naive))


def test_ratio_of_emas_is_not_biased_like_mean_of_ratios():
    rng = np.random.default_rng(1)
    mu = np.array([1.0, 0.0, 0.0, 0.0])
    chol = np.eye(4) * 1.2                     # tr(Sigma) = 5.76, B_simple = 5.76
    true_b = 5.76
    grad_sq, trace = _synthetic(rng, 12000, 2, 16, mu, chol)
    # Ratio of (debiased) EMAs, as NoiseScale keeps them.
    g_ema, t_ema = DebiasedEMA(), DebiasedEMA()
    beta = math.exp(-32 / 1e9)                 # time constant >> run: ~ the plain average
    for g, t in zip(grad_sq.tolist(), trace.tolist()):
        g_ema.update(g, beta)
        t_ema.update(t, beta)
    ratio_of_emas = t_ema.value() / g_ema.value()
    positive = grad_sq > 0
    mean_of_ratios = float(np.mean(trace[positive] / grad_sq[positive]))
    err_emas, err_ratios = abs(ratio_of_emas / true_b - 1), abs(mean_of_ratios / true_b - 1)
    assert err_emas < 0.03, ratio_of_emas
    assert err_ratios > 5 * err_emas and err_ratios > 0.15, (mean_of_ratios, ratio_of_emas)


def test_debiased_ema_time_constant():
    ema = DebiasedEMA()
    beta = math.exp(-128 / 1280)               # 128 examples a step, tau = 10 steps
    ema.update(5.0, beta)
    assert ema.value() == pytest.approx(5.0)   # debiased: the first value, not 5 * (1 - beta)
    for _ in range(10):
        ema.update(1.0, beta)
    # after one time constant the old value keeps weight e^-1 (debiased over the total weight)
    assert ema.value() == pytest.approx(1 + 4 * math.exp(-1) * (1 - beta) / (1 - beta**11), rel=1e-9)
    for _ in range(300):
        ema.update(1.0, beta)
    assert ema.value() == pytest.approx(1.0, abs=1e-9)


def test_formulas_efficiency_gain_steps():
    assert nz.efficiency(1000, 1000) == 0.5
    assert nz.gain(128, 128, 500.0) == pytest.approx(1.0)
    assert nz.gain(1024, 128, 1e12) == pytest.approx(8.0)
    assert nz.gain(1024, 128, 0.0) == pytest.approx(1.0)
    # (S/Smin - 1)(E/Emin - 1) = 1 with E/Emin = 1/efficiency
    b, phi = 300.0, 900.0
    assert (nz.steps_factor(b, phi) - 1) * (1 / nz.efficiency(b, phi) - 1) == pytest.approx(1.0)


# ---- least squares, real model gradients ----------------------------------------
def _batch(gen, n):
    x = torch.randn(n, D, generator=gen)
    y = torch.randn(n, generator=gen) * math.sqrt(S2)   # w* = 0, so y is the noise
    return x, y


def _linear():
    model = torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(DELTA[None])
    return model


def _loss(model, x, y, accum):
    return 0.5 * (model(x).squeeze(1) - y).square().mean() / accum


class _ConstScale:
    def __init__(self, s):
        self.s = s

    def get_scale(self):
        return self.s


def test_one_process_uses_micro_batches_and_skips_nonfinite():
    gen = torch.Generator().manual_seed(3)
    plan = mg.BatchPlan(global_batch=64, world_size=1, micro_batch=16)
    model = _linear()
    noise = mg.NoiseScale(plan, tau=1e12, scaler=_ConstScale(256.0), sync_every=1).attach(model)
    gs, ts = [], []
    for step in range(1500):
        for j in range(plan.accum_steps):
            x, y = _batch(gen, plan.micro_batch)
            loss = _loss(model, x, y, plan.accum_steps) * 256.0
            if step == 7 and j == 1:
                loss = loss * math.inf            # an fp16 overflow
            loss.backward()
        model.zero_grad(set_to_none=True)
        if step != 7:
            gs.append(float(noise.last["grad_sq"]))
            ts.append(float(noise.last["trace_cov"]))
    m = noise.metrics()
    assert m["noise/skipped_steps"] == 1 and m["noise/measured_steps"] == 1499
    err_g, err_t = _check(gs, TRUE_G, "|G|^2"), _check(ts, TRUE_T, "tr(Sigma)")
    assert m["noise/b_simple"] == pytest.approx(np.mean(ts) / np.mean(gs), rel=1e-9)
    assert abs(m["noise/b_simple"] / TRUE_B - 1) < 0.1
    print(f"one process, 4 micro-batches: rel. error |G|^2 {err_g:.3f}, tr {err_t:.3f}, B_simple {m['noise/b_simple']:.3f} (true {TRUE_B})")
    assert "B_simple ~ 6 examples" in noise.summary()
    # After detach, training goes on unmeasured.
    noise.detach()
    for _ in range(plan.accum_steps):
        _loss(model, *_batch(gen, plan.micro_batch), plan.accum_steps).backward()
    assert noise.metrics()["noise/measured_steps"] == 1499


def test_one_process_needs_accumulation():
    with pytest.raises(mg.UsageError, match="accum_steps >= 2"):
        mg.NoiseScale(mg.BatchPlan(64, 1)).attach(_linear())
    with pytest.raises(mg.UsageError, match="every"):
        mg.NoiseScale(mg.BatchPlan(64, 1), every=0)


def _exact_errors(dist, static: bool, counts: list) -> list[float]:
    world, rank = dist.world_size, dist.rank
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = mg.wrap(ref, "ddp", bucket_cap_mb=1e-4, static_graph=static)  # tiny buckets: several per step
    plan = mg.BatchPlan(global_batch=8 * world, world_size=world)
    noise = mg.NoiseScale(plan, sync_every=1).attach(model)
    gen = torch.Generator().manual_seed(100 + rank)
    errs = []
    for step in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        g_i = torch.cat([g.flatten() for g in torch.autograd.grad(((ref(x) - y) ** 2).mean(), list(ref.parameters()))])
        gathered = [torch.empty_like(g_i) for _ in range(world)]
        tdist.all_gather(gathered, g_i)
        local_ref = float(torch.stack([g.double().square().sum() for g in gathered]).mean())
        total_ref = float(torch.stack(gathered).double().mean(0).square().sum())
        ((model(x) - y) ** 2).mean().backward()
        model.zero_grad(set_to_none=True)
        m = noise.metrics()  # lands the step's all-reduce (asynchronous) and folds it
        if static and step == 0:
            continue
        errs.append(abs(float(noise.last["local_sq"]) / local_ref - 1))
        errs.append(abs(float(noise.last["total_sq"]) / total_ref - 1))
    counts.append(int(m["noise/measured_steps"]))
    return errs


def _ddp_worker(dist, steps, accum):
    world, rank = dist.world_size, dist.rank
    out = {}
    # (a) exact: the norms read at the end of the backward equal all-gathered reference gradients;
    # with static_graph too, whose first backward reduces before NoiseScale can read it (not measured).
    errs, counts = [], []
    for static in (False, True):
        errs += _exact_errors(dist, static, counts)
    out["exact_rel_err"], out["exact_counts"] = max(errs), counts
    # (b) least squares, accumulation under no_sync, DDP's own (C++) all-reduce.
    # (c) the same with DDP's fp16 compression hook, mg.Precision('fp16')'s GradScaler and one inf step.
    for name, hook, scale in (("plain", None, False), ("fp16", "fp16", True)):
        model = mg.wrap(_linear(), "ddp", comm_hook=hook)
        plan = mg.BatchPlan(global_batch=16 * accum * world, world_size=world, micro_batch=16)
        amp = mg.Precision("fp16" if scale else "fp32", "cpu")
        noise = mg.NoiseScale(plan, tau=1e12, scaler=amp, sync_every=1).attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lets the scaler adapt; the weights stay put
        gen = torch.Generator().manual_seed(7 + rank)
        gs, ts = [], []
        for step in range(steps if name == "plain" else steps // 3):
            micro_batches = [_batch(gen, plan.micro_batch) for _ in range(accum)]
            for j, (x, y) in enumerate(mg.accumulate(model, micro_batches)):
                loss = amp.scale(_loss(model, x, y, accum))   # fp32 loss, scaled by 65536 under fp16
                if scale and step == 5 and j == accum - 1 and rank == 1:
                    loss = loss * math.inf
                loss.backward()
            amp.step(opt)
            model.zero_grad(set_to_none=True)
            noise.metrics()
            if math.isfinite(noise.last["grad_sq"]) and math.isfinite(noise.last["trace_cov"]):
                gs.append(float(noise.last["grad_sq"]))
                ts.append(float(noise.last["trace_cov"]))
        out[name] = {"gs": gs, "ts": ts, "metrics": noise.metrics(), "summary": noise.summary(),
                     "amp_skipped": amp.skipped_steps}
    # (d) sharded gradients (what FSDP leaves): shard norms summed across ranks give the same numbers.
    gen = torch.Generator().manual_seed(11 + rank)
    model = _linear()
    plan = mg.BatchPlan(global_batch=16 * world, world_size=world)
    sharded, replicated = mg.NoiseScale(plan, sync_every=5), mg.NoiseScale(plan, sync_every=5)  # one all-reduce
    for _ in range(5):
        x, y = _batch(gen, 16)
        (g,) = torch.autograd.grad(_loss(model, x, y, 1), [model.weight])
        g = g.flatten()
        avg = g.clone()
        tdist.all_reduce(avg)
        avg /= world
        shard = avg.tensor_split(world)[rank]  # uneven shards, as FSDP pads
        sharded.observe(g.square().sum(), shard.square().sum(), sharded=True)
        replicated.observe(g.square().sum(), avg.square().sum())
    out["sharded"], out["replicated"] = sharded.metrics(), replicated.metrics()
    try:
        mg.NoiseScale(plan).attach(mg.wrap(_linear(), "ddp", gradient_as_bucket_view=True))
    except mg.UsageError as err:
        out["view_error"] = str(err)
    return out


def test_ddp_ranks_match_closed_form():
    world = 3   # an odd world: nothing relies on pairs of ranks
    res = spawn(_ddp_worker, world, 450, 2, timeout=240)
    r0 = res[0]
    assert r0["exact_rel_err"] < 1e-6
    assert r0["exact_counts"] == [3, 2]   # static_graph: the first step is not measured
    for name in ("plain", "fp16"):
        rec = r0[name]
        m = rec["metrics"]
        err_g, err_t = _check(rec["gs"], TRUE_G, f"{name} |G|^2"), _check(rec["ts"], TRUE_T, f"{name} tr(Sigma)")
        # The overflowing steps (the injected inf; fp16 compression of gradients scaled by 65536)
        # are exactly those the GradScaler skipped.
        assert m["noise/skipped_steps"] == rec["amp_skipped"]
        assert (m["noise/skipped_steps"] >= 1) == (name == "fp16")
        assert m["noise/measured_steps"] == len(rec["gs"])
        err_b = abs(m["noise/b_simple"] / TRUE_B - 1)
        print(f"{world} ranks {name}: rel. error |G|^2 {err_g:.3f}, tr {err_t:.3f}, B_simple {m['noise/b_simple']:.3f} (true {TRUE_B})")
        # 4 standard errors of the ratio (relative errors of the two means add in quadrature)
        n = len(rec["gs"])
        rel_se = math.hypot(np.std(rec["gs"]) / np.mean(rec["gs"]), np.std(rec["ts"]) / np.mean(rec["ts"])) / math.sqrt(n)
        assert err_b < 4 * rel_se, (err_b, rel_se)
        # every rank holds the same numbers
        assert all(r[name]["metrics"]["noise/b_simple"] == pytest.approx(m["noise/b_simple"], rel=1e-9) for r in res)
    for key in ("noise/grad_sq", "noise/trace_cov"):
        assert r0["sharded"][key] == pytest.approx(r0["replicated"][key], rel=1e-6)  # fp32 sums in another order
    assert "global batch" in r0["plain"]["summary"]
    assert "gradient_as_bucket_view=False" in r0["view_error"]


def test_digits_recipe_reports_the_noise_scale(monkeypatch, capfd, tmp_path):
    from multigpu.recipes import digits

    monkeypatch.delenv("RANK", raising=False)
    res = digits.main(["--epochs", "5", "--micro-batch", "16", "--noise-every", "1", "--log-dir", str(tmp_path / "a")])
    out = capfd.readouterr().out
    assert res["noise/measured_steps"] == 5 * 22 and res["noise/skipped_steps"] == 0
    assert 10 < res["noise/b_simple"] < 500                       # 47 measured at this point
    assert "noise scale" in out and "B_simple ~" in out and "per-example efficiency" in out
    # One process without micro-batches cannot measure: one line, exit 2.
    with pytest.raises(SystemExit) as exc:
        digits.main(["--epochs", "1", "--noise-every", "1", "--log-dir", str(tmp_path / "b")])
    err = capfd.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0 and "accum_steps >= 2" in err


@pytest.mark.gpu
def test_cuda_one_process_matches_closed_form():
    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(3)
    plan = mg.BatchPlan(global_batch=256, world_size=1, micro_batch=64)
    model = _linear().to(device)
    amp = mg.Precision("fp16", device)
    noise = mg.NoiseScale(plan, tau=1e12, scaler=amp).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(400):
        for _ in range(plan.accum_steps):
            x = torch.randn(plan.micro_batch, D, generator=gen, device=device)
            y = torch.randn(plan.micro_batch, generator=gen, device=device) * math.sqrt(S2)
            amp.scale(_loss(model, x, y, plan.accum_steps)).backward()
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    # Batches of 1, 2, ..., 32, then 64 (383 steps): 17 wait on the device, no host work per step.
    assert len(noise._steps) == 17 and not noise.estimates.pending
    m = noise.metrics()
    assert not noise._steps and m["noise/measured_steps"] + m["noise/skipped_steps"] == 400
    assert abs(m["noise/b_simple"] / TRUE_B - 1) < 0.1


# ---- FSDP2: the same numbers as DDP, read from the reduce-scatter ------------------
class _Block(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _fsdp_worker(dist, steps, strategies=("ddp", "fsdp")):
    world, rank = dist.world_size, dist.rank
    plan = mg.BatchPlan(global_batch=8 * 2 * world, world_size=world, micro_batch=8)  # 2 micro-batches per step
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        net = torch.nn.Sequential(_Block(6), _Block(6), torch.nn.Linear(6, 3))
        kw = {"block_classes": [_Block]} if strategy == "fsdp" else {}
        model = mg.wrap(net, strategy, **kw)   # fsdp: three FSDP modules, three reduce-scatters per step
        noise = mg.NoiseScale(plan, tau=1e12, every=2, sync_every=16).attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            micro_batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(2)]
            for x, y in mg.accumulate(model, micro_batches):
                (((model(x) - y) ** 2).mean() / plan.accum_steps).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[strategy + " before flush"] = noise.metrics()["noise/measured_steps"]
        noise.flush()
        out[strategy] = noise.metrics()
    # fp16 reduce-scatters are pre-divided by a factor FSDP keeps to itself: refused, with the fix.
    model = mg.wrap(torch.nn.Linear(6, 3), "fsdp", param_dtype="fp16")
    mg.NoiseScale(plan).attach(model)
    try:
        model(torch.randn(8, 6)).float().square().mean().backward()
    except mg.UsageError as err:
        out["fp16_error"] = str(err)
    # A plan that counts tensor-parallel ranks as data-parallel ones: refused at attach, with the fix.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    tp_model = mg.parallel.apply_tp(torch.nn.Sequential(torch.nn.Linear(6, 4)), mesh["tp"], {"0": ColwiseParallel()})
    try:
        mg.NoiseScale(plan).attach(fully_shard(tp_model, mesh=mesh["dp"]))
    except mg.UsageError as err:
        out["tp_error"] = str(err)
    # Replicas of one-rank shards: FSDP reduces without a reduce-scatter, so there is nothing to read.
    replicated = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    try:
        mg.NoiseScale(plan).attach(fully_shard(torch.nn.Linear(6, 3), mesh=replicated))
    except mg.UsageError as err:
        out["replicate_error"] = str(err)
    return out


def test_fsdp_reads_the_same_norms_as_ddp():
    res = spawn(_fsdp_worker, 2, 66, timeout=240)
    ddp, fsdp = res[0]["ddp"], res[0]["fsdp"]
    # 66 steps, one in 2 measured: 33; averaged across ranks in batches of 1, 2, 4, 8, 16 (31),
    # the last 2 by flush().
    assert res[0]["ddp before flush"] == res[0]["fsdp before flush"] == 31
    assert ddp["noise/measured_steps"] == fsdp["noise/measured_steps"] == 33
    for key in ("noise/grad_sq", "noise/trace_cov"):
        assert fsdp[key] == pytest.approx(ddp[key], rel=1e-5)   # fp32 gradients reduced in another order (seen: 1e-7)
    assert res[1]["fsdp"] == res[0]["fsdp"]
    assert "reduce_dtype='fp32'" in res[0]["fp16_error"] and "\n" not in res[0]["fp16_error"]
    assert "spread over 2 tensor-parallel ranks, but the job has 1" in res[0]["tp_error"]
    assert "layout.plan(...)" in res[0]["tp_error"] and "\n" not in res[0]["tp_error"]
    assert "mg.wrap(model, 'ddp')" in res[0]["replicate_error"]


def test_a_tensor_parallel_degree_no_parameter_has_is_refused():
    """world / plan.world_size = 2, but nothing is tensor-parallel (pipeline stages, say): one line."""
    from multigpu.noise import layout

    with pytest.raises(mg.UsageError, match="no parameter is spread over 2 tensor-parallel ranks"):
        layout.tensor_parallel([("w", torch.nn.Parameter(torch.zeros(2)))], tp=2)


# ---- tensor parallelism: each rank's part of the norms, by how many ranks hold it ----------
def _grad_sq(model) -> float:
    return sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)


def _tp_worker(dist, layouts, steps=6, accum=2):
    """The tiny GPT under each layout, no optimizer step (the weights stay): NoiseScale's numbers
    against the same estimator fed the exact norms of an unsharded copy on every rank."""
    import torch.nn.functional as F

    from multigpu.noise.estimates import Estimates
    from multigpu.recipes.gpt.model import GPT, config
    from multigpu.recipes.gpt.parallelize import spread

    cfg = config("tiny", block_size=16)
    data = torch.randint(0, 256, (steps * 8, 17), generator=torch.Generator().manual_seed(1))
    out = {}
    for layout in layouts:
        torch.manual_seed(0)
        ref = GPT(cfg)
        model = copy.deepcopy(ref)
        layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
        layout = dataclasses.replace(layout, micro_batch=8 // layout.dp_size // accum)
        model = spread(model, layout, verbose=False)
        plan = layout.plan(8, dist)
        noise = mg.NoiseScale(plan, tau=1e12, sync_every=4).attach(model)
        exact = Estimates(plan.global_batch, 1e12, 1)

        def loss(net, seqs, n):
            return F.cross_entropy(net(seqs[:, :-1]).flatten(0, 1), seqs[:, 1:].flatten()) / n

        for k in range(steps):
            batch = data[8 * k:8 * k + 8]
            rank_batches = batch.split(plan.rank_batch)
            micro = rank_batches[layout.dp_rank(dist.rank)].split(plan.micro_batch)
            for seqs in mg.accumulate(model, list(micro)):
                loss(model, seqs, accum).backward()
            model.zero_grad(set_to_none=True)
            # The small batches: the data-parallel ranks' (several), the micro-batches (one).
            small = rank_batches if layout.dp_size > 1 else micro
            local = []
            for seqs in small:
                n = len(seqs) // plan.micro_batch
                for part in seqs.split(plan.micro_batch):
                    loss(ref, part, n).backward()
                local.append(_grad_sq(ref))
                ref.zero_grad()
            for part in batch.split(plan.micro_batch):
                loss(ref, part, len(batch) // plan.micro_batch).backward()
            total = _grad_sq(ref)
            ref.zero_grad()
            exact.add(torch.tensor([sum(local) / len(local)], dtype=torch.float64),
                      torch.tensor([total], dtype=torch.float64), [None], len(small[0]))
        noise.flush()
        out[f"{layout.label}, dp rank {layout.dp_rank(dist.rank)}"] = (noise.metrics(), exact.metrics())
    return out


@pytest.mark.slow
def test_hsdp_and_tensor_parallel_layouts_read_the_norms_of_one_process():
    """HSDP 2 x 2 (each shard on 2 ranks), FSDP 2 x TP 2, TP 4 alone with sequence parallel (micro-batches
    are the small batch; the norms' gradients stay partial): the norms of an unsharded copy."""
    layouts = [{"dp_replicate": 2}, {"tp": 2}, {"tp": 4, "sequence_parallel": True}]
    res = spawn(_tp_worker, 4, layouts, timeout=300)
    assert len(res[0]) == 3
    for name, (measured, exact) in res[0].items():
        assert measured["noise/measured_steps"] == 6, name
        for key in ("noise/grad_sq", "noise/trace_cov"):
            assert measured[key] == pytest.approx(exact[key], rel=1e-4), (name, key)
    assert all(list(r.values()) == list(res[0].values()) for r in res)   # keys name each rank's dp rank
