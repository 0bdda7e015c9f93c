"""A script that follows the layout contract (docs/your-model.md) as tune's workload (``run.py``'s one path).

What is the script's own: its path (a workload that is a ``.py`` or a path), the refusals of its arguments,
its ``--global-batch`` (what a prediction divides), its candidates (every ``Layout`` of N ranks:
``parallel.space.layouts``; with ``--model``, each micro-batch and checkpointing too), the layouts it would
refuse, asked on its model before anything runs (``_refusal``: its ``mg.parallelize``'s and pipeline's own
lines), and, measured without a model, the retry of a layout that ran out of memory with
``--activation-checkpointing`` (where memory does not bind, checkpointing only adds recomputation).
A refusal at run time is the script's ``UsageError``'s message, from its workers' failure records.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

from ..errors import UsageError
from ..parallel.flags import refuse_fixed
from . import rounds


def is_script(workload: str) -> bool:
    return workload.endswith(".py") or os.sep in workload


def check_script_args(cfg) -> None:
    """The refusals that need no torch, for a script."""
    if not os.path.isfile(cfg.workload):
        raise UsageError(f"tune knows the layouts of the GPT recipe (`multigpu tune gpt [its flags]`) and of a script "
                         f"that reads them with mg.layout_from_args() (docs/your-model.md), got {cfg.workload!r}: "
                         "no such file; give the script's path")
    refuse_fixed(cfg.args, "tune chooses", "(pass the script's own flags: --global-batch, ...)", extra=("--steps",))
    if cfg.model is None:
        for flag, value in (("--memory-budget", cfg.memory_budget), ("--seq-len", cfg.seq_len)):
            if value is not None:
                raise UsageError(f"{flag} serves the prediction of a script's layouts, which needs its model: add "
                                 "--model (e.g. --model train.py:build_model) or drop " + flag)
        return
    if cfg.seq_len is None or cfg.seq_len < 1:
        raise UsageError("--model predicts the script's layouts from its sequence length: add --seq-len N (the tokens "
                         f"per sequence it trains on), got {cfg.seq_len}")
    global_batch(cfg.args)


def global_batch(args) -> int:
    """The script's ``--global-batch`` (the contract's flag) from its arguments: what a prediction divides."""
    args = list(args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--global-batch=") else \
            args[i + 1] if arg == "--global-batch" and i + 1 < len(args) else None
        if value is not None:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--global-batch takes a positive number of sequences, got {value!r}")
            return int(value)
    raise UsageError("--model predicts from the script's global batch: pass the script's --global-batch N after "
                     "the script (e.g. multigpu tune --model ... train.py --global-batch 16)")


def with_checkpointing(row: dict, m: dict) -> dict | None:
    """Where activation checkpointing matters: a layout that ran out of memory without it is tried with it
    (it trades recomputation for memory, so where memory does not bind it only costs time)."""
    layout = row["_l"]
    if layout.activation_checkpointing or not rounds.out_of_memory(m):
        return None
    return rounds.row(replace(layout, activation_checkpointing=True))


def workload(cfg):
    """The script as tune's workload (``rounds.Workload``): launched as a path; without ``--model`` every layout of
    N ranks as it is, measured; with it the recipe's candidates (``space.candidates``: each micro-batch that splits
    a rank's share, checkpointing off and on) less those the script would refuse (``_refusal``)."""
    from ..parallel.space import layouts
    from . import wrappers
    from .space import candidates

    micro = list(cfg.micro_batches) if cfg.micro_batches else None
    if not cfg.model:
        found = layouts(cfg.nproc, micro_batches=micro, experts=cfg.experts, context=cfg.context)
        return rounds.Workload(cfg.workload, cfg.workload, False, found, [], retry=with_checkpointing)
    build, counts = _count(cfg)  # a model that does not load or count: one line, nothing written
    batch = global_batch(cfg.args)
    found, left_out = candidates(layouts(cfg.nproc, experts=cfg.experts, context=cfg.context), batch,
                                 _refusal(build, counts, cfg.seq_len, batch), micro_batches=micro, model=counts.name)
    return rounds.Workload(cfg.workload, cfg.workload, False, found, left_out, counts=counts,
                           subject=wrappers.built(build, counts.vocab, cfg.seq_len), global_batch=batch)


def _count(cfg) -> tuple:
    """(the builder of ``cfg.model``, forecast's count of it at ``cfg.seq_len``): counted as built, in float32 (a
    script that trains under autocast holds less)."""
    import torch

    from ..forecast.counts import count
    from ..forecast.models import builder

    build, name = builder(cfg.model)
    return build, count(build, cfg.seq_len, name=name, dtype=torch.float32)


def _refusal(build, counts, seq_len: int, batch: int) -> Callable:
    """Why the script would refuse a resolved layout for the counted model, as ``mg.parallelize``,
    ``mg.parallel.pipeline`` and the batch plan refuse it (a TP degree its heads or vocabulary do not divide,
    tensor parallelism for a model with no plan it declares or that can be found, more stages than blocks, a
    model the pipeline cannot cut, a batch that does not split), or None. A tied head is no refusal: the
    pipeline keeps a copy of the table on each stage that uses it."""
    import torch

    from ..parallel import auto
    from ..parallel.spread import tensor_parallel_plan
    from ..parallel.stages import split
    from .space import pipeline_short

    with torch.device("meta"):  # the model, to ask for its TP plan as mg.parallelize does (no memory)
        model = build()
    blocks = auto.block_modules(model)
    cuts: dict[int, str | None] = {}  # stages -> why mg.parallel.pipeline cannot cut the model so, or None

    def uncut(layout) -> str | None:  # the cut alone (no probe on a meta model), once per stage count
        if layout.stages not in cuts:
            try:
                split(model, layout, layout.stages)
                cuts[layout.stages] = None
            except UsageError as err:
                cuts[layout.stages] = str(err)
        return cuts[layout.stages]

    def why(layout) -> str | None:
        try:
            layout.check_sizes(heads=counts.heads or None, kv_heads=counts.kv_heads or None,
                               vocab=counts.vocab or None, seq=seq_len, blocks=counts.layers, model=counts.name)
            if layout.tp > 1:
                tensor_parallel_plan(model, layout, blocks, None, derive_sequence_parallel=layout.pp == 1)
            return (uncut(layout) if layout.pp > 1 else None) or pipeline_short(layout, batch)
        except UsageError as err:
            return str(err)

    return why
