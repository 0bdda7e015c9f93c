"""From one GPU to N: translate a single-GPU recipe (LR, batch, schedule) for N GPUs.

``scale_recipe()`` returns a frozen ``ScaledRecipe``; ``multigpu plan`` prints it.
Rules (see docs/batch-size.md and the references there):

* ``keep-global``: the global batch stays; each GPU takes 1/N of it. Same
  updates, same LR, same schedule: only the wall-clock changes.
* ``scale-global``: each GPU keeps a full per-GPU batch, so the global batch
  grows N-fold; the LR follows the optimiser's rule (linear for SGD, Goyal et
  al. 2017; square root for Adam-type, Hoffer et al. 2017 / Malladi et al.
  2022) and every step-counted quantity shrinks so the same number of samples
  is seen.
* With a measured noise scale phi: per-example efficiency (phi+B0)/(phi+B)
  and steps to the same loss S(B)/S(B0) = (1+phi/B)/(1+phi/B0) (McCandlish et
  al. 2018; Pollux), and a warning when B is far beyond phi.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from dataclasses import asdict, dataclass, field

from .batch import POLICIES, BatchPlan, check_splits, policy_batch, same_samples_steps, scale_lr
from .errors import UsageError
from .noise import efficiency, gain
from .runtime.fields import add_field
from .runtime.values import divisors, is_positive_int

OPTIMIZER_RULES = {"sgd": "linear", "adam": "sqrt", "adamw": "sqrt"}
FAR_BEYOND = 2.0  # warn when the global batch exceeds this multiple of the noise scale


@dataclass(frozen=True)
class PlanConfig:
    """The 1-GPU recipe to translate. Each field's docstring is its flag's help in `multigpu plan --help`
    (``add_arguments``); the defaults are ``scale_recipe()``'s."""

    lr: float
    """learning rate of the 1-GPU recipe"""
    batch: int
    """batch size of the 1-GPU recipe"""
    gpus: int
    """number of GPUs to plan for"""
    optimizer: str
    """one of {OPTIMIZERS} (chooses the LR rule)"""
    policy: str = "scale-global"
    """scale-global (default: each GPU keeps a full batch) or keep-global"""
    per_gpu_batch: int | None = None
    """micro-batch one GPU takes per forward (what fits its memory)"""
    steps: int | None = None
    """total optimizer steps of the 1-GPU recipe"""
    warmup_steps: int | None = None
    """warmup steps of the 1-GPU recipe"""
    eval_every: int | None = None
    """evaluation interval (steps) of the 1-GPU recipe"""
    checkpoint_every: int | None = None
    """checkpoint interval (steps) of the 1-GPU recipe"""
    noise_scale: str | None = None
    """measured gradient noise scale, or a metrics log holding noise/b_simple"""


@dataclass(frozen=True)
class ScaledRecipe:
    """A single-GPU recipe translated for ``gpus`` GPUs. Build it with ``mg.scale_recipe``."""

    gpus: int
    policy: str
    optimizer: str
    lr_rule: str
    base_batch: int
    base_lr: float
    global_batch: int
    micro_batch: int
    accum_steps: int
    lr: float
    base_steps: int | None = None
    steps: int | None = None
    base_warmup_steps: int | None = None
    warmup_steps: int | None = None
    base_eval_every: int | None = None
    eval_every: int | None = None
    base_checkpoint_every: int | None = None
    checkpoint_every: int | None = None
    noise_scale: float | None = None
    efficiency: float | None = None       # per-example, relative to the base batch
    gain: float | None = None             # progress per step relative to the base batch
    steps_to_target: int | None = None    # predicted from the noise scale
    reasoning: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())

    def batch_plan(self) -> BatchPlan:
        """The ``mg.BatchPlan`` of the translated recipe."""
        return BatchPlan(self.global_batch, self.gpus, micro_batch=self.micro_batch)

    def text(self) -> str:
        """The table, reasoning and warnings that ``multigpu plan`` prints."""
        rule = {"linear": "linear LR rule", "sqrt": "square-root LR rule"}[self.lr_rule]
        lines = [f"1 GPU -> {self.gpus} GPUs, policy {self.policy}, {self.optimizer} ({rule})"]
        rows = [
            ("per-GPU micro-batch", self.base_batch, self.micro_batch),
            ("accumulation steps", 1, self.accum_steps),
            ("global batch", self.base_batch, self.global_batch),
            ("learning rate", f"{self.base_lr:.6g}", f"{self.lr:.6g}"),
            ("warmup steps", self.base_warmup_steps, self.warmup_steps),
            ("total steps", self.base_steps, self.steps),
            ("eval every", self.base_eval_every, self.eval_every),
            ("checkpoint every", self.base_checkpoint_every, self.checkpoint_every),
        ]
        rows = [r for r in rows if r[1] is not None]
        w = max(len(r[0]) for r in rows)
        lines.append(f"  {'':<{w}}  {'1 GPU':>10}  {f'{self.gpus} GPUs':>10}")
        lines += [f"  {name:<{w}}  {str(a):>10}  {str(b):>10}" for name, a, b in rows]
        lines += [f"why: {r}" for r in self.reasoning]
        lines += [f"WARNING: {w_}" for w_ in self.warnings]
        return "\n".join(lines)


