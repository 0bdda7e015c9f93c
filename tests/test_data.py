"""World-size-invariant data order, checked in-process (the loader needs no process group)."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import multigpu as mg
from multigpu.data import eval_batches


def _dist(rank, world):
    return mg.Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                   device=torch.device("cpu"), backend="gloo")


def _indices(n):
    return TensorDataset(torch.arange(n))


def _global_batches(n, global_batch, world, micro=None, epochs=2, seed=3):
    """Per epoch, per step: the concatenation over ranks of every rank's micro-batches."""
    plan = mg.BatchPlan(global_batch, world, micro_batch=micro)
    loaders = [mg.loader(_indices(n), plan, _dist(r, world), seed=seed) for r in range(world)]
    out = []
    for _ in range(epochs):
        per_rank = [[torch.cat([mb[0] for mb in step]) for step in ld] for ld in loaders]
        for ld in per_rank:
            assert all(len(mbs) == global_batch // world for mbs in ld)
        out.append([torch.cat([per_rank[r][s] for r in range(world)]).tolist() for s in range(len(per_rank[0]))])
    return out, plan


def test_global_batch_sequence_is_identical_for_world_sizes_1_to_4_and_any_accumulation():
    reference, _ = _global_batches(100, 12, 1)
    for world, micro in [(2, None), (2, 3), (3, None), (3, 2), (4, 1), (4, 3)]:
        got, plan = _global_batches(100, 12, world, micro)
        assert got == reference, f"world {world} micro {micro} accum {plan.accum_steps}"


def test_every_sample_once_per_epoch_minus_dropped_remainder_and_reshuffled():
    epochs, _ = _global_batches(100, 12, 3)
    for batches in epochs:
        seen = [i for b in batches for i in b]
        assert len(seen) == len(set(seen)) == 96  # 100 // 12 * 12
    assert epochs[0] != epochs[1]  # reshuffled without set_epoch


def test_rank_takes_its_contiguous_share_of_each_global_batch():
    plan = mg.BatchPlan(12, 3, micro_batch=2)
    full = next(iter(mg.loader(_indices(50), mg.BatchPlan(12, 1), _dist(0, 1), seed=5)))[0][0].tolist()
    for r in range(3):
        steps = next(iter(mg.loader(_indices(50), plan, _dist(r, 3), seed=5)))
        assert len(steps) == plan.accum_steps == 2
        assert torch.cat([mb[0] for mb in steps]).tolist() == full[4 * r: 4 * r + 4]


def test_position_resumes_mid_epoch_on_another_world_size():
    full, _ = _global_batches(60, 8, 1, epochs=2)
    flat = full[0] + full[1]
    plan2 = mg.BatchPlan(8, 2)
    a = [mg.loader(_indices(60), plan2, _dist(r, 2), seed=3) for r in range(2)]
    for ld in a:
        for i, _ in enumerate(ld):
            if i == 4:
                break
    state = a[0].state_dict()
    assert state["epoch"] == 0 and state["batch_index"] == 5
    plan4 = mg.BatchPlan(8, 4)
    b = [mg.loader(_indices(60), plan4, _dist(r, 4), seed=3) for r in range(4)]
    for ld in b:
        ld.load_state_dict(state)
    rest = []
    for _ in range(2):  # finish epoch 0, then all of epoch 1
        per_rank = [[torch.cat([mb[0] for mb in s]) for s in ld] for ld in b]
        rest += [torch.cat([p[s] for p in per_rank]).tolist() for s in range(len(per_rank[0]))]
    assert rest == flat[5:]


def test_loader_state_rejects_a_different_global_batch():
    ld = mg.loader(_indices(60), mg.BatchPlan(8, 1), _dist(0, 1))
    with pytest.raises(mg.UsageError, match="global_batch=16 but this loader has global_batch=8"):
        ld.load_state_dict({"epoch": 0, "batch_index": 1, "seed": 0, "global_batch": 16, "dataset_size": 60})


def test_dataset_smaller_than_a_global_batch_is_a_usage_error():
    with pytest.raises(mg.UsageError, match="dataset has 10 samples but one global batch is 16"):
        mg.loader(_indices(10), mg.BatchPlan(16, 2), _dist(0, 2))


def test_plan_world_size_must_match_the_job():
    with pytest.raises(mg.UsageError, match="world_size 2 but this job has 4 processes"):
        mg.loader(_indices(64), mg.BatchPlan(16, 2), _dist(0, 4))


def test_dataloader_arguments_owned_by_the_plan_are_refused():
    with pytest.raises(mg.UsageError, match="sets batch_size from the batch plan"):
        mg.loader(_indices(64), mg.BatchPlan(16, 1), _dist(0, 1), batch_size=4)
    # Out of order, a step's micro-batches could come from different global batches.
    with pytest.raises(mg.UsageError, match=r"mg.loader\(\) relies on the DataLoader's in-order round robin"):
        mg.loader(_indices(64), mg.BatchPlan(16, 1), _dist(0, 1), num_workers=2, in_order=False)


class _RandomPerWorker(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.randint(0, 2**30, ())


def _worker_draws(rank, world, seed):
    plan = mg.BatchPlan(8, world)
    ld = mg.loader(_RandomPerWorker(), plan, _dist(rank, world), seed=seed, num_workers=1)
    return [mb.tolist() for step in ld for mb in step]


def test_worker_seeds_differ_per_rank_and_are_reproducible():
    r0, r1 = _worker_draws(0, 2, 7), _worker_draws(1, 2, 7)
    assert r0 != r1
    assert r0 == _worker_draws(0, 2, 7)


@pytest.mark.parametrize("n, world", [(10, 3), (7, 4), (5, 1), (101, 2), (4, 4)])
def test_eval_shards_cover_the_dataset_exactly_once_in_as_many_batches_per_rank(n, world):
    seen, counts = [], []
    for r in range(world):
        batches = [x.tolist() for (x,) in mg.eval_loader(_indices(n), _dist(r, world), batch_size=2)]
        assert all(1 <= len(b) <= 2 for b in batches)
        seen += [i for b in batches for i in b]
        counts.append(len(batches))
    assert seen == list(range(n))
    assert len(set(counts)) == 1  # FSDP gathers the parameters in every forward: no rank may run one more
    assert [len(eval_batches(n, r, world, 2)) for r in range(world)] == counts


def test_eval_batches_that_would_leave_a_rank_empty_are_refused_with_the_fix():
    with pytest.raises(mg.UsageError, match="3 rows in batches of at most 2 over 4 data-parallel ranks .* "
                                            "evaluate at least 4 rows"):
        mg.eval_loader(_indices(3), _dist(0, 4), batch_size=2)
    with pytest.raises(mg.UsageError, match="101 rows in batches of at most 1 .* use batch_size=2$"):
        mg.eval_loader(_indices(101), _dist(1, 2), batch_size=1)


class _Plain(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return self.base[i]


def test_tensor_datasets_are_read_per_micro_batch_with_identical_results():
    g = torch.Generator().manual_seed(0)
    base = TensorDataset(torch.randn(40, 3, generator=g), torch.randint(0, 5, (40,), generator=g))
    plan = mg.BatchPlan(8, 2, micro_batch=2)
    fast = [mb for step in mg.loader(base, plan, _dist(1, 2), seed=4) for mb in step]
    slow = [mb for step in mg.loader(_Plain(base), plan, _dist(1, 2), seed=4) for mb in step]
    assert len(fast) == len(slow) == 10
    for (fx, fy), (sx, sy) in zip(fast, slow):
        assert torch.equal(fx, sx) and torch.equal(fy, sy) and fy.dtype == sy.dtype


def test_model_parallel_peers_read_the_same_samples_keyed_on_the_data_parallel_rank():
    """4 processes as 2 data-parallel ranks x 2 peers (e.g. tensor parallel): the plan's dp_rank keys the share."""
    reference, _ = _global_batches(60, 12, 1, epochs=1)
    shares = []
    for dp in range(2):
        plan = mg.BatchPlan(12, 2, micro_batch=3, dp_rank=dp)
        peers = [[torch.cat([mb[0] for mb in step]).tolist() for step in mg.loader(_indices(60), plan, _dist(2 * dp + p, 4), seed=3)]
                 for p in range(2)]
        assert peers[0] == peers[1]
        shares.append(peers[0])
    assert [a + b for a, b in zip(*shares)] == reference[0]


def test_a_plan_without_dp_rank_must_span_the_world():
    with pytest.raises(mg.UsageError, match="world_size 2 but this job has 4 processes"):
        mg.BatchPlan(16, 2).dp_rank_of(_dist(0, 4))
    with pytest.raises(mg.UsageError, match="dp_rank must be an integer in 0..1"):
        mg.BatchPlan(16, 2, dp_rank=2)


def test_eval_loader_layouts_it_cannot_count_exactly_are_one_line_each():
    data, dist = _indices(16), _dist(0, 2)
    cases = [(dict(layout=object()), "layout= takes the mg.parallel.Layout the model was spread by"),
             (dict(mesh=mg.parallel.Layout(tp=2)), "mg.eval_loader's mesh= is gone; pass layout= the mg.parallel.Layout"),
             (dict(layout=mg.parallel.Layout(tp=4)), "world size 2 is not divisible by dp_replicate 1 x tp 4")]
    for kwargs, line in cases:
        with pytest.raises(mg.UsageError, match=line):
            mg.eval_loader(data, dist, 4, **kwargs)
    tp = [[x.tolist() for (x,) in mg.eval_loader(data, _dist(r, 2), 4, layout=mg.parallel.Layout(tp=2))]
          for r in range(2)]
    assert tp[0] == tp[1] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # TP peers: the same rows
