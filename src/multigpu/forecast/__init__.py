"""`multigpu forecast`: memory per GPU and speed of every layout of a model on a cluster you describe
(or do not have yet), ranked, with the command that runs the best (docs/forecast.md).

    hardware.py   GPU kinds (meter/gpus.json: public spec figures, sources) and the cluster around them
    models.py     --model: a known name (tables/models.json), a transformers config.json, or module:function
    counts.py     the model counted on fake tensors (meter/flops.py's FLOP counter): parameters per block, FLOPs and
                  saved bytes per token
    watch.py      the dispatch modes that watch the count's forward and backward, op by op
    compute.py    a micro-batch's training FLOPs: matmuls, attention, float8's share
    cost.py       one layout's memory and step time, by part, and every assumption they rest on
    plan.py       every layout of the cluster, forecast and ranked
    published.py  the published runs it is checked against, the calibration fitted on one source of them
    report.py     forecast.json, report.md, report.html
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _model_and_cluster_arguments(parser.add_argument)
    _training_arguments(parser.add_argument)
    _output_arguments(parser.add_argument)
    _hardware_and_assumption_arguments(parser.add_argument)


def _model_and_cluster_arguments(add) -> None:
    from .hardware import table

    add("--model", required=True, help="a known model (llama3-8b, llama3-70b, llama3-405b, llama2-13b, llama2-70b, "
                                       "mixtral-8x7b, qwen3-30b-a3b), "
                                       "a transformers config.json (or its folder), or module:function / file.py:function "
                                       "returning your nn.Module")
    add("--gpus", type=int, required=True, help="GPUs in the cluster")
    add("--gpu", default="h100", help=f"GPU kind: {', '.join(table())} (default %(default)s)")
    add("--gpus-per-node", type=int, default=8, help="GPUs per node (default %(default)s)")
    add("--seq-len", type=int, default=4096, help="tokens per sequence (default %(default)s)")
    add("--global-batch", type=int, help="sequences per step (default: one per GPU)")


def _training_arguments(add) -> None:
    add("--precision", choices=("bf16", "fp8"), default="bf16", help="the matmuls' precision (default %(default)s)")
    add("--compile", action="store_true", help="torch.compile the blocks (the calibration's speedup)")
    add("--fp8-all-gather", action="store_true",
        help="with --precision fp8: FSDP gathers the linears' weights in fp8 (torchao's enable_fsdp_float8_all_gather), "
             "1 byte each in flight and, in a pipeline stage, held")
    add("--fp8-tp-all-gather", action="store_true",
        help="with --precision fp8: tensor parallelism with sequence parallelism gathers the sub-layers' inputs in "
             "fp8 (torchao's Float8ColwiseParallel, as torchtitan runs tensorwise fp8 under tp)")
    add("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
        help="with --precision fp8: torchao's scaling recipe, as mg.Precision('fp8', recipe=...) (default %(default)s)")
    add("--fp8-include", default="", metavar="NAME,...",
        help="with --precision fp8: modules converted to fp8 whatever the recipe's size rule says, as "
             "amp.convert(model, include=[...]) (names from model.named_modules())")
    add("--fp8-exclude", default="", metavar="NAME,...",
        help="with --precision fp8: modules left in bf16, as amp.convert(model, exclude=[...])")
    add("--compile-loss", action="store_true",
        help="torch.compile the loss too (torchtitan's with --compile since 2025): it saves the 16-bit logits, not "
             "their float32 log-probabilities")
    add("--async-tp", action="store_true", help="async tensor parallelism (hides --async-tp-overlap of its traffic)")
    add("--loss-parallel", action="store_true",
        help="the loss on vocabulary-sharded logits (torchtitan's; mg.parallel.loss_parallel), not gathered ones")
    add("--logits-held", action="store_true",
        help="the training loop holds the logits through the backward (out = model(x); loss.backward(), as most "
             "scripts do; torchtitan frees them first): their bytes counted under the backward's peak")
    add("--grad-sync", choices=("last", "each"), default="last",
        help="when accumulating micro-batches, reduce the data-parallel gradients on the last (mg.accumulate's "
             "default) or on each (mg.accumulate(..., sync='each'): FSDP holds its shard of them between "
             "micro-batches, not every block's unsharded one, and reduce-scatters each) (default %(default)s)")


def _output_arguments(add) -> None:
    add("--micro-batches", default="1,2,4,8", metavar="M,M,...", help="micro-batch sizes to weigh (default %(default)s)")
    add("--top", type=int, default=10, help="layouts to show (default %(default)s)")
    add("--layout", metavar="SPEC", help='only these layouts, e.g. "dp_shard=8,tp=2" (several separated by ";"; '
                                         "their degrees' product is --gpus; a micro_batch= fixes it, else every "
                                         "--micro-batches size is weighed)")
    add("--json", action="store_true", help="print the ranked layouts as JSON on stdout instead of the table")
    add("--out", help="folder for forecast.json, report.md, report.html (default: studies/forecast-<time>)")
    add("--script", default="train.py", help="the training script the printed command runs (default %(default)s)")


def _hardware_and_assumption_arguments(add) -> None:
    from .cost import Assumptions

    d = Assumptions()
    add("--hbm-gib", type=float, help="GPU memory in GiB, replacing the kind's")
    add("--peak-tflops", type=float, help="dense bf16 peak in TFLOP/s, replacing the kind's (fp8 scaled alike)")
    add("--scale-up-gb-s", type=float, help="a node's all-reduce bus bandwidth in GB/s (nccl-tests busbw)")
    add("--scale-out-gb-s", type=float, help="the bus bandwidth across nodes per GPU in GB/s")
    add("--efficiency", type=float, help="achieved fraction of the bf16 peak (default: the calibration's)")
    add("--dp-overlap", type=float, default=d.dp_overlap,
        help="fraction of each phase's compute (forward, backward) that can hide that phase's data-parallel "
             "collectives (default %(default)s)")
    add("--async-tp-overlap", type=float, default=d.async_tp_overlap,
        help="fraction of tensor-parallel traffic async TP hides (default %(default)s)")
    add("--expert-imbalance", type=float, default=d.expert_imbalance,
        help="a mixture of experts under ep: the busiest rank's routed rows over the mean (default %(default)s)")
    add("--runtime-gib", type=float, default=d.runtime_gib,
        help="CUDA context, NCCL and cuBLAS memory per GPU (default %(default)s)")


def main(args) -> int:
    from .models import counted
    from .plan import plan

    micro, fp8 = _checked(args)
    out = Path(args.out or f"studies/forecast-{time.strftime('%Y%m%d-%H%M%S')}")
    _check_out(out)  # before the count: a folder that cannot be written is said at once
    machine, a, run = _setting(args)
    named = _named(args.layout, machine.gpus)  # refused before the count
    counts = counted(args.model, args.seq_len, fp8)
    ranked, left_out = plan(counts, machine, run, a, micro_batches=micro, named=named)
    best, more = ranked[0], sync_note(counts, machine, run, a, ranked)
    launch = f"multigpu run --nnodes {machine.nodes} -n {min(machine.gpus, machine.gpus_per_node)}"
    # No command for a layout multigpu does not build (a named one, forecast as described): it would be refused.
    command = None if best["unbuilt"] else " ".join([launch, args.script, *best["layout"].flags])
    if args.json:
        return _print_json(ranked, left_out, args.top, command, machine, counts.fp8, more)
    _print_table(args, counts, machine, run, a, ranked, left_out, command, more)
    _write_report(out, args.top, counts, machine, run, a, ranked, left_out, command)
    return 0 if best["fits"] else 1


def _checked(args) -> tuple[tuple[int, ...], tuple | None]:
    """The arguments argparse cannot check, refused in one line; returns the micro-batch sizes and ``fp8`` for the
    count: (recipe, include, exclude), or None."""
    from ..errors import UsageError
    from ..runtime.values import int_list

    for flag, value in (("--gpus", args.gpus), ("--top", args.top), ("--seq-len", args.seq_len),
                        ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--efficiency", args.efficiency), ("--dp-overlap", args.dp_overlap),
                        ("--async-tp-overlap", args.async_tp_overlap)):
        zero_ok = flag != "--efficiency"  # an overlap may be none; an efficiency of 0 would compute nothing
        if value is not None and not (0 <= value <= 1 and (zero_ok or value > 0)):
            raise UsageError(f"{flag} is a fraction between 0 and 1, got {value}")
    fp8_names = {flag: tuple(n.strip() for n in value.split(",") if n.strip()) for flag, value in
                 (("--fp8-include", args.fp8_include), ("--fp8-exclude", args.fp8_exclude))}
    for flag, on in (("--fp8-all-gather", args.fp8_all_gather), ("--fp8-tp-all-gather", args.fp8_tp_all_gather),
                     ("--fp8-include", fp8_names["--fp8-include"]), ("--fp8-exclude", fp8_names["--fp8-exclude"]),
                     ("--fp8-recipe", args.fp8_recipe != "tensorwise")):
        if on and args.precision != "fp8":
            raise UsageError(f"{flag} is a float8 option, and --precision {args.precision} has nothing in fp8; add "
                             f"--precision fp8 or leave {flag} out")
    if args.runtime_gib < 0:
        raise UsageError(f"--runtime-gib must be at least 0, got {args.runtime_gib}")
    if not args.expert_imbalance >= 1:
        raise UsageError(f"--expert-imbalance is the busiest rank's rows over the mean, at least 1, got {args.expert_imbalance}")
    micro = int_list(args.micro_batches, "--micro-batches takes comma-separated integers like 1,2,4")
    if any(m < 1 for m in micro):
        raise UsageError(f"--micro-batches values must be at least 1, got {args.micro_batches!r}")
    return tuple(micro), (args.fp8_recipe, *fp8_names.values()) if args.precision == "fp8" else None


def _setting(args) -> tuple:
    """The cluster, the assumptions and the run the arguments describe."""
    from .cost import Run
    from .hardware import cluster
    from .published import assumptions

    machine = cluster(args.gpu, args.gpus, args.gpus_per_node, hbm_gib=args.hbm_gib, peak_tflops=args.peak_tflops,
                      scale_up_gb_s=args.scale_up_gb_s, scale_out_gb_s=args.scale_out_gb_s)
    machine.peak(args.precision)  # an fp8 run on a GPU without fp8: refused before counting
    a = assumptions(args.gpu.lower())  # the kind's own achieved fraction where the calibration has one
    a = dataclasses.replace(a, dp_overlap=args.dp_overlap, async_tp_overlap=args.async_tp_overlap,
                            runtime_gib=args.runtime_gib, expert_imbalance=args.expert_imbalance,
                            **({"efficiency": args.efficiency} if args.efficiency is not None else {}))
    run = Run(args.global_batch or args.gpus, args.seq_len, compile=args.compile, precision=args.precision,
              async_tp=args.async_tp, loss_parallel=args.loss_parallel, compile_loss=args.compile_loss,
              fp8_all_gather=args.fp8_all_gather, fp8_tp_all_gather=args.fp8_tp_all_gather,
              logits_held=args.logits_held, grad_sync=args.grad_sync)
    return machine, a, run


def _print_table(args, counts, machine, run, a, ranked: list[dict], left_out: list[dict], command: str,
                 more: list[str]) -> None:
    """What was forecast, the ``--top`` layouts, the notes, and the command that runs the best."""
    from .cost import GiB
    from .report import HEADER, row

    print(f"{counts.name}: {counts.params / 1e9:.2f} B parameters, {counts.flops_per_token / 1e9:.1f} GFLOP per token "
          f"at {args.seq_len} tokens; {machine.gpus} x {machine.gpu.name} ({machine.gpu.hbm_bytes / GiB:.0f} GiB), "
          f"{machine.gpus_per_node} per node; global batch {run.global_batch} x {run.seq_len} tokens, {run.precision}"
          + (", compiled" if run.compile else "") + (", loss compiled" if run.compile_loss else "")
          + (", fp8 all-gather" if run.fp8_all_gather else "") + (", fp8 TP gathers" if run.fp8_tp_all_gather else "")
          + (", parallel loss" if run.loss_parallel else ", logits gathered under tp")
          + (", logits held through the backward" if run.logits_held else "")
          + (", gradients reduced on each micro-batch" if run.grad_sync == "each" else ""))
    if counts.fp8:
        print(f"float8, as mg.Precision('fp8') converts: {counts.fp8}"
              + ("; rowwise's speedup taken as tensorwise's (no published rowwise run calibrates it)"
                 if args.fp8_recipe == "rowwise" else ""))
    widths = [max(len(h), *(len(row(f)[i]) for f in ranked[:args.top])) for i, h in enumerate(HEADER)]
    for cells in [HEADER] + [row(f) for f in ranked[:args.top]]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    for note in notes(ranked, machine.gpu.hbm_bytes) + more:
        print(f"note: {note}")
    fitting = sum(f["fits"] for f in ranked)
    print(f"{fitting} of {len(ranked)} layouts fit {machine.gpu.hbm_bytes / GiB:.1f} GiB; {len(left_out)} left out "
          "(see the report)")
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(a).items()))
    if command is None:
        print(f"run the best: none, multigpu does not build {ranked[0]['name']} (the note above says why)")
    else:
        print(f"run the best: {command}" if ranked[0]["fits"] else "no layout fits: more GPUs, fp8, a shorter "
              "sequence or a smaller micro-batch")


def _write_report(out: Path, top: int, counts, machine, run, a, ranked: list[dict], left_out: list[dict],
                  command: str | None) -> None:
    """forecast.json, report.md and report.html in ``out``; the HTML's path printed."""
    from ..errors import UsageError
    from .report import write_all

    context = {"model": counts.name, "parameters": counts.params, "gpus": machine.gpus, "gpu": machine.gpu.name,
               "gpus_per_node": machine.gpus_per_node, "global_batch": run.global_batch, "seq_len": run.seq_len,
               "precision": run.precision, "fp8_all_gather": run.fp8_all_gather,
               "fp8_tp_all_gather": run.fp8_tp_all_gather, "compile": run.compile,
               "compile_loss": run.compile_loss, "loss_parallel": run.loss_parallel, "fp8_layers": counts.fp8,
               "grad_sync": run.grad_sync}
    try:
        html = write_all(out, f"Forecast: {counts.name} on {machine.gpus} x {machine.gpu.name}", ranked, left_out,
                         top, a, context, command)
        print(f"report: {html}")
    except UsageError as err:  # matplotlib missing: the table above stands, forecast.json is written
        print(f"no HTML report: {err}")


