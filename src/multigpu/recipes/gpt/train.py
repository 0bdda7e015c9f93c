"""Train the GPT recipe under any layout: data parallel, FSDP, tensor parallel, FSDP x TP, HSDP.

An ordinary training script on the public API:

    python -m multigpu.recipes.gpt --steps 50                              # one process
    multigpu run -n 2 --cpu -m multigpu.recipes.gpt --tp 2                 # tensor parallel
    multigpu run -n 4 --cpu -m multigpu.recipes.gpt --tp 2 --sequence-parallel --loss-parallel   # FSDP 2 x TP 2
    multigpu run -n 4 --cpu -m multigpu.recipes.gpt --dp-replicate 2       # HSDP 2 x 2
    multigpu run -n 2 --cpu -m multigpu.recipes.gpt --pp 2 --untied --micro-batch 2   # 2 pipeline stages, 1F1B

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
import contextlib
import dataclasses
import functools
import json
import math
import os
import tempfile

import torch
import torch.nn.functional as F

import multigpu as mg

from . import pipeline
from ...errors import UsageError, report_usage_error
from ...parallel.footprint import LiveActivations, state_bytes
from ...runtime.values import int_list, positive_int
from .data import prepare_tokens, token_sets
from .model import GPT, SIZES, config
from .parallelize import spread


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is a ``UsageError`` (one line, exit 2) instead of the whole usage text."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's flags, checked (``check_args``): a value that cannot work is a ``UsageError`` here."""
    p = _Parser(prog="python -m multigpu.recipes.gpt", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny", metavar="SIZE",
                   help=f"model size: {', '.join(SIZES)} (default tiny, < 1M parameters)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default: the size's)")
    p.add_argument("--data", default=None, help="directory with train.bin/val.bin (uint16), a directory of *train*/*val* "
                   "token shards (.bin, .npy), or a datasets save_to_disk folder with a token-id column; default: "
                   "Python's docs as bytes")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, over all data-parallel ranks")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per data-parallel rank per forward")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (innermost mesh dimension)")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas of the sharded model (HSDP's outer dimension)")
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP degree (default: the rest of the world)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages' ranks (outermost mesh dimension; needs --untied)")
    p.add_argument("--schedule", default=None, help="pipeline schedule (with --pp): gpipe, 1f1b, interleaved_1f1b, "
                   "looped_bfs, interleaved_zero_bubble, zbv (default 1f1b)")
    p.add_argument("--pp-splits", default=None, metavar="B,B,...",
                   help="with --pp: first block of every pipeline stage after the first (default: balanced, the embeddings "
                   "and the head counted as one block each)")
    p.add_argument("--untied", action="store_true", help="separate token table and head (a pipeline puts them on two stages)")
    p.add_argument("--ddp", action="store_true",
                   help="plain DDP over every rank instead of FSDP (tp 1 only): one bucketed all-reduce per step, no "
                   "DTensor; the same as --dp-replicate WORLD (a layout that only replicates is DDP)")
    p.add_argument("--sequence-parallel", action="store_true", help="split norms and residuals along the sequence (needs --tp)")
    p.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary-sharded logits (needs --tp)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in the backward instead of keeping its activations")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast dtype (mg.Precision)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (names unchanged; slow to start on CPU)")
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
                   help="write the result, with each rank's training-state and peak activation bytes (max over ranks), "
                        "to PATH (rank 0; `multigpu tune` reads it)")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before any work, every value that cannot work (one ``UsageError`` each)."""
    if args.size not in SIZES:
        raise UsageError(f"--size must be one of {', '.join(SIZES)}, got {args.size!r}; use e.g. --size tiny")
    positive_int(args.steps, "--steps", "use e.g. --steps 50")
    positive_int(args.global_batch, "--global-batch", "use e.g. --global-batch 16")
    if args.micro_batch is not None:
        positive_int(args.micro_batch, "--micro-batch", "omit it for a rank's whole share")
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
    pipeline_only = [f for f, v in (("--schedule", args.schedule), ("--pp-splits", args.pp_splits)) if v is not None]
    if pipeline_only and args.pp <= 1:
        raise UsageError(f"{' and '.join(pipeline_only)} {'set' if len(pipeline_only) > 1 else 'sets'} the pipeline "
                         f"but --pp is {args.pp} (no pipeline); add --pp 2 or more (with --untied), or drop "
                         f"{' and '.join(pipeline_only)}")
    if args.pp_splits is not None:
        _int_list(args.pp_splits, "--pp-splits")
    if args.ddp and (args.tp > 1 or args.dp_replicate > 1 or args.dp_shard is not None or args.pp > 1):
        raise UsageError("--ddp replicates the model over every rank; drop --tp, --pp, --dp-replicate and --dp-shard")
    if args.pp > 1 and args.loss_parallel:
        raise UsageError("--loss-parallel keeps the logits sharded into the loss, which the pipeline schedule "
                         "computes on its own; drop --loss-parallel with --pp")
    if args.pp > 1 and args.precision != "fp32":
        raise UsageError(f"--precision {args.precision} under --pp: the pipeline schedule runs forward and backward "
                         "itself, outside the loop's autocast; use --precision fp32 with --pp")
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


def evaluate(model, val_set, mesh, dist, batch_size: int, sequences: int, loss_parallel: bool) -> dict[str, float]:
    """Mean held-out loss per token over the first ``sequences`` windows; every TP peer computes it, one counts it."""
    model.eval()
    subset = torch.utils.data.Subset(val_set, range(min(sequences, len(val_set))))
    total = tokens = 0.0
    with torch.no_grad():
        for x, y in mg.eval_loader(subset, dist, batch_size, mesh=mesh):
            x, y = x.to(dist.device), y.to(dist.device)
            with mg.parallel.loss_parallel(loss_parallel):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            total += float(_full(loss))
            tokens += y.numel()
    model.train()
    return _held_out(total, tokens, counts=mesh.tp_rank == 0)  # TP peers hold the same numbers


def evaluate_pipeline(pipe, val_set, mesh, dist, plan, sequences: int, schedule: str) -> dict[str, float]:
    """Held-out mean loss per token through the pipeline (forward only), in groups of the schedule's
    micro-batch count; the last stage's ranks count it, once per tensor-parallel group."""
    # The Layout, not the mesh: its schedule says which rank holds the last stage (mg.all_reduce_sum counts it).
    layout = dataclasses.replace(mg.parallel.Layout.of(mesh), schedule=schedule)
    # Whole groups on every data-parallel rank: FSDP's gathers need each rank to run as many forwards.
    unit = mesh.dp_size * plan.micro_batch * pipe.accum_steps
    if len(val_set) < unit:
        raise mg.UsageError(f"the held-out set has {len(val_set)} sequences, fewer than one pipeline evaluation "
                            f"({unit} = {mesh.dp_size} data-parallel ranks x {pipe.accum_steps} micro-batches of "
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
    return _held_out(total, tokens, counts=pipe.has_last and mesh.tp_rank == 0)


def _held_out(total: float, tokens: float, counts: bool) -> dict[str, float]:
    """The mean loss per token over every rank whose numbers ``counts`` (collective), and bits per byte."""
    once = 1.0 if counts else 0.0
    sums = mg.all_reduce_sum({"loss": total * once, "tokens": tokens * once})
    mean = sums["loss"] / max(sums["tokens"], 1.0)
    return {"loss": mean, "bits_per_byte": mean / math.log(2)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    try:
        args = parse_args(argv)  # every flag refusal happens here, before mg.init starts any work
    except UsageError as err:  # before mg.init, which would turn it into this line itself
        report_usage_error(err)
        raise SystemExit(2) from None
    with mg.init(seed=args.seed) as dist:
        cfg = config(args.size, **({"block_size": args.block_size} if args.block_size else {}),
                     **({"tie_embeddings": False} if args.untied else {}))
        train_set, val_set = _datasets(args, cfg)
        # --ddp is the layout that only replicates, which mg.parallelize spreads by DDP.
        replicas = dist.world_size if args.ddp else args.dp_replicate
        mesh = mg.parallel.mesh(dist, tp=args.tp, dp_replicate=replicas, dp_shard=args.dp_shard, pp=args.pp)
        plan = mesh.plan(args.global_batch, micro_batch=args.micro_batch)
        model, pipe = _build(args, cfg, mesh, plan, dist)
        amp = mg.Precision(args.precision, dist.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = mg.warmup(opt, steps=args.warmup_steps) if args.warmup_steps else None
        train = mg.loader(train_set, plan, dist, shuffle=True, seed=args.seed)
        layout = "ddp" if args.ddp else repr(mesh)
        mg.print0(plan.summary(layout=layout, parameters=cfg.parameters, tokens_per_step=plan.global_batch * cfg.block_size))
        meter = mg.StepMeter(dist, plan, log_every=args.log_every, log_dir=args.log_dir, total_steps=args.steps,
                             flops_per_sample=cfg.flops_per_token() * cfg.block_size, tokens_per_sample=cfg.block_size,
                             dtype=amp.name, profile=args.profile,
                             fingerprint_extra={"recipe": "gpt", "size": args.size, "layout": layout})
        ckpt, start = None, 0
        if args.checkpoint_dir:
            ckpt = mg.Checkpointer(args.checkpoint_dir, every=args.checkpoint_every, keep=2, model=model,
                                   optimizer=opt, scheduler=sched, scaler=amp, loader=train,
                                   async_save=args.async_checkpoint)
            start = ckpt.resume()
        metrics: dict[str, float] = {}
        # Saved tensors are counted in the first step only (a warm-up step, outside the throughput).
        acts = LiveActivations(model.parameters()) if args.result_json else None
        with meter:
            for step, micro_batches in meter.steps(_forever(train), start=start):
                if step >= args.steps:
                    break  # resumed from the end
                done = step + 1 == args.steps
                with acts.hooks() if acts is not None and step == start else contextlib.nullcontext():
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
                        metrics = _evaluate(model, pipe, val_set, mesh, dist, plan, args)
                    meter.log_eval(step=step, loss=metrics["loss"], bits_per_byte=metrics["bits_per_byte"])
                if done:
                    break
        if ckpt is not None:
            ckpt.finish()
        return _finish(args, cfg, dist, mesh, meter, metrics, acts, model, opt)


def _build(args, cfg, mesh, plan, dist):
    """(model, pipeline or None): the full model, the same on every rank, then spread over the mesh."""
    torch.manual_seed(args.seed)  # weights as one process's
    # mg.parallelize with the GPT's plan: TP, checkpointing and compile per block, then FSDP/HSDP, or DDP
    # when the mesh only replicates (--ddp); each pipeline stage the same way, inside the stage.
    spread_gpt = functools.partial(spread, mesh=mesh, sequence_parallel=args.sequence_parallel,
                                   loss_parallel=args.loss_parallel,
                                   activation_checkpointing=args.activation_checkpointing, compile=args.compile)
    pipe = None
    if args.pp > 1:
        splits = _int_list(args.pp_splits, "--pp-splits") if args.pp_splits else None
        pipe = pipeline.build(GPT(cfg).to(dist.device), mesh, dist.device, args.schedule or "1f1b",
                              plan.accum_steps, functools.partial(spread_gpt, pipeline_stage=True), splits)
        model = pipe.model
    else:
        model = spread_gpt(GPT(cfg).to(dist.device))
    return model, pipe


def _evaluate(model, pipe, val_set, mesh, dist, plan, args) -> dict[str, float]:
    sequences = args.eval_batches * plan.global_batch
    if pipe is not None:
        return evaluate_pipeline(pipe, val_set, mesh, dist, plan, sequences, args.schedule or "1f1b")
    return evaluate(model, val_set, mesh, dist, plan.micro_batch, sequences, args.loss_parallel)


def _finish(args, cfg, dist, mesh, meter, metrics, acts, model, opt) -> dict[str, float]:
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
    if acts is not None:
        _write_result(args.result_json, result, state_bytes(model, opt).total, acts.peak, dist)
    mg.print0(f"gpt {args.size}: val loss {metrics.get('loss', float('nan')):.4f} "
              f"({metrics.get('bits_per_byte', float('nan')):.3f} bits/byte); {tps}{mfu}{mem} | {repr(mesh)}")
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
    for x, y in mg.accumulate(model, micro_batches):
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


def _write_result(path: str, result: dict, state: int, activations: int, dist) -> None:
    """Rank 0 writes ``result`` with the largest rank's memory (collective: every rank calls it)."""
    peak = [float(state), float(activations), float(state + activations)]
    if torch.distributed.is_initialized():
        t = torch.tensor(peak, dtype=torch.float64, device=dist.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peak = t.cpu().tolist()
    if dist.is_main:
        with open(path, "w") as fp:
            json.dump(dict(result, memory={"state_bytes": peak[0], "activation_bytes": peak[1], "total_bytes": peak[2]}),
                      fp, indent=1, default=str)


def _int_list(text: str, flag: str) -> list[int]:
    return list(int_list(text, f"{flag} takes comma-separated block indices like 2,4"))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A loss under loss parallelism is a DTensor: its value, the same on every tensor-parallel rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _forever(train):
    while True:
        yield from train
