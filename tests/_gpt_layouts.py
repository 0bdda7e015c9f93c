"""Worker for tests/test_model_parallel.py and test_pipeline.py: the tiny GPT trained under one layout, its full
weights returned.

The model trains in float64 unless a layout says ``"dtype": torch.float32``. Layout equivalence is then a
property of the arithmetic, not of the CPU: in fp32, AdamW divides by the root of the second moment, so a
1e-7 change in a tiny gradient (another summation order, another SIMD kernel) moves a weight by up to lr,
and a correct layout missed 1e-5 on an AVX-512 machine. In float64 the same orders differ by ~1e-15 and a
tolerance of 1e-9 leaves nothing for a bug to hide under.
"""

import dataclasses
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.meter.footprint import state_bytes
from multigpu.recipes.gpt.model import GPT, config
from multigpu.recipes.gpt.parallelize import pipeline, spread

GLOBAL_BATCH, BLOCK = 8, 16


def tokens(n: int = 64, seed: int = 1, masked: bool = False) -> TensorDataset:
    """Random sequences; ``masked``: each sequence ignores (-100) a different number of its targets, 0 to 15."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 256, (n, BLOCK + 1), generator=g)
    y = seq[:, 1:].clone()
    if masked:
        keep = torch.arange(BLOCK) >= torch.randint(0, BLOCK, (n, 1), generator=g)  # a masked prefix, like a prompt
        y[~keep] = -100
    return TensorDataset(seq[:, :-1], y)


def step_loss(model, x, y, plan, micro_batches, masked: bool) -> torch.Tensor:
    """The mean over micro-batch means, or (masked) the summed loss over the step's global token count."""
    logits = model(x).flatten(0, 1)
    if not masked:
        return F.cross_entropy(logits, y.flatten()) / plan.accum_steps
    return F.cross_entropy(logits, y.flatten(), reduction="sum") / mg.token_divisor([t for _, t in micro_batches])


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def saved_bytes(out: list):
    """A context that appends the bytes autograd saves for the backward inside it (a saved-tensors hook)."""
    import contextlib

    total = [0]

    def pack(t):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        total[0] += local.numel() * local.element_size()
        return t

    @contextlib.contextmanager
    def ctx():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        out.append(total[0])

    return ctx()