def _check_out(out: Path) -> None:
    """``--out`` must be a folder this user can create or write into."""
    import os

    from ..errors import UsageError

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for forecast.json and the report")
    parent = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write the forecast to {out}: {parent} is not writable; give --out a writable folder")


# What the forecast's memory may be off by: held-out published rows' worst error within its 15 % target
# (docs/forecast.md); a pick above 1 - this of the GPU is said to be at the edge.
MEMORY_MARGIN = 0.10
TIE = 0.01  # two layouts within 1 % of tokens/s are a tie the forecast cannot call


def notes(ranked: list[dict], hbm_bytes: float) -> list[str]:
    """What the table alone would hide: a pick at the edge of the GPU's memory, a tie at the top (broken by
    the lesser memory, said), and each line the library refuses to build a named layout with (``unbuilt``)."""
    from .cost import GiB

    best = ranked[0]
    said = [f"forecast as described, not run: multigpu does not build it: {why}"
            for why in dict.fromkeys(f["unbuilt"] for f in ranked if f["unbuilt"])]
    if len(ranked) > 1 and ranked[1]["fits"] == best["fits"] and \
            ranked[1]["tokens_per_s_per_gpu"] >= (1 - TIE) * best["tokens_per_s_per_gpu"]:
        said.append(f"{best['name']} and {ranked[1]['name']} are within {100 * TIE:.0f} % of each other's tokens/s, "
                    "closer than the forecast can tell apart: the one using less memory is first")
    if best["fits"] and best["memory_bytes"] > (1 - MEMORY_MARGIN) * hbm_bytes:
        roomy = next((f for f in ranked if f["fits"] and f["memory_bytes"] <= (1 - MEMORY_MARGIN) * hbm_bytes), None)
        alternative = (f"; the fastest that leaves {100 * MEMORY_MARGIN:.0f} % free: {roomy['name']} "
                       f"({roomy['memory_bytes'] / GiB:.1f} GiB, {roomy['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU)"
                       if roomy else "; none leaves that much free")
        said.append(f"{best['name']} fills {best['memory_bytes'] / GiB:.1f} of {hbm_bytes / GiB:.1f} GiB "
                    f"({100 * best['memory_bytes'] / hbm_bytes:.0f} %), within the forecast's memory error "
                    f"(docs/forecast.md){alternative}")
    return said


