"""The fixed costs of a layout's wrapper, measured on the model itself: what DDP, FSDP2, TP's DTensors and
FSDP x TP add to each micro-batch and each step, on one process over a group of one rank.

The model is a ``Subject``: how to build it, its logits for token ids, its TP plan (None: the one
``mg.parallelize`` takes: declared by the model or found in its blocks). Each family is applied by the
same pieces ``mg.parallelize`` runs (``parallel/spread.py``: its plan, its activation checkpointing per
block, FSDP's unit rule), on meshes of one rank, so every hook, copy and DTensor dispatch of the real
wrapper runs while no transfer does (the links and ``probe.sync`` measure those). The costs grow with the
model's modules, so they are measured on the model that will run, not carried over from another.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import compat

FAMILIES = ("none", "ddp", "fsdp", "tp", "fsdp+tp")


@dataclass(frozen=True)
class Subject:
    """A model the probes time: ``build()`` (seeded by the caller), ``logits(model, ids)``, its vocabulary and
    sequence length, and ``tp_plan(model)`` (None: mg.parallelize's own choice)."""

    build: Callable[[], nn.Module]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    vocab: int
    seq_len: int
    tp_plan: Callable[[nn.Module], dict[str, Any]] | None = None

    def batch(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, self.vocab, (micro_batch, self.seq_len + 1))
        return x[:, :-1], x[:, 1:]

    def model(self, ac: bool = False) -> nn.Module:
        """The model, seeded, its blocks checkpointed as ``mg.parallelize`` checkpoints them when ``ac``."""
        from ..parallel import auto
        from ..parallel.spread import _checkpointed

        torch.manual_seed(0)
        model = self.build()
        if ac:
            for _, block in auto.block_modules(model):
                _checkpointed(block)
        return model


def gpt(cfg) -> Subject:
    """The GPT recipe's model, with the recipe's TP plan."""
    from ..recipes.gpt.model import GPT
    from ..recipes.gpt.parallelize import tp_plan

    return Subject(lambda: GPT(cfg), lambda m, x: m(x), cfg.vocab_size, cfg.block_size, tp_plan)


def causal_lm(config, seq_len: int) -> Subject:
    """A transformers causal LM built from ``config`` (no download), with the plan mg.parallelize takes."""
    import transformers

    return built(lambda: transformers.AutoModelForCausalLM.from_config(config), config.vocab_size, seq_len)


def built(build: Callable[[], nn.Module], vocab: int, seq_len: int) -> Subject:
    """Any language model ``build()`` returns, with the plan mg.parallelize takes: called as a transformers model
    (``input_ids=``, no cache) where its forward takes ``input_ids``, else with the ids; its logits the output or
    the output's ``.logits`` (decided once, on the model built on the meta device)."""
    import inspect

    with torch.device("meta"):
        takes = inspect.signature(build().forward).parameters
    cache = {"use_cache": False} if "use_cache" in takes else {}

    def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=x, **cache) if "input_ids" in takes else model(x)
        return getattr(out, "logits", out)

    return Subject(build, logits, vocab, seq_len)


def wrapped(subject: Subject, fam: str, ac: bool) -> nn.Module:
    """``subject``'s model with ``fam``'s wrapper on one rank (every mesh dimension of size 1)."""
    from ..parallel import auto
    from ..parallel.ddp import wrap_ddp
    from ..parallel.fsdp import shard_blocks, unit_rule
    from ..parallel.layout import Layout
    from ..parallel.spread import tensor_parallel_plan
    from ..parallel.tp import apply_tp

    model = subject.model(ac)
    if fam == "ddp":
        return wrap_ddp(model)
    mesh = Layout(dp_shard=1).device_mesh("cpu")  # the one builder's mesh, every degree 1
    if "tp" in fam:
        blocks = auto.block_modules(model)
        given = subject.tp_plan(model) if subject.tp_plan else None
        styles, _, _ = tensor_parallel_plan(model, Layout(), blocks, given)
        apply_tp(model, mesh["tp"], styles)
    if "fsdp" in fam:
        units, minimum, _ = unit_rule(model, None, None)
        shard_blocks(model, mesh["dp_shard"], block_classes=units, min_block_params=minimum)
    return model


def plus_loop(costs: dict, loop: dict) -> dict:
    """A layout's fixed costs per family: its wrapper's (``overheads``) and the training loop's (``probe.loop``)."""
    return {k: {"micro_s": v["micro_s"] + loop["micro_s"], "step_s": v["step_s"] + loop["step_s"]}
            for k, v in costs.items()}


