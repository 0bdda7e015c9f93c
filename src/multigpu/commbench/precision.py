"""``multigpu bench --precision bf16,fp8``: is a precision faster on this device, for this model?

One process, one device. The model is built once per precision from the same seed: the baseline (the first
precision) and the candidate, each with its own optimizer. ``mg.Precision`` runs each as a training loop
does (autocast, loss scaling, float8's conversion with its include/exclude). After ``--warmup`` steps of
each, rounds alternate A B A B (``--rounds``, ``--iters`` steps each), so a machine that speeds up or slows
down as it goes moves both alike. A round's rate is its tokens / its time, the device synchronised at both
ends. The speedup is given per round, with its median and range. The layers float8 converts and leaves out
are named, as ``amp.convert`` says them.

The verdict is drawn only where the rounds agree: faster or slower in every round. A slower float8 gets its
likely reason: no torch.compile to fuse the casts, or converted layers too small or too few. On a CPU
float8 is emulated in float32 arithmetic, so its speed says nothing of a GPU, and the verdict says so.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError

# The collective benchmark's flags that mean nothing to --precision: given (other than their default), refused.
COLLECTIVE_FLAGS = (("-n", "nproc"), ("--ops", "ops"), ("--sizes", "sizes"), ("--dtype", "dtype"),
                    ("--backend", "backend"), ("--group-size", "group_size"), ("--no-check", "no_check"),
                    ("--ddp", "ddp"), ("--bucket-cap-mb", "bucket_cap_mb"), ("--timeout", "timeout"))


@dataclasses.dataclass(frozen=True)
class PrecisionBench:
    """``multigpu bench --precision``'s flags; each field's docstring is its help (commbench/__init__.py)."""

    precision: str | None = None
    """time training steps in two precisions instead of collectives, the first the baseline: bf16,fp8 (any two
    of fp32, bf16, fp16, fp8)"""
    model: str = "gpt2"
    """with --precision: the GPT recipe's size (tiny, small, gpt2), a transformers config.json (or its folder),
    or module:function returning your nn.Module (token ids in, logits out) (default %(default)s)"""
    seq_len: int = 1024
    """with --precision: tokens per sequence (default %(default)s)"""
    batch: int = 8
    """with --precision: sequences per step (default %(default)s)"""
    rounds: int = 3
    """with --precision: A B rounds, each --iters steps of both (default %(default)s; at least 2)"""
    compile: bool = False
    """with --precision: torch.compile each block, as mg.parallelize compiles them"""
    fp8_recipe: str = "tensorwise"
    """with --precision ...fp8: torchao's scaling recipe, tensorwise or rowwise (default %(default)s)"""
    fp8_include: str = ""
    """with --precision ...fp8: modules (comma-separated) converted whatever the recipe's size rule says, as
    amp.convert(model, include=[...])"""
    fp8_exclude: str = ""
    """with --precision ...fp8: modules (comma-separated) left out, as amp.convert(model, exclude=[...])"""


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _check(args: Any, cfg: PrecisionBench) -> tuple[str, str]:
    from ..precision import PRECISIONS

    from .spec import BenchCommand

    given = [flag for flag, field in COLLECTIVE_FLAGS if getattr(args, field) != getattr(BenchCommand, field)]
    if given:
        raise UsageError(f"--precision times training steps, and {', '.join(given)} time collectives; run them as "
                         "two commands")
    pair = _names(cfg.precision or "")
    if len(pair) != 2 or pair[0] == pair[1] or any(p not in PRECISIONS for p in pair):
        raise UsageError(f"--precision takes two different precisions, the baseline first, from "
                         f"{', '.join(PRECISIONS)}; got {cfg.precision!r}, e.g. --precision bf16,fp8")
    if "fp8" not in pair and (cfg.fp8_include or cfg.fp8_exclude or cfg.fp8_recipe != "tensorwise"):
        raise UsageError(f"--fp8-recipe, --fp8-include and --fp8-exclude shape float8, which --precision "
                         f"{cfg.precision} does not time; add fp8 or leave them out")
    for flag, value, least in (("--rounds", cfg.rounds, 2), ("--iters", args.iters, 1), ("--seq-len", cfg.seq_len, 1),
                               ("--batch", cfg.batch, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            why = " (one round has no spread to judge a speedup by)" if flag == "--rounds" else ""
            raise UsageError(f"{flag} must be at least {least}{why}, got {value}")
    return pair[0], pair[1]


def _builder(spec: str, seq_len: int):
    """A function building the model ``spec`` names (its name for the header)."""
    from ..recipes.gpt.model import GPT, SIZES, config

    if spec in SIZES:
        return lambda: GPT(config(spec, block_size=seq_len)), f"GPT {spec}"
    from ..forecast.models import builder

    build, name = builder(spec)
    return build, name


def _vocab(model: nn.Module) -> int:
    """The token table's rows: the ids a random batch may hold."""
    table = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if table is None:
        raise UsageError(f"{type(model).__name__} has no nn.Embedding to read its vocabulary from; --precision "
                         "times language models (token ids in, logits out)")
    return table.num_embeddings


def _prepared(build, precision: str, cfg: PrecisionBench, device: torch.device) -> dict:
    from ..parallel.auto import block_modules
    from ..precision import Precision

    torch.manual_seed(0)
    model = build().to(device)
    amp = Precision(precision, device, recipe=cfg.fp8_recipe if precision == "fp8" else None)
    if precision == "fp8":
        try:
            model = amp.convert(model, _names(cfg.fp8_include), _names(cfg.fp8_exclude), verbose=False)
        except UsageError as err:  # the Python spelling of the fix, in the flags' words
            raise UsageError(str(err).replace("amp.convert(model, include=[", "--fp8-include ").replace("])", "")
                             .replace("leave it out of include=", "leave it out of --fp8-include")) from None
    if cfg.compile:
        for _, block in block_modules(model):
            block.compile()
    return {"model": model, "amp": amp, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4), "said": amp.converted}


def _steps(run: dict, batches: list[torch.Tensor], n: int, device: torch.device) -> float:
    """Seconds of ``n`` training steps, the device synchronised at both ends."""
    model, amp, opt = run["model"], run["amp"], run["opt"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(n):
        x = batches[i % len(batches)]
        with amp.autocast():
            out = model(x[:, :-1])
            logits = getattr(out, "logits", out)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                got = type(logits).__name__ if not isinstance(logits, torch.Tensor) else f"shape {tuple(logits.shape)}"
                raise UsageError(f"--precision times a language model: its forward takes token ids (batch, seq) and "
                                 f"returns logits (batch, seq, vocab) or an output with .logits, got {got}; wrap the "
                                 "model so its forward returns the logits")
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        amp.scale(loss).backward()
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def verdict(base: str, other: str, speedups: list[float], device: torch.device, compiled: bool) -> str:
    """What the rounds say: faster or slower only where every round agrees; float8 on a CPU never."""
    if "fp8" in (base, other) and device.type != "cuda":
        return "not measurable here: float8 is emulated on the CPU (float32 arithmetic), so this says nothing of a GPU"
    if min(speedups) > 1:
        return f"{other} faster than {base} in every round"
    if max(speedups) < 1:
        why = ""
        if other == "fp8":
            why = (": likely no torch.compile, so the casts to float8 run as kernels of their own (add --compile)"
                   if not compiled else ": likely the converted layers are too small or too few for float8 matmuls "
                   "to outrun the casts")
        return f"{other} slower than {base} in every round{why}"
    return f"no difference the {len(speedups)} rounds can tell apart (the speedup crosses 1 between rounds)"


def main(args: Any) -> int:
    cfg = PrecisionBench(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PrecisionBench)})
    base, other = _check(args, cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    build, name = _builder(cfg.model, cfg.seq_len)
    runs = {p: _prepared(build, p, cfg, device) for p in (base, other)}
    g = torch.Generator().manual_seed(1)
    vocab = _vocab(runs[base]["model"])
    batches = [torch.randint(0, vocab, (cfg.batch, cfg.seq_len + 1), generator=g).to(device) for _ in range(2)]
    for run in runs.values():
        _steps(run, batches, args.warmup, device)
    tokens = args.iters * cfg.batch * cfg.seq_len
    rates: dict[str, list[float]] = {base: [], other: []}
    for _ in range(cfg.rounds):
        for p, run in runs.items():  # A B A B
            rates[p].append(tokens / _steps(run, batches, args.iters, device))
    speedups = [b / a for a, b in zip(rates[base], rates[other])]
    said = verdict(base, other, speedups, device, cfg.compile)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    converted = next((r["said"] for r in runs.values() if r["said"]), "")
    if args.json:
        print(json.dumps({"model": name, "precisions": [base, other], "device": where, "torch": torch.__version__,
                          "compiled": cfg.compile, "tokens_per_step": cfg.batch * cfg.seq_len, "steps_per_round": args.iters,
                          "tokens_per_s": rates, "speedups": speedups, "median": statistics.median(speedups),
                          "float8": converted, "verdict": said}, indent=1))
        return 0
    print(f"{name}: {cfg.batch} x {cfg.seq_len} tokens a step, {args.iters} steps a round after {args.warmup} warm-up, "
          f"{where}, torch {torch.__version__}{', compiled per block' if cfg.compile else ''}")
    if converted:
        print(converted)
    for i, (a, b) in enumerate(zip(rates[base], rates[other]), 1):
        print(f"  round {i}: {base} {a:,.0f} tokens/s, {other} {b:,.0f} tokens/s: {b / a:.3f}x")
    print(f"{other} / {base}: median {statistics.median(speedups):.3f}x over {cfg.rounds} rounds "
          f"(range {min(speedups):.3f}-{max(speedups):.3f}x)")
    print(f"verdict: {said}")
    return 0