def sync_note(counts, machine, run, a, ranked: list[dict]) -> list[str]:
    """What reducing the gradients on each micro-batch (``mg.accumulate``'s sync "each") would change where FSDP
    holds every block's unsharded gradient while micro-batches accumulate (sync "last"): the pick's memory, where it
    frees more than the forecast's margin of the GPU, and the layouts that fit only so, with the fastest of them;
    nothing where the run reduces on each already."""
    from .cost import GiB, predict
    from .inputs import Rank

    def each(f: dict) -> dict | None:  # f's forecast reducing on each micro-batch; None where nothing is held aside
        if run.grad_sync == "each" or not Rank(counts, f["layout"], run).held_aside:
            return None  # a pipeline's schedule, DDP, one micro-batch: nothing to free
        return predict(counts, machine, f["layout"], dataclasses.replace(run, grad_sync="each", recompute=f["recompute"]),
                       a)

    said, how = [], "mg.accumulate(model, micro_batches, sync='each') (--grad-sync each)"
    best, got = ranked[0], each(ranked[0])
    if best["fits"] and got and best["memory_bytes"] - got["memory_bytes"] > MEMORY_MARGIN * machine.gpu.hbm_bytes:
        said.append(f"{best['name']} needs {got['memory_bytes'] / GiB:.1f} GiB instead of "
                    f"{best['memory_bytes'] / GiB:.1f} reducing the gradients on each micro-batch, {how}: FSDP then "
                    f"holds its shard of them, not every block's unsharded one; {got['step_s']:.3g} s a step instead "
                    f"of {best['step_s']:.3g}")
    found = [(g["tokens_per_s_per_gpu"], f["name"], g["memory_bytes"]) for f in ranked if not f["fits"]
             for g in [each(f)] if g and g["fits"]]
    if found:
        tps, name, memory = max(found)
        said.append(f"{len(found)} more layout(s) fit reducing the gradients on each micro-batch, {how}; the "
                    f"fastest: {name}, {memory / GiB:.1f} GiB, {tps:,.0f} tokens/s/GPU")
    return said


