"""A model's split checked on the model itself before training: exact or refused.

A plan names which projections to split, but whether the split is exact depends on the model's forward,
which no plan describes: a view by the global head count (BigBird, or a user's ``view(b, t, self.heads,
...)``), a norm over the full hidden size between a column-wise and a row-wise projection (BitNet's
attn_sub_norm), a parameter inside an activation function that then sees each rank's share of the
features (Apertus's xIELU: its gradient is a partial sum, silently). So ``mg.parallelize`` runs a probe
batch (a few tokens, or one small image) through the model in eval mode before and after each step that
splits it (tensor parallelism, expert parallelism, context parallelism), with the RNG state restored:

- the forward must run, and its output must equal the unsplit model's (relative error within what the
  dtype's rounding allows; a wrong split is off by tens of percent);
- after one backward, every parameter the plan leaves whole must hold the same gradient on every
  tensor-parallel rank: a whole parameter that sees split activations gets only its rank's share.

Either failure refuses the step in one line naming it and quoting the exception. The probe batch is one
the model takes as the user's loop gives it (``call``): a transformers model its ``main_input_name`` by
name; any other model its first argument by position, token ids below its first ``nn.Embedding``'s size
or features of its first ``nn.Linear``'s width (``probe_batch``). A model that takes neither is not
probed: a plan multigpu found for it is refused (nothing checks the guess), one given or declared is
taken and the line says it was not checked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..errors import UsageError

# Relative error of the output allowed by the parameters' dtype: a few roundings of its unit, far below
# what a wrong split gives (0.1-1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def is_transformers(model: nn.Module) -> bool:
    """A transformers model: a config and the name of its main input (a user's model may have a config too:
    nanoGPT's)."""
    return getattr(model, "config", None) is not None and isinstance(getattr(model, "main_input_name", None), str)


def probe_input(model: nn.Module, tp: int) -> dict[str, torch.Tensor] | None:
    """A small batch a transformers model takes, by its ``main_input_name``: 2 x 8·tp token ids (a sequence
    any sequence-parallel split divides) or one image; None when the model names no input multigpu knows."""
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    params = list(model.parameters())
    if not is_transformers(model) or not params:
        return None
    device = params[0].device
    g = torch.Generator().manual_seed(0)
    if name == "input_ids" and isinstance(getattr(config, "vocab_size", None), int):
        high = min(config.vocab_size, 1000)
        return {name: torch.randint(3, max(high, 4), (2, 8 * tp), generator=g).to(device)}
    if name == "pixel_values":
        size = getattr(config, "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        if isinstance(size, int):
            return {name: torch.randn(1, channels, size, size, generator=g).to(device, params[0].dtype)}
    return None


def first_argument(model: nn.Module) -> str | None:
    """The name of the forward's first parameter taken by position (None: it takes none)."""
    import inspect

    first = next(iter(inspect.signature(model.forward).parameters.values()), None)
    return first.name if first is not None and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD,
                                                              first.VAR_POSITIONAL) else None


def own_input(model: nn.Module, tp: int) -> dict[str, torch.Tensor] | None:
    """A small batch for a model transformers did not build, as its first argument: 2 x 8·tp token ids below
    the size of its first ``nn.Embedding`` where it has one; else, when its first module with parameters is an
    ``nn.Linear``, 2 x 8·tp rows of features of its width (in its dtype); None otherwise (nothing says what
    it takes)."""
    name = first_argument(model)
    table = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    first = table or next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if name is None or not isinstance(first, (nn.Embedding, nn.Linear)):
        return None
    g = torch.Generator().manual_seed(0)
    weight = first.weight
    if isinstance(first, nn.Embedding):
        return {name: torch.randint(0, first.num_embeddings, (2, 8 * tp), generator=g).to(weight.device)}
    return {name: torch.randn(2, 8 * tp, first.in_features, generator=g, dtype=torch.float64).to(weight.device,
                                                                                                   weight.dtype)}


def probe_batch(model: nn.Module, tp: int) -> dict[str, torch.Tensor] | None:
    """The probe batch for any model: a transformers model's by its input's name, any other's by its first
    module (``own_input``)."""
    return probe_input(model, tp) if is_transformers(model) else own_input(model, tp)


NOT_PROBED = ("its forward takes no input multigpu can make (token ids for a first nn.Embedding, features for a "
              "first nn.Linear)")


def call(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The model called as a training loop calls it: a transformers model by its input's name (with its cache
    off), any other model with the batch's first entry by position and the rest by name (``model(x)``, or
    ``model(x, position_ids=...)``)."""
    if is_transformers(model):
        return model(**batch, **({"use_cache": False} if "input_ids" in batch else {}))
    (_, first), *rest = batch.items()
    return model(first, **dict(rest))


def _output(out: Any) -> torch.Tensor:
    """The model's main output as a full tensor (logits, or the first tensor it returns)."""
    t = getattr(out, "logits", None)
    if t is None:
        t = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
    return _whole(t)


