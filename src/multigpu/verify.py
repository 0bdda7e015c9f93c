"""``multigpu verify``: does my script compute the same training on N ranks as on one?

It runs the script (the study's contract: ``mg.StepMeter``, ``--global-batch``,
``--steps``) through ``multigpu run`` at each world size with the same global
batch, for a few steps, with ``MULTIGPU_VERIFY=1``: the meter logs every step
and records, per step, an order-free digest of the samples all ranks trained
on, plus the full model state at start and end (``meter/probe.py``). The first
world size runs once more as the floor run (each step's samples in another
order, each gradient rounded once more: rounding alone, ``verify_floor.py``).
Then each world size is compared with the first, against that floor (10 x
at step 0, 1000 x after, never past the precision's tolerances): per-step
losses, the samples of each step, the initial and final parameters, and the
likely causes of a difference are named.

With ``--layouts "tp=2;dp_shard=2"`` a script that reads its layout with
``mg.layout_from_args()`` (docs/your-model.md) runs once on one process and
once per layout, on as many processes as the layout's degrees multiply to,
with the layout's flags; each is compared with the one process.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .batch import check_splits
from .errors import UsageError
from .meter.records import read_records
from .runtime.contract import VERIFY_DIR, VERIFY_ENV, VERIFY_FLOOR_ENV
from .runtime.fields import add_field
from .runtime.values import int_list
from .meter.evidence import thin_evidence
from .verify_floor import (STEP0, TOLERANCES, Floor, Spread, Tolerance, describe, loss_gaps, undecidable,  # noqa: F401 - verify's
                           measure)

FLOOR_KEY = "floor"

DIGEST_RTOL = 1e-9  # float64 sums of the same samples in another order


@dataclass(frozen=True)
class VerifyConfig:
    """How to verify. Each field's docstring is its flag's help in `multigpu verify --help`; the
    defaults are ``verify()``'s."""

    workers: tuple[int, ...] = (1, 2)
    """world sizes; each is compared with the first (default %(default)s)"""
    steps: int = 5
    """optimizer steps per run (passed as --steps; default %(default)s)"""
    global_batch: int | None = None
    """passed as --global-batch to every run"""
    rtol: float | None = None
    """relative tolerance for every step's loss (default: 10 x the script's floor at step 0 and 1000 x after, measured by one more run of the first world size, docs/study.md#the-floor); parameters are judged by the share of the update that differs"""
    cpu: bool = False
    """CPU workers (gloo) even where GPUs exist"""
    out: str | None = None
    """where the runs and verify.json go (default multigpu_logs/verify-<time>)"""
    layouts: str | None = None
    """layouts to compare with one process instead of --workers, e.g. "tp=2;dp_shard=2,tp=2" (the script reads them with mg.layout_from_args)"""


def _read_run(run_dir: Path, steps: int | None = None) -> dict[str, Any]:
    """One run's losses, samples' digests and model states; ``thin``: why it is no evidence (fewer than the
    ``steps`` asked recorded), else None; ``precision``: the dtype the script gave its StepMeter."""
    import torch

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl: the script must use mg.StepMeter (see docs/study.md)")
    recs = read_records(metrics)
    losses = [r.get("loss") for r in recs if r.get("type") == "step"]
    header = next((r for r in recs if r.get("type") == "header"), {})
    probe_dir = run_dir / VERIFY_DIR
    probe = json.loads((probe_dir / "probe.json").read_text()) if (probe_dir / "probe.json").is_file() else {}
    states = {name: torch.load(probe_dir / f"{name}.pt", weights_only=True)
              for name in ("initial", "final") if (probe_dir / f"{name}.pt").is_file()}
    return {"losses": losses, "digests": probe.get("digests", []), "batchnorm": probe.get("batchnorm", []),
            "rank_starts": probe.get("rank_starts", []), "draws": probe.get("draws", False),
            "cp_documents": probe.get("cp_documents", False),
            "thin": thin_evidence(recs, steps, rate=False), "floor": probe.get("floor"),
            "precision": (header.get("meter") or {}).get("dtype") or "fp32", **states}


