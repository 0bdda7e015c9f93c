"""How a model was spread: one record per model, kept beside it (never on it), read through ``spread_of``.

``mg.parallelize`` (and ``mg.parallel.pipeline`` for its stages' union, ``pipe.model``) writes one
``Spread`` for the model it returns: the ``Layout`` (pp > 1: a pipeline's stages), its context
parallelism, its expert-parallel dispatch figures and its DDP comm hook. Everything that later takes "a
model" (clipping, evaluation's share, the meter, checkpoints, the noise scale, ``mg.context_share``) asks
``spread_of(model)`` and nothing else, so a new fact about a spread is added here once and every reader sees
it. The record is keyed weakly by the model, under the object returned and the user's own module inside
it (DDP's ``.module``), and a pipeline's under the ``Pipeline`` too, so a dropped model is forgotten and
every handle finds it (nothing in a record refers back to its model, or it would never be dropped: the
pipeline is held by a weak reference). It sits below the layers that write it (``parallel/``) and read it
(``data/``, ``meter/``, ``noise/``, ``checkpoint/``), and imports none of them.

Beside the records, this process's evaluation share (``process_share``): the share of the layout it spread
a model by last, or that ``mg.eval_loader`` was told, for ``mg.all_reduce_sum``, which takes no model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as tdist

from .dist import at_teardown
from .errors import UsageError
from .runtime.compat import wrapped


@dataclass(eq=False)
class Spread:
    """What one model's spread consists of (any field None or empty when that part was not applied)."""

    layout: Any                      # the resolved mg.parallel.Layout
    context: Any = None              # context.Context: the cp share of each sequence
    experts: list = field(default_factory=list)  # experts.Stats: the expert-parallel dispatch's figures
    comm_hook: tuple | None = None   # (name, state) of DDP's gradient communication hook
    pipeline: Any = None             # weakref.ref to the Pipeline whose stages' union this is (pipe.model)
    tp_plan: str | None = None       # where the TP plan came from: "given", "declared by ...", "found in the blocks"
    noise: Any = None                # weakref.ref to the NoiseScale measuring its gradients (mg.accumulate asks)


_RECORDS: "weakref.WeakKeyDictionary[Any, Spread]" = weakref.WeakKeyDictionary()


def _handles(model: Any) -> list:
    """``model`` and every module it wraps (DDP's ``.module``, ``torch.compile``'s original): a wrapper made
    after the record was written finds it through the module inside."""
    handles = [model]
    while (inner := wrapped(handles[-1])) is not None:
        handles.append(inner)
    return handles


def spread_of(model: Any) -> Spread | None:
    """The record of how ``model`` was spread (it or the module it wraps; a ``Pipeline`` and its
    ``pipe.model`` share theirs), or None: a model ``mg.parallelize`` did not return."""
    for key in _handles(model):
        try:
            found = _RECORDS.get(key)
        except TypeError:  # not weak-referenceable: nothing mg.parallelize returned
            return None
        if found is not None:
            return found
    return None


def remember(model: Any, *others: Any, **parts: Any) -> Spread:
    """Add ``parts`` to ``model``'s record (made with ``layout=None`` first when there is none), kept under
    ``model``, what it wraps and ``others`` (the ``Pipeline`` beside its ``pipe.model``)."""
    spread = spread_of(model)
    if spread is None:
        spread = Spread(layout=None)
    for name, value in parts.items():
        setattr(spread, name, value)
    for key in _handles(model) + list(others):
        _RECORDS[key] = spread
    return spread


def pipeline_of(model: Any) -> Any:
    """The ``Pipeline`` that ``model`` is or whose stages' union (``pipe.model``) it is, else None."""
    spread = spread_of(model)
    return None if spread is None or spread.pipeline is None else spread.pipeline()


def refuse_stages(model: Any, what: str, instead: str) -> None:
    """Refuse in one line when ``model`` is a pipeline's stages on this rank (a ``Pipeline``, its ``.model``
    or one stage: pp > 1), which ``what`` cannot treat as the whole model; ``instead``: what to write."""
    if (pp := stages(model)) > 1:
        raise UsageError(f"{what} got this rank's pipeline stages (pp {pp}), which are not the whole model; {instead}")


def stages(model: Any) -> int:
    """The pipeline degree when ``model`` is a pipeline's stages on this rank (a ``Pipeline``, its ``.model``
    or one stage), else 1."""
    spread = spread_of(model)
    layout = None if spread is None else spread.layout
    return 1 if layout is None else layout.pp


# This process's evaluation share: (rank, world size, DataShare) of the last layout it spread a model by.
_PROCESS: tuple[int, int, Any] | None = None


def record_share(share: Any, rank: int, world_size: int) -> None:
    """Remember ``share`` as this process's (``mg.parallelize`` spread a model by it, or ``mg.eval_loader`` was
    told it): only for the process group's own rank and world (a ``Dist`` made up in one process is no job)."""
    global _PROCESS
    if not (tdist.is_available() and tdist.is_initialized()) or (tdist.get_rank(), tdist.get_world_size()) != (
            rank, world_size):
        return
    if _PROCESS is None:
        at_teardown(forget_share)  # a later mg.init block in this process is another job
    _PROCESS = (rank, world_size, share)


def forget_share() -> None:
    global _PROCESS
    _PROCESS = None


def process_share(rank: int, world_size: int) -> Any:
    """This process's recorded share, if it was recorded for this rank of this world."""
    if _PROCESS is None or _PROCESS[:2] != (rank, world_size):
        return None
    return _PROCESS[2]