@contextlib.contextmanager
def _probing(model: nn.Module):
    """Eval mode (no dropout, BatchNorm statistics untouched) and the RNG state as it was, both restored."""
    modes = {m: m.training for m in model.modules()}
    with torch.random.fork_rng(devices=[]):
        model.eval()
        try:
            yield
        finally:
            for m, training in modes.items():
                m.training = training


def run(model: nn.Module, batch: dict[str, torch.Tensor], backward: bool) -> torch.Tensor:
    with _probing(model), torch.set_grad_enabled(backward):
        out = _output(call(model, batch))
        if backward:
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
            (out * weights).sum().backward()
    return out.detach()


def cause(e: BaseException) -> str:
    """An exception as the one line a refusal quotes: its type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected||, in float64."""
    return ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def attempt(model: nn.Module, batch: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor | None, str]:
    """(the model's output on ``batch``, "") or (None, why it has none: no batch, or the exception its forward
    raised, quoted by ``cause``)."""
    if batch is None:
        return None, NOT_PROBED
    try:
        return run(model, batch, backward=False), ""
    except Exception as e:  # noqa: BLE001 - the caller decides: refuse quoting it, or say it was not checked
        return None, f"its forward fails on one: {cause(e)}"


def expected(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The unsplit model's output on ``batch``; None when the model does not run on it (nothing to check by)."""
    return attempt(model, batch)[0]


def check(model: nn.Module, batch: dict[str, torch.Tensor], expected: torch.Tensor, tp_group: Any,
          source: str) -> None:
    """Refuse the plan (``source``: where it came from) unless the split model's output on ``batch`` equals
    ``expected`` (the unsplit model's) and its whole parameters' gradients agree over ``tp_group``."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    name = type(model).__name__
    fix = "use tp=1 for this model (DDP, FSDP and pipelines apply), or pass a tp_plan without those modules"
    try:
        got = run(model, batch, backward=True)
    except Exception as e:  # noqa: BLE001 - any failure of the forward under the plan is the refusal's reason
        raise UsageError(f"tensor-parallel plan {source} breaks {name}'s forward on a probe batch ({cause(e)}): "
                         f"the model computes at full width somewhere the plan splits (a view by the global "
                         f"head count, a norm over the whole hidden size); {fix}") from None
    whole = [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    try:
        error = relative_error(got, expected)
        # Each whole parameter's gradient fingerprint (sum, sum of squares), compared over the TP ranks.
        prints = torch.tensor([[float(p.grad.double().sum()), float(p.grad.double().square().sum())]
                               if p.grad is not None else [0.0, 0.0] for _, p in whole], dtype=torch.float64)
    finally:
        model.zero_grad(set_to_none=True)
    tol = TOLERANCE.get(expected.dtype, 1e-4)
    if not error <= tol:
        raise UsageError(f"tensor-parallel plan {source} changes {name}'s output on a probe batch (relative error "
                         f"{error:.1e}, {expected.dtype} allows {tol:.0e}): the model's forward does not follow the "
                         f"split (e.g. a reshape by the global head count); {fix}")
    if not whole:
        return
    gathered = [torch.empty_like(prints) for _ in range(tdist.get_world_size(tp_group))]
    tdist.all_gather(gathered, prints, group=tp_group)
    ranks = torch.stack(gathered)
    spread = ranks.amax(0) - ranks.amin(0)
    scale = ranks.abs().amax(0).clamp_min(1e-30)
    off = [n for (n, _), s in zip(whole, (spread / scale).amax(1).tolist()) if s > tol]
    if off:
        raise UsageError(f"tensor-parallel plan {source} leaves {', '.join(off[:3])}"
                         f"{f' (+{len(off) - 3} more)' if len(off) > 3 else ''} of {name} whole, but its gradient "
                         "differs between the tensor-parallel ranks on a probe batch: it computes on each rank's share "
                         f"of the split features (a parameter inside an activation or a norm there); {fix}")


def agree(model: nn.Module, batch: dict[str, torch.Tensor], expected: torch.Tensor | None, group: Any, what: str,
          fix: str, device: torch.device, name: str | None = None) -> None:
    """Refuse ``what`` (the step that split the model, e.g. "expert parallelism (ep=2)") unless the model's
    output on ``batch`` equals ``expected`` (its output before the step; None: only that the forward runs)
    on every rank of ``group``. The verdict is the group's (one all-reduce of the worst error), so every
    rank refuses alike rather than one refusing while the others wait in the next collective. ``name``: the
    model's as the user knows it (FSDP renames its class: FSDPLlamaForCausalLM)."""
    import torch.distributed as tdist

    name, why, error = name or type(model).__name__, "", 0.0
    try:
        got = run(model, batch, backward=False)
        if expected is not None:
            error = relative_error(got, expected)
    except Exception as e:  # noqa: BLE001 - any failure of the forward after the step is the refusal's reason
        error, why = float("inf"), cause(e)
    worst = torch.tensor([error if error == error else float("inf")], dtype=torch.float64, device=device)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX, group=group)
    if worst.item() == float("inf"):
        raise UsageError(f"{what} breaks {name}'s forward on a probe batch ({why or 'on another rank'}); {fix}")
    tol = TOLERANCE.get(expected.dtype, 1e-4) if expected is not None else float("inf")
    if not worst.item() <= tol:
        raise UsageError(f"{what} changes {name}'s output on a probe batch (relative error {worst.item():.1e}, "
                         f"{expected.dtype} allows {tol:.0e}); {fix}")


