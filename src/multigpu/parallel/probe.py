"""A tensor-parallel plan checked on the model itself before training: exact or refused.

A plan names which projections to split, but whether the split is exact depends on the model's forward,
which no plan describes: a view by the global head count (BigBird), a norm over the full hidden size
between a column-wise and a row-wise projection (BitNet's attn_sub_norm), a parameter inside an
activation function that then sees each rank's share of the features (Apertus's xIELU: its gradient is
a partial sum, silently). So ``mg.parallelize`` runs a probe batch (a few tokens, or one small image)
through the model in eval mode before and after tensor parallelism, with the RNG state restored:

- the forward must run, and its output must equal the unsplit model's (relative error within what the
  dtype's rounding allows; a wrong split is off by tens of percent);
- after one backward, every parameter the plan leaves whole must hold the same gradient on every
  tensor-parallel rank: a whole parameter that sees split activations gets only its rank's share.

Either failure refuses the plan in one line naming what failed. The probe needs an input the model
names (``main_input_name``: transformers models); for other models it is skipped (``probe_input`` None).
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


def probe_input(model: nn.Module, tp: int) -> dict[str, torch.Tensor] | None:
    """A small batch the model takes, by its ``main_input_name``: 2 x 8·tp token ids (a sequence any
    sequence-parallel split divides) or one image; None when the model names no input multigpu knows."""
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    params = list(model.parameters())
    if config is None or not params:
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


def _output(out: Any) -> torch.Tensor:
    """The model's main output as a full tensor (logits, or the first tensor it returns)."""
    from torch.distributed.tensor import DTensor

    t = getattr(out, "logits", None)
    if t is None:
        t = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
    return t.full_tensor() if isinstance(t, DTensor) else t


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
        out = _output(model(**batch, **({"use_cache": False} if "input_ids" in batch else {})))
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


def expected(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The unsplit model's output on ``batch``; None when the model does not run on it (nothing to check by)."""
    try:
        return run(model, batch, backward=False)
    except Exception:  # noqa: BLE001 - a model that needs more than its main input is not probed
        return None


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
