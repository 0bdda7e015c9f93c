"""Handwritten digits (scikit-learn's 1,797 8x8 images) with a small MLP.

An ordinary training script on the public API: it runs unchanged under
``python -m multigpu.recipes.digits``, ``torchrun`` and ``multigpu run``.

    multigpu run -n 2 -m multigpu.recipes.digits --epochs 20
    multigpu run -n 2 --cpu --find-batch --memory-budget 2MiB -m multigpu.recipes.digits --global-batch 1024
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.runtime.values import parse_size


def digits_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Stratified 80/20 split of sklearn's digits, pixels scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise mg.UsageError("the digits recipe needs scikit-learn; pip install 'multigpu[recipes]'") from None
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)

    def as_set(xs, ys):
        return TensorDataset(torch.tensor(xs, dtype=torch.float32) / 16.0, torch.tensor(ys, dtype=torch.long))

    return as_set(x_tr, y_tr), as_set(x_te, y_te)


def make_model(hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def evaluate(model: nn.Module, test_set, dist: mg.Dist, amp: mg.Precision) -> dict[str, float]:
    """Exact test loss and accuracy over the whole test set, on any world size."""
    model.eval()
    local = {"correct": 0.0, "count": 0.0, "loss_sum": 0.0}
    with torch.no_grad(), amp.autocast():
        for x, y in mg.eval_loader(test_set, dist, batch_size=512):
            x, y = x.to(dist.device), y.to(dist.device)
            logits = model(x)
            local["loss_sum"] += nn.functional.cross_entropy(logits.float(), y, reduction="sum").item()
            local["correct"] += (logits.argmax(1) == y).sum().item()
            local["count"] += len(y)
    model.train()
    total = mg.all_reduce_sum(local)
    return {"accuracy": total["correct"] / total["count"], "loss": total["loss_sum"] / total["count"],
            "correct": total["correct"], "count": total["count"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="multigpu.recipes.digits", description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, over all ranks")
    p.add_argument("--micro-batch", type=int, default=None, help="per-rank micro-batch (default: whole share)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate at --base-batch")
    p.add_argument("--base-batch", type=int, default=64, help="batch size at which --lr was tuned")
    p.add_argument("--lr-rule", default="linear", choices=["linear", "sqrt", "none"])
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps (default: --epochs)")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every N epochs (and at the end)")
    p.add_argument("--log-every", type=int, default=10, help="step meter: log every N steps")
    p.add_argument("--log-dir", default=None, help="where metrics.jsonl goes (default: the launcher's run folder, or runs/)")
    p.add_argument("--hidden", type=int, default=256,
                   help="width of the two hidden layers (256: 85k parameters; 2048: 4.3M, a compute-bound step)")
    p.add_argument("--strategy", default="ddp", help="none | dp | ddp (more in later issues)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--noise-every", type=int, default=0,
                   help="measure the gradient noise scale every N steps (0: off; one process needs --micro-batch)")
    p.add_argument("--find-batch", action="store_true",
                   help="search the largest micro-batch that fits, keeping --global-batch (accumulating the rest); "
                        "also on with `multigpu run --find-batch`")
    p.add_argument("--memory-budget", metavar="SIZE", default=None,
                   help="memory budget for --find-batch on CPU, e.g. 64MiB (2^20) or 64MB (10^6) "
                        "(default: `multigpu run --memory-budget`'s)")
    args = p.parse_args(argv)
    if args.memory_budget is not None:
        try:
            args.memory_budget = parse_size(args.memory_budget, "--memory-budget")
        except mg.UsageError as err:
            p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    with mg.init(seed=args.seed) as dist:
        train_set, test_set = digits_datasets(seed=0)
        plan = mg.BatchPlan(args.global_batch, dist.world_size, micro_batch=args.micro_batch)
        strategy = args.strategy if not (args.strategy == "ddp" and dist.world_size == 1) else "none"
        net = make_model(args.hidden).to(dist.device)
        if args.find_batch or mg.find_batch_requested():
            plan = _find_batch(net, plan, dist, args.memory_budget)
        model = mg.wrap(net, strategy)
        noise = mg.NoiseScale(plan, every=args.noise_every).attach(model) if args.noise_every else None
        lr = mg.scale_lr(args.lr, base_batch=args.base_batch, batch=plan.global_batch, rule=args.lr_rule)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        sched = mg.warmup(opt, steps=args.warmup_steps, start_lr=min(args.lr, lr)) if args.warmup_steps else None
        amp = mg.Precision(args.precision, dist.device)
        train = mg.loader(train_set, plan, dist, shuffle=True, seed=args.seed, num_workers=args.num_workers)
        mg.print0(plan.summary(lr=lr, steps_per_epoch=len(train), epochs=args.epochs, precision=args.precision,
                               strategy=strategy, backend=dist.backend, device=str(dist.device)))
        loss_fn = nn.CrossEntropyLoss()
        total = args.steps or args.epochs * len(train)
        meter = mg.StepMeter(dist, plan, log_every=args.log_every, log_dir=args.log_dir, model=model, total_steps=total,
                             dtype=amp.name, fingerprint_extra={"recipe": "digits", "strategy": strategy, "lr": lr,
                                                                "precision": amp.name})
        with meter:
            epoch = 0
            for step, micro_batches in meter.steps(_epochs(train)):
                for x, y in mg.accumulate(model, micro_batches):
                    with amp.autocast():
                        loss = loss_fn(model(x), y) / plan.accum_steps
                    amp.scale(loss).backward()
                amp.step(opt)
                opt.zero_grad(set_to_none=True)
                if sched is not None:
                    sched.step()
                done = step + 1 == total
                if noise is not None and done:
                    noise.flush()  # every rank: the last steps' all-reduce, so the final record has them
                    meter.log(noise.metrics())
                meter.step_end(loss=loss.detach() * plan.accum_steps, lr=opt)
                if noise is not None and meter.will_log:
                    meter.log(noise.metrics())
                if (step + 1) % len(train) == 0 or done:
                    epoch = (step + 1) // len(train)
                    if done or epoch % args.eval_every == 0:
                        with meter.pause("eval"):
                            metrics = evaluate(model, test_set, dist, amp)
                        meter.log_eval(step=step, accuracy=metrics["accuracy"], loss=metrics["loss"])
                if done:
                    break
        summary = meter.summary() or {}
        result = dict(metrics, world_size=dist.world_size, steps=total,
                      samples_per_s=summary.get("samples_per_s"), wall_s=summary.get("wall_time"))
        if noise is not None:
            result |= noise.metrics()
            mg.print0(noise.summary())
        mg.print0(f"digits: test accuracy {100 * metrics['accuracy']:.2f}% ({int(metrics['correct'])}/"
                  f"{int(metrics['count'])}) | {result['samples_per_s'] or 0:,.0f} samples/s | "
                  f"wall {result['wall_s'] or 0:.1f} s | world size {dist.world_size} | "
                  f"skipped fp16 steps {amp.skipped_steps}")
        return result


def _epochs(train):
    """Endless steps over epochs (the loader reshuffles each pass); the caller stops."""
    while True:
        yield from train


def _find_batch(net: nn.Module, plan: mg.BatchPlan, dist: mg.Dist, budget: int | None) -> mg.BatchPlan:
    """The plan with the largest micro-batch that fits (trials on the unwrapped model: no collectives)."""
    loss_fn = nn.CrossEntropyLoss()

    def step(m: int) -> None:
        net.zero_grad(set_to_none=True)
        x = torch.rand(m, 64, device=dist.device)
        loss_fn(net(x), torch.zeros(m, dtype=torch.long, device=dist.device)).backward()

    found = mg.find_micro_batch(step, dist, plan=plan, memory_budget=budget, max_micro_batch=plan.rank_batch)
    net.zero_grad(set_to_none=True)
    mg.print0(found.summary())
    return found.plan


if __name__ == "__main__":
    main()