def train(dist, layout: dict, steps: int = 5, accum: int = 2, clip: float | None = 0.5, ckpt: str | None = None,
          stop_after: int | None = None) -> dict:
    """``layout``: mesh degrees plus sequence_parallel / loss_parallel; every rank returns the same full state.

    With ``ckpt``: resume from that directory if it holds a checkpoint, save after every step, and
    stop after step ``stop_after`` (a run that a later one, perhaps under another layout, continues).
    """
    layout = dict(layout)
    dtype = layout.pop("dtype", torch.float64)
    lp, masked = layout.pop("loss_parallel", False), layout.pop("masked", False)
    torch.manual_seed(0)
    model = GPT(config("tiny", block_size=BLOCK, **layout.pop("model", {}))).to(dtype)  # the full model, on every rank
    layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
    layout = dataclasses.replace(layout, micro_batch=GLOBAL_BATCH // layout.dp_size // accum)
    model = spread(model, layout, loss_parallel=lp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    plan = layout.plan(GLOBAL_BATCH, dist)
    train_loader = mg.loader(tokens(masked=masked), plan, dist, seed=0)
    start = 0
    if ckpt is not None:
        checkpointer = mg.Checkpointer(ckpt, model=model, optimizer=opt, loader=train_loader)
        start = checkpointer.resume()
    losses, norms, saved = [], [], []
    for step, micro_batches in zip(range(start, steps), train_loader):
        total = 0.0
        for x, y in mg.accumulate(model, micro_batches):
            with mg.parallel.loss_parallel(lp), saved_bytes(saved):
                loss = step_loss(model, x, y, plan, micro_batches, masked)
            with mg.parallel.loss_parallel(lp):
                loss.backward()
            total += float(full(loss))
        if clip is not None:
            norms.append(float(mg.clip_grad_norm_(model, clip)))
        opt.step()
        held = state_bytes(model, opt).as_dict()  # this rank's parameters, gradients, optimizer state
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if ckpt is not None:
            checkpointer.save(step)
            if step == stop_after:
                break
    net = mg.unwrap(model)  # a layout that only replicates is DDP, whose wrapper prefixes the names
    state = {k: full(v) for k, v in net.state_dict().items()}
    tied = net.head.weight is net.embed.wte.weight
    return {"state": state, "losses": losses, "norms": norms, "mesh": layout.label, "tied": tied, "bytes": held,
            "saved": saved[0]}



def train_pipeline(dist, layout: dict, steps: int = 5, accum: int = 4, clip: float = 0.5, ckpt: str | None = None,
                   stop_after: int | None = None) -> dict:
    """The GPT (``layout["model"]`` overrides) in pipeline stages over ``layout["pp"]`` ranks, by ``layout["schedule"]``;
    ``ckpt`` and ``stop_after`` as in ``train``."""
    layout = dict(layout)
    overrides, dtype = layout.pop("model", {}), layout.pop("dtype", torch.float64)
    torch.manual_seed(0)
    model = GPT(config("tiny", block_size=BLOCK, **overrides)).to(dtype)
    layout = mg.parallel.Layout(**layout).resolve(dist.world_size)
    layout = dataclasses.replace(layout, micro_batch=GLOBAL_BATCH // layout.dp_size // accum)
    plan = layout.plan(GLOBAL_BATCH, dist)
    pipe = pipeline(model, layout, plan)
    parts, ids = pipe.modules, pipe.ids
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    train_loader = mg.loader(tokens(), plan, dist, seed=0)
    start = 0
    if ckpt is not None:
        checkpointer = mg.Checkpointer(ckpt, model=pipe.model, optimizer=opt, loader=train_loader)
        start = checkpointer.resume()
    losses, norms, refused = [], [], None
    for step, micro_batches in zip(range(start, steps), train_loader):
        loss = pipe.step(micro_batches)
        if step == start:  # the pipeline's model is this rank's stages: mg.clip_grad_norm_ would clip by their norm
            refused = taking_a_model(pipe, plan, clip)
        norms.append(float(pipe.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else float(loss))
        if ckpt is not None:
            checkpointer.save(step)
            if step == stop_after:
                break
    mine = {f"{k}": full(v) for part in parts for k, v in part.state_dict().items()}
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, mine)
    state = {k: v for d in gathered for k, v in d.items()}
    return {"state": state, "losses": losses, "norms": norms, "mesh": layout.label, "stages": ids,
            "clip_refused": refused}


def taking_a_model(pipe, plan, clip: float) -> dict:
    """What each function that takes "a model" does with the pipeline, its ``pipe.model`` and one stage
    (after a step's backward): the refusal's line, or the keys of ``mg.full_state_dict``."""
    calls = {"mg.clip_grad_norm_": lambda m: mg.clip_grad_norm_(m, clip),
             "mg.accumulate": lambda m: list(mg.accumulate(m, [1, 2])),
             "NoiseScale.attach": lambda m: mg.NoiseScale(plan).attach(m),
             "mg.full_state_dict": lambda m: sorted(mg.full_state_dict(m)),
             "mg.wrap": lambda m: mg.wrap(m, "ddp"),
             "Checkpointer": lambda m: sorted(mg.Checkpointer(tempfile.mkdtemp(), model=m).model.state_dict())}
    said = {}
    for what, call in calls.items():
        for name, model in (("pipe", pipe), ("pipe.model", pipe.model), ("stage", pipe.modules[0])):
            if name == "stage" and model is pipe.model:  # a rank with one stage: pipe.model is that stage
                continue
            try:
                said[f"{what}({name})"] = call(model)
            except mg.UsageError as err:
                said[f"{what}({name})"] = str(err)
    return said


def train_layouts(dist, layouts: list[dict]) -> list[dict]:
    """Several layouts, one after another, in the same processes (one start-up for all)."""
    return [train(dist, layout) for layout in layouts]


def train_pipelines(dist, layouts: list[dict]) -> list[dict]:
    return [train_pipeline(dist, layout) for layout in layouts]