def same_training(model: nn.Module, reference: nn.Module, batch: dict[str, torch.Tensor], what: str, fix: str,
                  device: torch.device, name: str | None = None) -> None:
    """Refuse ``what`` (e.g. "from_pretrained onto layout tp=2") unless ``model`` and ``reference`` (the same
    weights spread otherwise: an FSDP load of the checkpoint) give the same output on ``batch`` and the same
    gradient of every parameter, each compared whole, one at a time: a split checked in both passes where no
    process holds the whole model to check it on (``check`` compares the gradients a split leaves whole over
    the TP ranks; here every one is compared with the reference's). The verdict is every rank's worst error,
    all-reduced, taken after the passes and again after the gradients, so every rank refuses alike."""
    import torch.distributed as tdist

    name, why, error = name or type(model).__name__, "", 0.0
    theirs = dict(reference.named_parameters())
    ours = list(model.named_parameters())

    def verdict(error: float) -> float:
        worst = torch.tensor([error if error == error else float("inf")], dtype=torch.float64, device=device)
        tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)
        return worst.item()

    try:
        try:
            error = relative_error(run(model, batch, backward=True), run(reference, batch, backward=True))
            missing = [n for n, _ in ours if n not in theirs]
            if missing:
                error, why = float("inf"), f"parameters the reference lacks: {', '.join(missing[:3])}"
        except Exception as e:  # noqa: BLE001 - any failure of either pass is the refusal's reason
            error, why = float("inf"), cause(e)
        if verdict(error) < float("inf"):  # every rank's passes ran: the gradients, whole, in one order
            # One relative error over every gradient at once: a gradient that is zero in exact arithmetic (an
            # attention key's bias: softmax ignores a constant per row) is rounding noise in both, and its own
            # relative error would be ~1 however right the split.
            diff = norm = 0.0
            for n, p in ours:
                got, expected = _whole(p.grad), _whole(theirs[n].grad)
                if got is None or expected is None:
                    got, expected = (x if x is not None else torch.zeros(()) for x in (got, expected))
                diff += float((got.double() - expected.double()).square().sum())
                norm += float(expected.double().square().sum())
            error = max(error, (diff / norm) ** 0.5 if norm > 0 else float(diff > 0))
    finally:
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    worst = verdict(error)
    if worst == float("inf"):
        raise UsageError(f"{what} breaks {name}'s forward or backward on a probe batch ({why or 'on another rank'}); {fix}")
    tol = TOLERANCE.get(next(model.parameters()).dtype, 1e-4)
    if not worst <= tol:
        raise UsageError(f"{what} changes {name}'s output or gradients on a probe batch (relative error {worst:.1e}, "
                         f"{tol:.0e} allowed); {fix}")


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient whole: a DTensor's gathered over its mesh (collective), a plain tensor as it is."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def _varies(model: nn.Module, batch: dict[str, torch.Tensor]) -> bool | None:
    """Whether the model's training-mode forward on ``batch`` changes with the random draws it makes: run from
    seed 1 and, if that drew from the generator, from seed 2, the outputs compared (False: it draws nothing,
    or nothing it draws reaches the output: PhiMoE's sampling among one candidate). None: it does not run
    in training mode. Its modes, buffers (BatchNorm's statistics) and the RNG state are restored."""
    device = next(iter(batch.values())).device
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.train()
            outs = []
            for seed in (1, 2):
                torch.manual_seed(seed)
                before = _rng_state(device)
                outs.append(_output(call(model, batch)).detach())
                if seed == 1 and all(torch.equal(a, b) for a, b in zip(before, _rng_state(device))):
                    return False
        return not relative_error(outs[1], outs[0]) <= TOLERANCE.get(outs[0].dtype, 1e-4)
    except Exception:  # noqa: BLE001 - a forward that needs more in training mode: the static reading decides
        return None
    finally:
        for m, training in modes.items():
            m.training = training
        for b, saved in buffers:
            b.copy_(saved)


