"""Train the GPT recipe under any layout: data parallel, FSDP, tensor parallel, FSDP x TP, HSDP.

An ordinary training script on the public API:

    python -m multigpu.recipes.gpt --steps 50                              # one process
    multigpu run -n 2 --cpu -m multigpu.recipes.gpt --tp 2                 # tensor parallel
    multigpu run -n 4 --cpu -m multigpu.recipes.gpt --tp 2 --sequence-parallel --loss-parallel   # FSDP 2 x TP 2
    multigpu run -n 4 --cpu -m multigpu.recipes.gpt --dp-replicate 2       # HSDP 2 x 2
    multigpu run -n 2 --cpu -m multigpu.recipes.gpt --pp 2 --untied --micro-batch 2   # 2 pipeline stages, 1F1B
    multigpu run -n 2 --cpu -m multigpu.recipes.gpt --dp-replicate 2       # DDP (a layout that only replicates)

The layout comes from ``mg.layout_from_args`` like any script's (so tune, study
and verify re-lay-out it as they do any script), the model is spread by
``mg.parallelize`` or ``mg.parallel.pipeline`` with the GPT's tensor-parallel
plan (``parallelize.py``), and only public names are imported.

The loss is summed over each micro-batch's targets and divided by the step's
target count over every data-parallel rank (``mg.token_divisor``), so the
gradient is the same for every layout and split (masked targets, -100,
would count out of both). Under ``--pp`` the schedule's loss is each
micro-batch's mean (``scale_grads``), exact while micro-batches count the
same targets, as these windows do. Reports tokens/s and MFU through the
step meter (6N + 12·L·h·s FLOPs per token), and the held-out loss with bits
per byte (the built-in text is byte-tokenised, so bits per token are bits per
byte).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.meter import state_bytes

from .data import prepare_tokens, token_sets
from .model import GPT, SIZES, config
from .parallelize import check_layout, pipeline, spread

UsageError = mg.UsageError
LAYOUT_HELP = ("layout flags, read by mg.layout_from_args: --tp N, --pp N, --dp-replicate N, --dp-shard N (default: the "
               "rest of the world), --micro-batch N (sequences per data-parallel rank per forward), --schedule NAME "
               "(with --pp: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv; default 1f1b), "
               "--stages-per-rank N (with a looped schedule: interleaved_1f1b, looped_bfs, interleaved_zero_bubble; "
               "default 2), "
               "--sequence-parallel (with --tp), --activation-checkpointing, --compile. A layout that only replicates "
               "(--dp-replicate WORLD) is DDP.")
# Flags the recipe had that went (CHANGELOG.md), with what to write instead.
GONE = {"--ddp": "--ddp is gone: a layout that only replicates is DDP; use --dp-replicate N on N processes"}


def positive_int(value, flag: str, fix: str) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise UsageError(f"{flag} must be a positive integer, got {value}; {fix}")


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is a ``UsageError`` (one line, exit 2) instead of the whole usage text."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The layout (``mg.layout_from_args``, as ``args.layout``) and the recipe's own flags, checked
    (``check_args``): a value that cannot work is a ``UsageError`` here."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, instead in GONE.items():
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise UsageError(instead)
    layout, rest = mg.layout_from_args(argv)
    p = _Parser(prog="python -m multigpu.recipes.gpt", description=__doc__.split("\n")[0], epilog=LAYOUT_HELP)
    p.add_argument("--size", default="tiny", metavar="SIZE",
                   help=f"model size: {', '.join(SIZES)} (default tiny, < 1M parameters)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default: the size's)")
    p.add_argument("--data", default=None, help="directory with train.bin/val.bin (uint16), a directory of *train*/*val* "
                   "token shards (.bin, .npy), or a datasets save_to_disk folder with a token-id column; default: "
                   "Python's docs as bytes")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, over all data-parallel ranks")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--pp-splits", default=None, metavar="B,B,...",
                   help="with --pp: first block of every pipeline stage after the first (default: balanced, the embeddings "
                   "and the head counted as one block each)")
    p.add_argument("--untied", action="store_true", help="separate token table and head (a pipeline puts them on two stages)")
    p.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary-sharded logits (needs --tp)")
    p.add_argument("--grad-sync", choices=("last", "each"), default="last",
                   help="accumulating, reduce the gradients on the last micro-batch or on each (FSDP then holds its "
                        "shard of them, not every block's unsharded one: mg.accumulate's sync=)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast dtype (mg.Precision)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out loss every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out sequences evaluated: this many global batches")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--profile", default=None, metavar="START:STOP",
                   help="torch.profiler over these steps on every rank (a stage each under --pp): traces and the time split")
    p.add_argument("--checkpoint-dir", default=None, help="save here (and resume from here) with mg.Checkpointer")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (and the last one)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background: the loop waits only for the host copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, metavar="PATH",
                   help="write the result, with the training state's bytes and the most a warm-up step held (the "
                        "StepMeter's step_peak: mg.meter.MemoryStep, the largest rank), to PATH (rank 0)")
    args = p.parse_args(rest)
    args.layout = layout
    args.schedule_given = any(a == "--schedule" or a.startswith("--schedule=") for a in argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before any work, every value that cannot work (one ``UsageError`` each)."""
    if args.size not in SIZES:
        raise UsageError(f"--size must be one of {', '.join(SIZES)}, got {args.size!r}; use e.g. --size tiny")
    positive_int(args.steps, "--steps", "use e.g. --steps 50")
    positive_int(args.global_batch, "--global-batch", "use e.g. --global-batch 16")
    if args.block_size is not None:
        positive_int(args.block_size, "--block-size",
                     f"omit it for the size's own ({args.size}: {SIZES[args.size].block_size})")
    positive_int(args.eval_every, "--eval-every", "use e.g. --eval-every 25 (the end is always evaluated)")
    positive_int(args.eval_batches, "--eval-batches", "use e.g. --eval-batches 8")
    positive_int(args.log_every, "--log-every", "use e.g. --log-every 10")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr:g}; use e.g. --lr 1e-3")
    if not (math.isfinite(args.clip) and args.clip >= 0):
        raise UsageError(f"--clip is the largest global gradient norm, 0 or more (0: off), got {args.clip:g}; "
                         "use e.g. --clip 1.0")
    if args.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be 0 or more (0: off), got {args.warmup_steps}; use e.g. --warmup-steps 10")
    pp = args.layout.pp
    pipeline_only = [f for f, given in (("--schedule", args.schedule_given), ("--pp-splits", args.pp_splits is not None),
                                        ("--stages-per-rank", args.layout.stages_per_rank is not None))
                     if given]
    if pipeline_only and pp <= 1:
        raise UsageError(f"{' and '.join(pipeline_only)} {'set' if len(pipeline_only) > 1 else 'sets'} the pipeline "
                         f"but --pp is {pp} (no pipeline); add --pp 2 or more (with --untied), or drop "
                         f"{' and '.join(pipeline_only)}")
    if args.pp_splits is not None:
        args.splits = _int_list(args.pp_splits, "--pp-splits")
    if args.loss_parallel and args.layout.tp == 1:
        raise UsageError("--loss-parallel keeps the logits split over tensor-parallel ranks but --tp is 1; "
                         "add --tp 2 or drop --loss-parallel")
    if pp > 1 and args.loss_parallel:
        raise UsageError("--loss-parallel keeps the logits sharded into the loss, which the pipeline schedule "
                         "computes on its own; drop --loss-parallel with --pp")
    if pp > 1 and args.precision != "fp32":
        raise UsageError(f"--precision {args.precision} under --pp: the pipeline schedule runs forward and backward "
                         "itself, outside the loop's autocast; use --precision fp32 with --pp")
    cfg = config(args.size, **({"block_size": args.block_size} if args.block_size else {}),
                 **({"tie_embeddings": False} if args.untied else {}))
    check_layout(cfg, args.layout)  # the layout's size rules on the GPT (the world is checked at mg.init)
    args.cfg = cfg
    if args.data is not None:  # headers and sizes only: every layout's refusal comes before any work
        block = args.block_size or SIZES[args.size].block_size
        args.token_sets = block, token_sets(args.data, block)  # kept: _datasets does not read them again