def _state_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Largest |a - b| over every tensor, relative to the largest |a| of that tensor (None: not comparable)."""
    if a is None or b is None or a.keys() != b.keys():
        return None
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            scale = max(float(x.double().abs().max()), 1e-12)
            worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
    return worst


def _update_diff(ref: dict[str, Any], other: dict[str, Any]) -> float | None:
    """|final_other - final_ref| / |final_ref - initial_ref| over every floating tensor (None: not comparable)."""
    a, b, start = ref.get("final"), other.get("final"), ref.get("initial")
    if a is None or b is None or start is None or a.keys() != b.keys() or a.keys() != start.keys():
        return None
    diff = update = 0.0
    for key, x in a.items():
        if x.shape != b[key].shape:
            return float("inf")
        if x.is_floating_point():
            diff += float((x.double() - b[key].double()).square().sum())
            update += float((x.double() - start[key].double()).square().sum())
    return (diff / update) ** 0.5 if update > 0 else (0.0 if diff == 0 else float("inf"))


def compare(ref: dict[str, Any], other: dict[str, Any], rtol: float | None = None,
            floor: Floor | None = None) -> dict[str, Any]:
    """How ``other`` differs from ``ref``: the largest differences, the first diverging step, likely causes.
    Judged against ``floor`` (the reference's floor run, verify_floor.py) where it was measured, else against
    the tolerances of the precision the runs report; ``rtol``, when given, for every step's loss."""
    precision = ref.get("precision", "fp32")
    tol = TOLERANCES.get(precision, TOLERANCES["fp16"])
    floor = floor if floor is not None and floor.measured else None

    def loss_tol(step: int) -> float:
        if rtol is not None:
            return rtol
        return floor.loss_tol(step) if floor is not None else STEP0.tolerance if step == 0 else tol.loss.tolerance

    param_tol = floor.update_tol() if floor is not None else tol.update.tolerance
    pairs = [(a, b) for a, b in zip(ref["losses"], other["losses"]) if a is not None and b is not None]
    rel = loss_gaps(pairs)
    step_tol = [loss_tol(i) for i in range(len(rel))]
    first = next((i for i, r in enumerate(rel) if r > step_tol[i]), None)
    data = next((i for i, (a, b) in enumerate(zip(ref["digests"], other["digests"]))
                 if abs(a - b) > DIGEST_RTOL * max(abs(a), 1.0)), None)
    init, final = _state_diff(ref.get("initial"), other.get("initial")), _update_diff(ref, other)
    apart = other.get("precision", "fp32") != precision  # not the same training, whatever the numbers say
    same = first is None and (final is None or final <= param_tol) and data is None and not apart
    causes = [] if same else _causes(ref, other, STEP0.tolerance, first, data, init)
    if not same and not causes:  # every loss and sample agree: only the final parameters are apart
        causes.append(f"the same losses and samples, but the final parameters differ: the updates differ (an "
                      f"optimizer or clipping step that runs per rank, a parameter not synced)"
                      if precision == "fp32"
                      else f"the same losses and samples, but the final parameters differ: {precision} rounding moved "
                      f"correct runs up to {tol.update.correct:.1e} of the update; verify in fp32 or with "
                      f"fewer --steps to tell a bug from rounding")
    loss_x, final_x = floor.times(rel, final) if floor is not None else (None, None)
    return {"same": same, "steps": len(pairs), "largest_loss_rel": max(rel, default=0.0), "first_diverging_step": first,
            "first_data_step": data, "initial_rel": init, "final_rel": final, "precision": precision,
            "step0_tol": loss_tol(0), "loss_tol": loss_tol(1), "param_tol": param_tol, "step_tols": step_tol,
            "tolerance_basis": "the floor" if floor is not None else tol.basis(precision),
            "loss_x_floor": loss_x, "final_x_floor": final_x, "causes": causes, "losses": [list(p) for p in pairs]}


def floor_of(ref: dict[str, Any], run: dict[str, Any], step0_tol: float) -> Floor:
    """The reference's floor, from its floor run (verify_floor.py)."""
    return measure(ref, run, step0_tol, _update_diff(ref, run))


def _causes(ref: dict[str, Any], other: dict[str, Any], rtol: float, first: int | None, data: int | None,
            init: float | None) -> list[str]:
    """The likely causes of a difference, most specific first."""
    causes = []
    if other.get("precision", "fp32") != ref.get("precision", "fp32"):
        causes.append(f"the precision differs: the script gives its StepMeter dtype {ref.get('precision', 'fp32')} on "
                      f"one run and {other.get('precision', 'fp32')} on the other (train in one precision at every "
                      f"world size)")
    if data is not None:
        causes.append(f"the samples of step {data} differ: the sampler or loader is not world-size-invariant (each "
                      f"rank must get its share of the same global batch; mg.loader keys the order on the global batch)")
    if init is not None and init > rtol:
        causes.append(f"the initial parameters differ (largest relative difference {init:.1e}): the ranks build the "
                      f"model from different seeds (seed the same on every rank: mg.init(seed=0))")
    elif other.get("rank_starts"):
        ranks = ", ".join(map(str, other["rank_starts"][:4]))
        causes.append(f"the initial parameters differ between the ranks (rank {ranks} vs rank 0): the ranks build the "
                      f"model from different seeds and nothing syncs them (seed the same on every rank: "
                      f"mg.init(seed=0), or let DDP broadcast rank 0's)")
    if other["batchnorm"]:
        names = ", ".join(other["batchnorm"][:3]) + (" ..." if len(other["batchnorm"]) > 3 else "")
        causes.append(f"BatchNorm without sync ({names}): each rank normalizes with its share's statistics; "
                      f"use mg.wrap(model, 'ddp', sync_batchnorm=True)")
    if other.get("draws") or ref.get("draws"):
        causes.append("the steps draw random numbers (torch's generator advanced during them: dropout, a router's "
                      "sampling or jitter, random augmentation): each rank draws its own for its share, so the runs "
                      "differ as two seeds' do, by design; set them to 0 to verify (mg.parallelize's note names a "
                      "model's own)")
    if first == 0 and not causes:
        from .parallel.context import DOCUMENTS_CAUSE  # packed documents under cp (the meter's probe records them)

        causes.append(DOCUMENTS_CAUSE if other.get("cp_documents") else "the loss of step 0 differs with the same "
                      "model and samples: it is averaged per rank, not per sample (divide the summed loss by the "
                      "global count: samples, tokens, weights)")
    elif first is not None and not causes:
        causes.append(f"the same start and samples, but step {first} differs: the gradients differ (a loss scaled "
                      f"per rank, random draws such as dropout that depend on the rank, accumulation that syncs "
                      f"or scales differently)")
    return causes


def verify(target: str, args: Sequence[str] = (), *, module: bool = False,
           workers: Sequence[int] = VerifyConfig.workers, steps: int = VerifyConfig.steps,
           global_batch: int | None = VerifyConfig.global_batch, cpu: bool = VerifyConfig.cpu,
           rtol: float | None = VerifyConfig.rtol, out: str | None = VerifyConfig.out,
           layouts: str | Sequence[Any] | None = VerifyConfig.layouts,
           say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``target`` at each world size and compare with the first; returns the report (also verify.json).

    >>> report = verify("train.py", workers=(1, 2), steps=5, global_batch=64, cpu=True)
    >>> report["same"]
    True
    """
    from .launch.once import run_once

    if layouts is not None:
        return _verify_layouts(target, args, module=module, layouts=layouts, steps=steps, global_batch=global_batch,
                               cpu=cpu, rtol=rtol, out=out, say=say)
    if len(workers) < 2 or any(w < 1 for w in workers):
        raise UsageError(f"--workers needs two or more positive world sizes to compare, got {','.join(map(str, workers))}; "
                         "use e.g. --workers 1,2")
    _check_steps_and_rtol(steps, rtol)
    if global_batch is not None:
        if global_batch < 1:
            raise UsageError(f"--global-batch must be a positive integer, got {global_batch}; use e.g. --global-batch 64")
        check_splits(global_batch, [(f"{w} worker{'s' if w > 1 else ''}", w) for w in workers])
    runs = [(str(w), f"{w} worker{'s' if w > 1 else ''}", w, [], f"w{w}") for w in workers]
    return _run_and_compare(target, args, runs, module=module, steps=steps, global_batch=global_batch, cpu=cpu,
                            rtol=rtol, out=out, say=say, names={str(w): f"{w} workers" for w in workers} | {
                                str(workers[0]): str(workers[0])})


def _check_steps_and_rtol(steps: int, rtol: float | None) -> None:
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}; use e.g. --steps 5")
    if rtol is not None and not rtol > 0:
        raise UsageError(f"--rtol must be a positive number, got {rtol}; use e.g. --rtol 1e-5 (fp32 losses)")


def _verify_layouts(target: str, args: Sequence[str], *, module: bool, layouts: str | Sequence[Any], steps: int,
                    global_batch: int | None, cpu: bool, rtol: float | None, out: str | None,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """One process, then each layout on the processes its degrees multiply to, each compared with the one."""
    from .parallel.flags import distinct, parse_layouts, refuse_fixed

    chosen = distinct(parse_layouts(layouts) if isinstance(layouts, str) else list(layouts), str(layouts))
    if not chosen:  # nothing compared would read as SAME
        raise UsageError('--layouts names no layout; use e.g. --layouts "tp=2;dp_shard=2"')
    refuse_fixed(args, "--layouts sets", "from the script's arguments (or put it in the layouts)")
    _check_steps_and_rtol(steps, rtol)
    devices = _visible_gpus(cpu)
    for layout in chosen:
        world = layout.world_size
        if devices is not None and world > devices:
            raise UsageError(f"layout {layout.label} spans {world} processes but {devices} GPU"
                             f"{'s are' if devices != 1 else ' is'} visible; give a layout of at most {devices} or "
                             f"use --cpu")
    if global_batch is not None:
        check_splits(global_batch, [(f"the {layout.dp_size} data-parallel ranks of layout {layout.label}", layout.dp_size)
                                    for layout in chosen])
    runs = [("one process", "one process", 1, [], "one")]
    for i, layout in enumerate(chosen):
        name = layout.label
        runs.append((name, f"layout {name} ({layout.world_size} processes)", layout.world_size, layout.flags,
                     f"l{i}-" + "".join(ch if ch.isalnum() else "-" for ch in name)))
    return _run_and_compare(target, args, runs, module=module, steps=steps, global_batch=global_batch, cpu=cpu,
                            rtol=rtol, out=out, say=say, names={r[0]: r[1] for r in runs})


def _visible_gpus(cpu: bool) -> int | None:
    """The GPUs a run would use (None: CPU workers, any number)."""
    import torch

    return torch.cuda.device_count() if not cpu and torch.cuda.is_available() else None


def _run_and_compare(target: str, args: Sequence[str], runs: list[tuple[str, str, int, list[str], str]], *,
                     module: bool, steps: int, global_batch: int | None, cpu: bool, rtol: float | None, out: str | None,
                     say: Callable[[str], None], names: dict[str, str]) -> dict[str, Any]:
    """Run each (key, label, processes, extra flags, directory), and the first again as the floor run
    (verify_floor.py); compare every other one with the first, against the floor, and report."""
    from .launch.once import run_once

    root = Path(out or os.path.join("multigpu_logs", f"verify-{time.strftime('%Y%m%d-%H%M%S')}"))
    root.mkdir(parents=True, exist_ok=True)
    extra = list(args) + (["--global-batch", str(global_batch)] if global_batch else []) + ["--steps", str(steps)]
    results = {}
    key0, label0, nproc0, flags0, where0 = runs[0]
    floor_run = (FLOOR_KEY, f"{label0} again, each step's samples in another order (the floor)", nproc0, flags0,
                 f"{where0}-floor")
    for key, label, nproc, flags, where in [runs[0], floor_run, *runs[1:]]:
        say(f"multigpu verify: {label}, {steps} steps ...")
        env = {VERIFY_ENV: "1", VERIFY_FLOOR_ENV: "1" if key == FLOOR_KEY else None}
        done = run_once(target, extra + flags, module=module, log_dir=root / where, nproc=nproc, cpu=cpu, env=env)
        if done.refusal is not None:
            raise done.refusal
        if done.exit_code != 0 or done.run_dir is None:
            why = done.failure()  # the failing rank's exception, not just the code
            raise UsageError(f"the run on {label} failed (exit code {done.exit_code}"
                             f"{': ' + why.strip() if why else ''}; see {done.console}); verify compares "
                             f"finished runs: fix the script first")
        results[key] = _read_run(done.run_dir, steps)
        if results[key]["thin"]:  # a comparison over steps nobody asked for is no evidence of the same training
            raise UsageError(f"the run on {label} is no evidence: {results[key]['thin']}")
        if why := undecidable(results[key]["precision"]):  # said after the first run: its meter names the precision
            raise UsageError(why)
    ref = runs[0][0]
    floor = floor_of(results[ref], results.pop(FLOOR_KEY), STEP0.tolerance)
    report = {"target": target, "args": list(args), "steps": steps, "global_batch": global_batch, "rtol": rtol,
              "reference": int(ref) if ref.isdigit() else ref, "floor": floor.record(), "comparisons": {}}
    for key, *_ in runs[1:]:
        report["comparisons"][key] = compare(results[ref], results[key], rtol, floor)
    report["same"] = all(c["same"] for c in report["comparisons"].values())
    (root / "verify.json").write_text(json.dumps(report, indent=1))
    say(f"multigpu verify: {describe(floor, label0)}")
    if not floor.measured or rtol is not None:
        say(tolerance_line(results[ref].get("precision", "fp32"), rtol))
    for key, c in report["comparisons"].items():
        say(line(names[key], names[ref], c))
        for cause in c["causes"]:
            say(f"    likely cause: {cause}")
    say(f"multigpu verify: {'the same training' if report['same'] else 'DIFFERENT'}; details in {root / 'verify.json'}")
    return report


def tolerance_line(precision: str, rtol: float | None) -> str:
    """The tolerances the comparisons used and where they come from: the precision the script reports."""
    tol = TOLERANCES.get(precision, TOLERANCES["fp16"])
    losses = (f"losses within {rtol:.1e} (--rtol)" if rtol is not None else
              f"losses within {STEP0.tolerance:.1e} at step 0 (the same model and samples) and {tol.loss.tolerance:.1e} after")
    return (f"multigpu verify: {precision}, the dtype the script gives its StepMeter: {losses}, final parameters "
            f"within {tol.update.tolerance:.1e} of the update ({tol.basis(precision)}; docs/study.md#precision)")


def line(w: int | str, ref: int | str, c: dict[str, Any]) -> str:
    def times(x: float | None) -> str:  # how far above the floor, where one was measured
        return "" if x is None else f", {x:,.0f} x the floor" if x >= 10 else f", {x:.1f} x the floor"

    final = (f"final parameters {c['final_rel']:.1e} of the update{times(c.get('final_x_floor'))} (tolerance "
             f"{c['param_tol']:.1e})" if c["final_rel"] is not None else "parameters not compared (pass model= to StepMeter)")
    head = f"  {w if isinstance(w, str) else f'{w} workers'} vs {ref}: "
    loss = f"largest loss difference {c['largest_loss_rel']:.1e} (relative{times(c.get('loss_x_floor'))})"
    if c["same"]:
        return head + f"SAME over {c['steps']} steps: {loss}, {final}"
    where = f"from step {c['first_diverging_step']}" if c["first_diverging_step"] is not None else "in the parameters"
    if c["first_diverging_step"] is not None:
        a, b = c["losses"][c["first_diverging_step"]]
        digits = next((n for n in range(6, 12) if f"{a:.{n}g}" != f"{b:.{n}g}"), 12)  # enough to tell them apart
        where += f" (loss {a:.{digits}g} vs {b:.{digits}g})"
    return head + f"DIFFERENT {where}; {loss}, {final}"


def add_arguments(parser) -> None:
    field = functools.partial(add_field, parser, config=VerifyConfig)
    field("--workers", field="workers", default=",".join(map(str, VerifyConfig.workers)))
    field("--steps", field="steps", type=int)
    field("--global-batch", field="global_batch", type=int)
    field("--rtol", field="rtol", type=float)
    field("--cpu", field="cpu", action="store_true")
    field("--out", field="out")
    field("--layouts", field="layouts", metavar="LAYOUTS")
    parser.add_argument("-m", dest="module", action="store_true", help="the target is a module (python -m)")
    parser.add_argument("target", help="the script (or module with -m)")
    parser.add_argument("args", nargs="...", help="arguments for the script")


def main(args) -> int:
    if args.layouts is not None and args.workers != ",".join(map(str, VerifyConfig.workers)):
        raise UsageError("--layouts compares each layout with one process; --workers compares world sizes: pass one")
    workers = int_list(args.workers, "--workers must be a comma-separated list of integers", "use e.g. --workers 1,2",
                       skip_empty=True)
    cfg = VerifyConfig(workers=workers, steps=args.steps, global_batch=args.global_batch, rtol=args.rtol,
                       cpu=args.cpu, out=args.out, layouts=args.layouts)
    report = verify(args.target, args.args, module=args.module, say=lambda s: print(s, flush=True), **asdict(cfg))
    return 0 if report["same"] else 1