def _named(spec: str | None, gpus: int) -> list | None:
    """``--layout``'s layouts (their degrees fill ``gpus``), or None: every layout."""
    if spec is None:
        return None
    from ..errors import UsageError
    from ..parallel.flags import parse_layouts

    named = parse_layouts(spec, "--layout")
    for layout in named:
        used = layout.pp * layout.dp_replicate * layout.dp_shard * layout.tp * layout.cp
        if used != gpus:
            raise UsageError(f"--layout {spec!r}: {layout.label} spans {used} GPUs but --gpus is {gpus}; give "
                             f"degrees whose product is {gpus} (e.g. dp_shard={gpus // max(1, used // layout.dp_shard)})")
    return named


def _print_json(ranked: list[dict], left_out: list[dict], top: int, command: str | None, machine, fp8: str,
                more: list[str]) -> int:
    import json

    from .cost import GiB

    keep = ("name", "fits", "step_s", "tokens_per_s_per_gpu", "mfu", "unbuilt")
    rows = [{**{k: f[k] for k in keep}, "memory_gib": f["memory_bytes"] / GiB, "flags": list(f["layout"].flags),
             "recompute": f["recompute"]} for f in ranked[:top]]
    print(json.dumps({"ranked": rows, "layouts": len(ranked), "left_out": left_out, "command": command,
                      "notes": notes(ranked, machine.gpu.hbm_bytes) + more, **({"fp8_layers": fp8} if fp8 else {})},
                     indent=1))
    return 0 if ranked[0]["fits"] else 1