def _named_draws(model: nn.Module) -> list[str]:
    """What the model says it draws: its config's dropout and jitter settings above 0, its dropout modules
    with p > 0."""
    config = getattr(model, "config", None)
    said = [f"{k}={v:g}" for k, v in sorted(vars(config).items() if config is not None else [])
            if isinstance(v, float) and not isinstance(v, bool) and v > 0 and ("drop" in k or "jitter" in k)]
    said += [f"{type(m).__name__}(p={m.p:g}) {n}" for n, m in model.named_modules()
             if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0][:3]
    return said


def random_draws(model: nn.Module, batch: dict[str, torch.Tensor] | None) -> str | None:
    """What of the model's training forward is random (its settings named where it names them), or None: the
    probe batch's forward in training mode from two seeds decides (``_varies``); without one, what the model
    says it draws."""
    varies = None if batch is None else _varies(model, batch)
    named = _named_draws(model)
    if varies is False or (varies is None and not named):
        return None
    return ", ".join(named[:4]) if named else "a random draw in its forward"


def draws_note(model: nn.Module, world: int, who: str) -> str | None:
    """The one line ``who`` (``mg.parallelize``, ``mg.parallel.pipeline``) says, on ``world`` processes, about a
    model whose training forward is random; None when it is not. Not a refusal: dropout and a router's
    sampling train as well on any layout; they only differ from one process as two seeds do."""
    if any(p.is_meta for p in model.parameters()):  # no values to draw with (tune asking about a cut)
        return None
    what = random_draws(model, probe_batch(model, 1))
    if what is None:
        return None
    return (f"{who}: note: {type(model).__name__} draws random numbers in its training forward ({what}): each of "
            f"the {world} processes draws its own, so its training differs from one process's by those draws, as "
            "two seeds' do (by design, not a bug); to compare layouts exactly (multigpu verify), set them to 0")