def _datasets(args, cfg):
    block, sets = getattr(args, "token_sets", (None, None))
    if sets is None or block != cfg.block_size:
        data = args.data or prepare_tokens(os.path.join(tempfile.gettempdir(), "multigpu-pydoc-tokens"))
        return token_sets(data, cfg.block_size, cfg.vocab_size)
    for part in sets:
        part.check_vocab(cfg.vocab_size)
    return sets


def evaluate(model, val_set, layout, dist, batch_size: int, sequences: int, loss_parallel: bool) -> dict[str, float]:
    """Mean held-out loss per token over the first ``sequences`` windows; every TP peer computes it, one counts it."""
    model.eval()
    subset = torch.utils.data.Subset(val_set, range(min(sequences, len(val_set))))
    total = tokens = 0.0
    with torch.no_grad():
        for x, y in mg.eval_loader(subset, dist, batch_size, layout=layout):
            x, y = x.to(dist.device), y.to(dist.device)
            with mg.parallel.loss_parallel(loss_parallel):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            total += float(_full(loss))
            tokens += y.numel()
    model.train()
    return _held_out(total, tokens)


def evaluate_pipeline(pipe, val_set, layout, dist, plan, sequences: int) -> dict[str, float]:
    """Held-out mean loss per token through the pipeline (forward only), in groups of the schedule's
    micro-batch count; the last stage's ranks count it, once per tensor-parallel group (the layout's
    schedule places the last stage: ``mg.all_reduce_sum`` counts it)."""
    # Whole groups on every data-parallel rank: FSDP's gathers need each rank to run as many forwards.
    unit = layout.dp_size * plan.micro_batch * pipe.accum_steps
    if len(val_set) < unit:
        raise mg.UsageError(f"the held-out set has {len(val_set)} sequences, fewer than one pipeline evaluation "
                            f"({unit} = {layout.dp_size} data-parallel ranks x {pipe.accum_steps} micro-batches of "
                            f"{plan.micro_batch}); use a smaller --block-size or --micro-batch, or more held-out data")
    n = max(min(sequences, len(val_set)) // unit, 1) * unit
    subset = torch.utils.data.Subset(val_set, range(n))
    batches = [(x.to(dist.device), y.to(dist.device)) for x, y in mg.eval_loader(subset, dist, plan.micro_batch,
                                                                                 layout=layout)]
    groups = [batches[i:i + pipe.accum_steps] for i in range(0, len(batches), pipe.accum_steps)]
    total = tokens = 0.0
    for group in groups:
        loss = pipe.evaluate(group)
        if loss is not None:
            n = sum(y.numel() for _, y in group)
            total, tokens = total + float(_full(loss)) * n, tokens + n
    return _held_out(total, tokens)


def _held_out(total: float, tokens: float) -> dict[str, float]:
    """The mean loss per token over the data-parallel ranks, each once (``mg.all_reduce_sum`` leaves out the
    tensor-parallel peers' copies and the earlier stages'), and bits per byte (collective)."""
    sums = mg.all_reduce_sum({"loss": total, "tokens": tokens})
    mean = sums["loss"] / max(sums["tokens"], 1.0)
    return {"loss": mean, "bits_per_byte": mean / math.log(2)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    try:
        args = parse_args(argv)  # every flag refusal happens here, before mg.init starts any work
    except UsageError as err:  # before mg.init, which would turn it into this line itself
        err.exit()
    with mg.init(seed=args.seed) as dist:
        cfg = args.cfg
        train_set, val_set = _datasets(args, cfg)
        layout = args.layout.resolve(dist.world_size)
        plan = layout.plan(args.global_batch, dist)
        model, pipe = _build(args, cfg, layout, plan, dist)
        amp = mg.Precision(args.precision, dist.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = mg.warmup(opt, steps=args.warmup_steps) if args.warmup_steps else None
        train = mg.loader(train_set, plan, dist, shuffle=True, seed=args.seed)
        mg.print0(plan.summary(layout=layout.label, parameters=cfg.parameters,
                               tokens_per_step=plan.global_batch * cfg.block_size))
        meter = mg.StepMeter(dist, plan, log_every=args.log_every, log_dir=args.log_dir, total_steps=args.steps,
                             flops_per_sample=cfg.flops_per_token() * cfg.block_size, tokens_per_sample=cfg.block_size,
                             dtype=amp.name, profile=args.profile, step_peak=True if args.result_json else None,
                             fingerprint_extra={"recipe": "gpt", "size": args.size, "layout": layout.label})
        ckpt, start = None, 0
        if args.checkpoint_dir:
            ckpt = mg.Checkpointer(args.checkpoint_dir, every=args.checkpoint_every, keep=2, model=model,
                                   optimizer=opt, scheduler=sched, scaler=amp, loader=train,
                                   async_save=args.async_checkpoint)
            start = ckpt.resume()
        metrics: dict[str, float] = {}
        with meter:
            for step, micro_batches in meter.steps(_forever(train), start=start):
                if step >= args.steps:
                    break  # resumed from the end
                done = step + 1 == args.steps
                if pipe is not None:
                    # Stage times at log steps only (the meter sums a metric over its interval's steps):
                    # on a GPU each read waits for the device.
                    step_loss, extra = _pipeline_step(pipe, opt, sched, args, micro_batches, dist.device,
                                                      stage_times=meter.will_log or done)
                else:
                    step_loss, extra = _model_step(model, opt, sched, amp, args, micro_batches)
                meter.step_end(loss=step_loss, lr=opt, **extra)
                if ckpt is not None:
                    with meter.pause("checkpoint"):  # with --async-checkpoint, only the host copy
                        ckpt.save(step, force=done)
                if done or (step + 1) % args.eval_every == 0:
                    with meter.pause("eval"):
                        metrics = _evaluate(model, pipe, val_set, layout, dist, plan, args)
                    meter.log_eval(step=step, loss=metrics["loss"], bits_per_byte=metrics["bits_per_byte"])
                if done:
                    break
        if ckpt is not None:
            ckpt.finish()
        return _finish(args, cfg, dist, layout, meter, metrics, model, opt)


def _build(args, cfg, layout, plan, dist):
    """(model, pipeline or None): the full model, the same on every rank, then spread by the layout: TP with
    the GPT's plan, checkpointing and compile per block, then FSDP/HSDP, or DDP when the layout only
    replicates; under a pipeline each stage the same way, inside the stage."""
    torch.manual_seed(args.seed)  # weights as one process's
    model = GPT(cfg).to(dist.device)
    if layout.pp > 1:
        pipe = pipeline(model, layout, plan, getattr(args, "splits", None))
        return pipe.model, pipe
    return spread(model, layout, loss_parallel=args.loss_parallel), None


def _evaluate(model, pipe, val_set, layout, dist, plan, args) -> dict[str, float]:
    sequences = args.eval_batches * plan.global_batch
    if pipe is not None:
        return evaluate_pipeline(pipe, val_set, layout, dist, plan, sequences)
    return evaluate(model, val_set, layout, dist, plan.micro_batch, sequences, args.loss_parallel)


def _finish(args, cfg, dist, layout, meter, metrics, model, opt) -> dict[str, float]:
    """The run's result (and --result-json's file, collective), and its closing line."""
    summary = meter.summary() or {}
    sps = summary.get("samples_per_s")
    peak = torch.cuda.max_memory_allocated(dist.device) if dist.device.type == "cuda" else None
    result = dict(metrics, world_size=dist.world_size, steps=args.steps,
                  tokens_per_s=sps * cfg.block_size if sps else None, wall_s=summary.get("wall_time"),
                  mfu=summary.get("mfu"), peak_memory_bytes=peak, stages=summary.get("stages"))
    mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
    mem = f", peak memory {peak / 2**30:.2f} GiB" if peak is not None else ""
    tps = f"{result['tokens_per_s']:,.0f} tokens/s" if result["tokens_per_s"] else "tokens/s n/a"
    if args.result_json:
        _write_result(args.result_json, result, state_bytes(model, opt).total,
                      (summary.get("step_peak") or {}).get("bytes"), dist)  # rank 0's summary: the largest rank's
    mg.print0(f"gpt {args.size}: val loss {metrics.get('loss', float('nan')):.4f} "
              f"({metrics.get('bits_per_byte', float('nan')):.3f} bits/byte); {tps}{mfu}{mem} | {layout.label}")
    return result


def _pipeline_step(pipe, opt, sched, args, micro_batches, device, stage_times: bool):
    """The schedule runs forward and backward: the mean micro-batch loss on the last stage's rank
    (and, with ``stage_times``, each stage's time)."""
    loss = pipe.step([(x.to(device), y.to(device)) for x, y in micro_batches])
    if args.clip:
        pipe.clip_grad_norm_(args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    return loss, pipe.stage_times() if stage_times else {}


def _model_step(model, opt, sched, amp, args, micro_batches):
    """Every micro-batch's summed token loss over the step's global count: this rank's share of the loss."""
    tokens = mg.token_divisor([y for _, y in micro_batches])
    step_loss = 0.0
    for x, y in mg.accumulate(model, micro_batches, sync=args.grad_sync):
        with mg.parallel.loss_parallel(args.loss_parallel):
            with amp.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / tokens
            amp.scale(loss).backward()
        step_loss = step_loss + _full(loss).detach()
    if args.clip:
        amp.unscale_(opt)
        mg.clip_grad_norm_(model, args.clip)
    amp.step(opt)
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    return step_loss, {}


def _write_result(path: str, result: dict, state: int, peak: int | None, dist) -> None:
    """Rank 0 writes ``result`` with the largest rank's memory: its training state and the most a warm-up step
    held (the StepMeter's ``step_peak``, on rank 0; None where it could not be measured). Collective: every rank
    calls it."""
    sizes = [float(state), float(peak if peak is not None else -1)]
    if torch.distributed.is_initialized():
        t = torch.tensor(sizes, dtype=torch.float64, device=dist.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        sizes = t.cpu().tolist()
    if dist.is_main:
        with open(path, "w") as fp:
            json.dump(dict(result, memory={"state_bytes": sizes[0], "total_bytes": sizes[1] if sizes[1] >= 0 else None}),
                      fp, indent=1, default=str)


def _int_list(text: str, flag: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"{flag} takes comma-separated block indices like 2,4, got {text!r}")
    return [int(p) for p in parts]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A loss under loss parallelism is a DTensor: its value, the same on every tensor-parallel rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _forever(train):
    while True:
        yield from train