def overheads(subject: Subject, micro_batch: int, threads: int, acs=(False, True), rounds: int = 7,
              families: tuple[str, ...] = FAMILIES) -> dict:
    """What each wrapper family of ``families`` adds (beside the plain model, always timed: the baseline),
    measured in this process over a process group of one rank.

    Per family and activation checkpointing: a training step (token count, the micro-batches under
    ``mg.accumulate``, ``mg.clip_grad_norm_``, AdamW, ``zero_grad``) is timed with 1 and 3 micro-batches of
    ``micro_batch`` sequences. ``micro_s`` = a further micro-batch's time less the plain model's (the
    wrapper's hooks, copies and dispatch per micro-batch), ``step_s`` = the rest of the step less the plain
    model's clip and AdamW (the wrapper's own per-step work: the gradients' synchronisation machinery, the
    token count, clipping and AdamW over DTensors). Families and counts are timed in turn, ``rounds`` times
    (median, each paired with the plain model's step of the same round)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _one_rank_group(), _quiet():
            keys = [(fam, ac) for fam in FAMILIES if fam == "none" or fam in families for ac in acs]
            steps = _Steps(subject, micro_batch, keys)
            times, opt_times = steps.timed(acs, rounds)
            return _costs(keys, times, opt_times, micro_batch, rounds)
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _one_rank_group():
    """A gloo process group of this process alone, unless one is up already (then left as it is)."""
    import torch.distributed as tdist

    own_group = not tdist.is_initialized()
    if own_group:
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own_group:
            tdist.destroy_process_group()


@contextlib.contextmanager
def _quiet():
    """The wrappers' advice to a training script (FSDP2's view-output warning, DTensor's two-mesh norm) is not
    the user's business here: the probe measures what they cost."""
    quiet = logging.getLogger(compat.REDISTRIBUTE_LOGGER)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        quiet.setLevel(level)


class _Steps:
    """Each (family, activation checkpointing) key's wrapped model and AdamW, and the steps timed on them."""

    def __init__(self, subject: Subject, micro_batch: int, keys: list[tuple[str, bool]]) -> None:
        self.subject, self.keys = subject, keys
        self.batch = subject.batch(micro_batch)
        self.built = {}
        for key in keys:
            model = wrapped(subject, *key)
            self.built[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(self, key: tuple[str, bool], k: int) -> None:
        """A training step of ``k`` micro-batches, as a training script runs it."""
        import multigpu as mg

        model, opt = self.built[key]
        micro = [self.batch] * k
        tokens = mg.token_divisor([y for _, y in micro])
        for xb, yb in mg.accumulate(model, micro):
            logits = self.subject.logits(model, xb)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), reduction="sum") / tokens
            loss.backward()
        mg.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain_optimizer(self, key: tuple[str, bool]) -> float:
        """The seconds of torch's own clip and AdamW step on ``key``'s model, after a backward."""
        model, opt = self.built[key]
        F.cross_entropy(self.subject.logits(model, self.batch[0]).flatten(0, 1), self.batch[1].flatten()).backward()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        return elapsed

    def timed(self, acs, rounds: int) -> tuple[dict, dict]:
        """Per (key, micro-batches) the seconds of each round's step, and per ``ac`` the plain optimizer's."""
        times: dict = {(key, k): [] for key in self.keys for k in (1, 3)}
        opt_times: dict = {ac: [] for ac in acs}
        for key in self.keys:
            self.step(key, 1)  # warm-up
        for _ in range(rounds):
            for key in self.keys:
                for k in (1, 3):
                    t0 = time.perf_counter()
                    self.step(key, k)
                    times[(key, k)].append(time.perf_counter() - t0)
            for ac in acs:
                opt_times[ac].append(self.plain_optimizer(("none", ac)))
        return times, opt_times


def _costs(keys: list[tuple[str, bool]], times: dict, opt_times: dict, micro_batch: int, rounds: int) -> dict:
    """Per key, the medians over the rounds of its further micro-batch's time and the rest of its step, each less
    the plain model's of the same round."""
    out: dict = {}
    for fam, ac in keys:
        micro, rest = [], []
        for r in range(rounds):
            one, three = times[((fam, ac), 1)][r], times[((fam, ac), 3)][r]
            plain = (times[(("none", ac), 3)][r] - times[(("none", ac), 1)][r]) / 2
            per = (three - one) / 2
            micro.append(per - plain)
            rest.append(one - per - opt_times[ac][r])
        out[f"{fam}{'+ac' if ac else ''}"] = {"micro_s": 0.0 if fam == "none" else max(0.0, statistics.median(micro)),
                                              "step_s": max(0.0, statistics.median(rest)),
                                              "micro_batch": micro_batch, "rounds": rounds}
    return out