def _check_count(name: str, value, allow_zero: bool = False) -> None:
    if value is None or is_positive_int(value) or (allow_zero and value == 0 and not isinstance(value, bool)):
        return
    kind = "a non-negative" if allow_zero else "a positive"
    raise UsageError(f"{name} must be {kind} integer, got {value!r}")


def _check_recipe(lr, batch, gpus, optimizer, policy, per_gpu_batch, steps, warmup_steps, eval_every,
                  checkpoint_every, noise_scale) -> str:
    """Refuse impossible inputs before any arithmetic; return the optimizer's canonical name."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0 or not math.isfinite(lr):
        raise UsageError(f"learning rate must be a positive number, got {lr!r}; e.g. lr=0.1")
    for name, value in (("batch", batch), ("gpus", gpus), ("per-GPU batch", per_gpu_batch), ("steps", steps),
                        ("eval interval", eval_every), ("checkpoint interval", checkpoint_every)):
        _check_count(name, value)
    _check_count("warmup steps", warmup_steps, allow_zero=True)
    opt = str(optimizer).lower()
    if opt not in OPTIMIZER_RULES:
        raise UsageError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_RULES)}")
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if noise_scale is not None and not (noise_scale > 0 and math.isfinite(noise_scale)):
        raise UsageError(f"noise scale must be a positive number of examples, got {noise_scale!r}")
    if warmup_steps is not None and steps is not None and warmup_steps > steps:
        raise UsageError(f"warmup steps {warmup_steps} exceed total steps {steps}; use warmup_steps={steps} or fewer")
    return opt


def _split(policy: str, batch: int, gpus: int, per_gpu_batch: int | None) -> BatchPlan:
    """The translated batch: the policy's global batch in per-GPU micro-batches and accumulation."""
    if policy == "keep-global":
        near = sorted(sorted(divisors(batch), key=lambda g: abs(g - gpus))[:2])
        check_splits(batch, [(f"{gpus} GPUs", gpus)], why=" under keep-global",
                     fix=f"use {' or '.join(map(str, near))} GPUs, or policy='scale-global'")
        share = batch // gpus
        micro = per_gpu_batch or share
        if micro > share or share % micro:
            fits = max(d for d in divisors(share) if d <= micro)
            raise UsageError(
                f"per-GPU batch {micro} does not divide the per-GPU share {share} of batch {batch} over {gpus} GPUs; "
                f"use per_gpu_batch={fits}, or policy='scale-global'"
            )
    else:
        micro = per_gpu_batch or batch
    return BatchPlan(policy_batch(policy, batch, gpus, micro), gpus, micro_batch=micro)


