"""Context parallelism checked on the model itself before training: exact or refused.

A family may compute positions or masks of its own that the shares do not follow. So ``mg.parallelize``
runs a probe batch (2 sequences of 16 x cp tokens, eval mode) through the whole model before and after cp
(``parallel/probe.py``'s runner and tolerances) and puts the shares' outputs back together: a forward that
fails or differs is refused in one line. Two more probes decide what the forward takes later: packed
documents (position ids restarting) and ``labels=`` (the model's own loss); where either differs from one
process, it is refused at the forward with what the probe found.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from .context import Context, share_index


def _gathered(model: nn.Module, ctx: Context, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's output on ``batch`` put back together from every cp rank's share (collective)."""
    import torch.distributed as tdist

    from . import probe

    share = probe.run(model, batch, backward=False)
    pieces = [torch.empty_like(share) for _ in range(ctx.cp)]
    tdist.all_gather(pieces, share.contiguous(), group=ctx.group)
    seq = next(iter(batch.values())).shape[1]
    full = share.new_empty((share.shape[0], seq) + tuple(share.shape[2:]))
    for r, piece in enumerate(pieces):
        full[:, share_index(seq, ctx.cp, r).to(full.device)] = piece
    return full


def probe(model: nn.Module, ctx: Context, batch: dict[str, torch.Tensor], expected: torch.Tensor,
          documents: dict[str, torch.Tensor], expected_documents: torch.Tensor | None,
          expected_loss: torch.Tensor | None) -> None:
    """The whole model checked on a probe batch under cp against its output before (``parallel/probe.py``):
    a forward that fails or differs is refused in one line; one that differs only on packed documents (a
    family that keeps no documents apart on one process, or not by transformers' rule) refuses them later."""
    from .probe import TOLERANCE, cause, relative_error

    name = type(model).__name__
    tol = TOLERANCE.get(expected.dtype, 1e-4)
    try:
        error = relative_error(_gathered(model, ctx, batch), expected)
    except Exception as e:  # noqa: BLE001 - any failure of the forward under cp is the refusal's reason
        raise UsageError(f"context parallelism breaks {name}'s forward on a probe batch ({cause(e)}); use cp=1 for "
                         "this model") from None
    if not error <= tol:
        raise UsageError(f"context parallelism changes {name}'s output on a probe batch (relative error {error:.1e}, "
                         f"{expected.dtype} allows {tol:.0e}): its attention or positions do not follow the shares "
                         "(a mask or position of its own); use cp=1 for this model")
    try:
        error = None if expected_documents is None else relative_error(_gathered(model, ctx, documents),
                                                                        expected_documents)
    except Exception as e:  # noqa: BLE001
        ctx.no_documents = f"the probe's forward fails: {cause(e)}"
    else:
        if error is None or not error <= tol:
            ctx.no_documents = ("its forward on one process fails on them" if error is None else
                                f"a probe batch of two documents is off by {error:.1e}")
    ctx.no_labels = _labels_differ(model, ctx, batch, expected_loss, tol)
    ctx.packed = False  # the probe's own documents are none of the training's


def own_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The model's own loss with ``labels=`` the probe's tokens (eval mode, no gradient); None if it has none."""
    from .probe import _probing

    with _probing(model), torch.no_grad():
        out = model(**batch, labels=batch["input_ids"], use_cache=False)
    return getattr(out, "loss", None)


def _labels_differ(model: nn.Module, ctx: Context, batch: dict[str, torch.Tensor], expected: torch.Tensor | None,
                   tol: float) -> str | None:
    """Why the model's own loss of ``labels=`` under cp is not one process's (None when it is): the cp ranks'
    losses averaged against ``expected``, the unsplit model's."""
    import torch.distributed as tdist

    from .probe import TOLERANCE, cause

    if expected is None:
        return "it returns no loss of labels= on one process"
    try:
        got = own_loss(model, batch)
        if got is None:
            return "it returns no loss under cp"
        got = got.detach().double().reshape(1)
        tdist.all_reduce(got, group=ctx.group)
    except Exception as e:  # noqa: BLE001
        return f"the probe's loss fails: {cause(e)}"
    tol = max(tol, TOLERANCE.get(expected.dtype, 1e-4))  # transformers computes the loss in float32
    error = abs(got.item() / ctx.cp - expected.item()) / max(abs(expected.item()), 1e-30)
    return None if error <= tol else f"a probe batch's loss is off by {error:.1e}"


def check_loaded(model: nn.Module) -> None:
    """The probe ``mg.parallelize`` runs under context parallelism, for a transformers model spread on the meta
    device and then loaded (mg.from_pretrained): the unsplit outputs are the loaded model's own forward with cp
    suspended (every rank runs it on the same batch; FSDP gathers one unit at a time, no process holds the
    model), then the same batches under cp against them: exact or refused, as for any model."""
    from ..spreads import spread_of
    from . import context, probe as probes

    ctx = spread_of(model).context
    batch = probes.probe_input(model, 2 * ctx.cp)
    with context.suspended(model, ctx):
        expected, why = probes.attempt(model, batch)
        if expected is None:
            raise UsageError(f"context parallelism checks {type(model).__name__} on a probe batch of token ids, but "
                             f"{why}; use cp=1 for this model, or make its forward run on its token ids alone")
        expectations = unsplit(model, batch, expected, own=False)
    probe(model, ctx, batch, *expectations)


def unsplit(model: nn.Module, batch: dict, expected: torch.Tensor, own: bool) -> tuple:
    """What the cp probe compares with, computed on the model before cp (``context_probe.probe``'s arguments
    after the batch): the output on ``batch``, a batch of two packed documents and its output (None where
    positions are not taken), the model's own loss of labels= (None: it has none)."""
    from . import context_sdpa, probe as probes

    tokens = next(iter(batch.values()))
    documents = batch | {"position_ids": torch.cat([torch.arange(tokens.shape[1] // 2 - 3),
                                                    torch.arange(tokens.shape[1] // 2 + 3)]).to(tokens.device)
                         .expand_as(tokens)}
    positional = not own or context_sdpa.takes_positions(model)
    expected_documents = probes.expected(model, documents) if positional else None
    try:
        expected_loss = None if own else own_loss(model, batch)
    except Exception:  # noqa: BLE001 - a model without a loss of labels= is refused them later
        expected_loss = None
    return expected, documents, expected_documents, expected_loss