def scale_recipe(
    lr: float,
    batch: int,
    gpus: int,
    optimizer: str,
    *,
    policy: str = PlanConfig.policy,
    per_gpu_batch: int | None = PlanConfig.per_gpu_batch,
    steps: int | None = PlanConfig.steps,
    warmup_steps: int | None = PlanConfig.warmup_steps,
    eval_every: int | None = PlanConfig.eval_every,
    checkpoint_every: int | None = PlanConfig.checkpoint_every,
    noise_scale: float | None = PlanConfig.noise_scale,
) -> ScaledRecipe:
    """Translate a one-GPU recipe (``lr`` at ``batch``) to ``gpus`` GPUs.

    ``per_gpu_batch`` is the micro-batch one GPU takes per forward (what fits
    its memory): under ``keep-global`` the remainder becomes accumulation,
    under ``scale-global`` the global batch is ``gpus * per_gpu_batch``.

    >>> r = mg.scale_recipe(0.1, 128, 8, "sgd", steps=10000, warmup_steps=100)
    >>> r.global_batch, r.lr, r.steps, r.warmup_steps
    (1024, 0.8, 1250, 13)
    """
    opt = _check_recipe(lr, batch, gpus, optimizer, policy, per_gpu_batch, steps, warmup_steps, eval_every,
                        checkpoint_every, noise_scale)
    plan = _split(policy, batch, gpus, per_gpu_batch)
    global_batch, micro, accum = plan.global_batch, plan.micro_batch, plan.accum_steps
    rule = OPTIMIZER_RULES[opt]
    k = global_batch / batch
    new_lr = scale_lr(lr, base_batch=batch, batch=global_batch, rule=rule)

    why = []
    if k == 1:
        why.append(f"the global batch stays {batch}, so every update is the one 1 GPU would make: LR and schedule unchanged")
    else:
        law = "linear rule (Goyal et al. 2017)" if rule == "linear" else "square-root rule for Adam-type optimisers (Malladi et al. 2022)"
        why.append(f"global batch x{k:g} ({batch} -> {global_batch}): LR x{new_lr / lr:.3g} by the {law}")
        why.append(f"step counts x{batch / global_batch:.3g} so the run sees the same number of samples ({_samples(steps, batch)})")
    if accum > 1:
        why.append(f"{micro} per GPU per forward x {accum} accumulation steps x {gpus} GPUs = {global_batch}")

    warns = []
    if rule == "linear" and k >= 4 and not warmup_steps:
        warns.append(f"LR grows x{k:g} with no warmup; Goyal et al. needed ~5 epochs of gradual warmup at x32 (--warmup-steps)")
    eff = g = to_target = None
    if noise_scale is not None:
        eff = efficiency(global_batch, noise_scale, base_batch=batch)
        g = gain(global_batch, batch, noise_scale)
        if steps is not None:
            # S(B) = S_min (1 + phi/B): the base run's steps, moved along that curve.
            to_target = math.ceil(steps * (1 + noise_scale / global_batch) / (1 + noise_scale / batch))
        why.append(
            f"measured noise scale {noise_scale:,.0f}: per-example efficiency {eff:.0%} of the 1-GPU recipe, "
            f"progress per step x{g:.2f} (ideal x{k:g})"
            + (f"; about {to_target} steps to the same loss" if to_target is not None else "")
        )
        if global_batch > FAR_BEYOND * noise_scale:
            warns.append(
                f"global batch {global_batch} is {global_batch / noise_scale:.1f}x the noise scale {noise_scale:,.0f}: "
                f"far past the critical batch, extra GPUs mostly add compute, not progress; use fewer GPUs or policy='keep-global'"
            )
        same = same_samples_steps(steps, batch, global_batch)
        if to_target is not None and same is not None and to_target > 1.1 * same:
            warns.append(f"the same-samples schedule ({same} steps) likely ends short of the 1-GPU loss; plan ~{to_target}")
    return ScaledRecipe(
        gpus=gpus, policy=policy, optimizer=opt, lr_rule=rule, base_batch=batch, base_lr=float(lr),
        global_batch=global_batch, micro_batch=micro, accum_steps=accum, lr=new_lr,
        base_steps=steps, steps=same_samples_steps(steps, batch, global_batch),
        base_warmup_steps=warmup_steps, warmup_steps=same_samples_steps(warmup_steps, batch, global_batch),
        base_eval_every=eval_every, eval_every=same_samples_steps(eval_every, batch, global_batch),
        base_checkpoint_every=checkpoint_every, checkpoint_every=same_samples_steps(checkpoint_every, batch, global_batch),
        noise_scale=noise_scale, efficiency=eff, gain=g, steps_to_target=to_target,
        reasoning=tuple(why), warnings=tuple(warns),
    )


def _samples(steps: int | None, batch: int) -> str:
    return f"{steps * batch:,} samples" if steps else "same epochs"


def read_noise_scale(source: str) -> float:
    """A noise scale given as a number, or the last ``noise/b_simple`` in a JSONL metrics log."""
    try:
        return float(source)
    except ValueError:
        pass
    path = pathlib.Path(source)
    if not path.is_file():
        raise UsageError(f"--noise-scale expects a number or a JSONL metrics file, got {source!r} (no such file)")
    value = None
    with path.open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"{path}:{n} is not JSON; --noise-scale expects one JSON object per line") from None
            if isinstance(row, dict) and isinstance(row.get("noise/b_simple"), (int, float)):
                value = float(row["noise/b_simple"])
    if value is None:
        raise UsageError(f"{path} has no 'noise/b_simple' entry; log mg.NoiseScale.metrics() during the run, or pass a number")
    return value


def main(args) -> int:
    """``multigpu plan``: print the translated recipe."""
    cfg = PlanConfig(lr=args.lr, batch=args.batch, gpus=args.gpus, optimizer=args.optimizer, policy=args.policy,
                     per_gpu_batch=args.per_gpu_batch, steps=args.steps, warmup_steps=args.warmup_steps,
                     eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                     noise_scale=args.noise_scale)
    # --noise-scale is a number or a metrics log; scale_recipe takes the number.
    noise = read_noise_scale(cfg.noise_scale) if cfg.noise_scale is not None else None
    recipe = scale_recipe(**{**asdict(cfg), "noise_scale": noise})
    print(recipe.text(), flush=True)
    return 0


def add_arguments(p) -> None:
    # OPTIMIZERS: the help quotes the optimizers the LR rules know, from the table written once.
    plan = functools.partial(add_field, p, config=PlanConfig, values={"OPTIMIZERS": ", ".join(OPTIMIZER_RULES)})
    plan("--lr", field="lr", type=float)
    plan("--batch", field="batch", type=int)
    plan("--gpus", field="gpus", type=int)
    plan("--optimizer", field="optimizer")
    plan("--policy", field="policy")
    plan("--per-gpu-batch", field="per_gpu_batch", type=int)
    plan("--steps", field="steps", type=int)
    plan("--warmup-steps", field="warmup_steps", type=int)
    plan("--eval-every", field="eval_every", type=int)
    plan("--checkpoint-every", field="checkpoint_every", type=int)
    plan("--noise-scale", field="noise_scale", metavar="N|FILE.jsonl")
