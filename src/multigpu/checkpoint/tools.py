"""``multigpu ckpt ls | verify | export | import``: inspect and convert checkpoints in one process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime import compat
from ..errors import UsageError
from ..runtime.fields import add_field
from . import storage


@dataclass(frozen=True)
class CkptConfig:
    """What ``multigpu ckpt`` was asked: the action and its paths (``dir`` for ls and verify, ``checkpoint`` and
    ``out`` for export, ``hf_dir`` and ``out`` for import). Each path's docstring is its argument's help in `multigpu ckpt ACTION --help`
    (``add_arguments``)."""

    action: str
    """ls, verify, export or import"""
    dir: str | None = None
    """run directory (or one checkpoint directory)"""
    checkpoint: str | None = None
    """checkpoint directory, e.g. runs/x/step-120"""
    out: str | None = None
    """output file, e.g. model.pt (with --hf: a new directory)"""
    hf: str | None = None
    """write OUT as a Hugging Face directory (sharded safetensors, index, config), the config and tokenizer
    files from this directory: the one the run started from (mg.from_pretrained's)"""
    hf_dir: str | None = None
    """a Hugging Face directory (config.json and safetensors, as save_pretrained writes it)"""
    run_dir: str | None = None
    """a new run directory: its step-0 is the checkpoint mg.Checkpointer(out, ...).resume() loads on any layout,
    the optimizer fresh"""


def _run_dir(directory: str | Path) -> Path:
    path = Path(directory)
    if not path.exists():
        raise UsageError(f"checkpoint directory {path} does not exist; pass the directory given to mg.Checkpointer")
    if not path.is_dir():
        raise UsageError(f"{path} is a file, not a checkpoint directory; pass the directory given to mg.Checkpointer")
    return path


def _targets(directory: Path) -> list[Path]:
    """A run directory's checkpoints, or the one checkpoint ``directory`` is."""
    if (directory / storage.MARKER).exists() or (directory / storage.MANIFEST).exists():
        return [directory]
    return [e.path for e in storage.scan(directory)]


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def table(directory: str | Path, full: bool = False) -> tuple[list[str], int]:
    """Lines describing every checkpoint under ``directory``, and how many are not valid.

    ``full=False`` checks the marker, manifest and file sizes; ``full=True``
    also every file's checksum (reads all bytes).

    >>> lines, bad = table("runs/x")
    """
    path = _run_dir(directory)
    targets = _targets(path)
    rows = [("checkpoint", "step", "world", "strategy", "size", "written", "status")]
    bad = 0
    for t in targets:
        manifest, problems = storage.verify(t, full=full)
        if problems:
            bad += 1
            status = "NOT VALID: " + problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
        else:
            status = "valid" if full else "complete (sizes ok)"
        m = manifest or {}
        rows.append((
            str(t), str(m.get("step", "?")), str(m.get("world_size", "?")), str(m.get("strategy", "?")),
            _size(m["bytes"]) if "bytes" in m else "?", str(m.get("time", "?")), status,
        ))
    if not targets:
        return [f"no checkpoints in {path}"], 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return lines, bad


def export(checkpoint: str | Path, out: str | Path) -> dict[str, int]:
    """Write the model weights of one checkpoint as a plain ``torch.save`` file.

    Keys are those of the unwrapped model (no ``module.`` prefix), so
    ``model.load_state_dict(torch.load(out, weights_only=True))`` works
    without multigpu or a process group. The checkpoint is fully verified first.

    >>> export("runs/x/step-120", "model.pt")
    """
    src = Path(checkpoint)
    manifest = storage.verified_model(src)
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"export target {out} is a directory; pass a file name such as {out / 'model.pt'}")
    if not out.parent.is_dir():
        raise UsageError(f"the directory of export target {out} does not exist; create {out.parent} first")
    state: dict = {}  # filled from the checkpoint's metadata
    compat.dcp_load_in_place(state, storage_reader=storage.SafeReader(src),
                             planner=storage.SafeEmptyLoadPlanner(keys={"model"}), no_dist=True)
    weights = state["model"]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(weights, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    tensors = [v for v in weights.values() if isinstance(v, torch.Tensor)]
    return {"step": manifest["step"], "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors),
            "bytes": out.stat().st_size}


def main(args) -> int:
    """`multigpu ckpt ls | verify | export | import`: print the table or export; exit 1 when verify finds damage."""
    # Each action's parser has only its own paths: the others are absent from args, None here.
    given = vars(args)
    cfg = CkptConfig(action=args.action, dir=given.get("dir"), checkpoint=given.get("checkpoint"), out=given.get("out"),
                     hf=given.get("hf"), hf_dir=given.get("hf_dir"),
                     run_dir=given.get("out") if args.action == "import" else None)
    if cfg.action == "import":
        from .hf_import import import_hf

        info = import_hf(cfg.hf_dir, cfg.run_dir)
        print(f"imported {cfg.hf_dir} -> {info['checkpoint']}: {info['tensors']} tensors, {info['parameters']:,} "
              f"parameters, {info['bytes']:,} bytes; resume with mg.Checkpointer({str(cfg.run_dir)!r}, model=...)"
              ".resume() on any layout (the optimizer starts fresh)")
        return 0
    if cfg.action == "export" and cfg.hf is not None:
        from .hf_export import export_hf

        info = export_hf(cfg.checkpoint, cfg.out, cfg.hf)
        print(f"exported {cfg.checkpoint} (step {info['step']}) -> {cfg.out}: {info['tensors']} tensors in "
              f"{info['files']} safetensors files, {info['bytes']:,} bytes; load with "
              f"AutoModelForCausalLM.from_pretrained({str(cfg.out)!r})")
        return 0
    if cfg.action == "export":
        info = export(cfg.checkpoint, cfg.out)
        print(f"exported {cfg.checkpoint} (step {info['step']}) -> {cfg.out}: {info['tensors']} tensors, "
              f"{info['parameters']:,} parameters, {info['bytes']:,} bytes; "
              "load with model.load_state_dict(torch.load(path, weights_only=True))")
        return 0
    if cfg.action == "verify" and not _targets(_run_dir(cfg.dir)):
        # Nothing checked is not "all valid": a wrong directory must not pass a CI step.
        raise UsageError(f"no checkpoints in {_run_dir(cfg.dir)} to verify; expected step-N folders written by "
                         f"mg.Checkpointer: pass the directory given to Checkpointer(...)")
    lines, bad = table(cfg.dir, full=cfg.action == "verify")
    print("\n".join(lines))
    if cfg.action == "verify":
        print(f"{bad} of {len(lines) - 1} checkpoints not valid" if bad else "all checkpoints valid")
        return 1 if bad else 0
    return 0


def add_arguments(parser) -> None:
    """`multigpu ckpt ls | verify | export | import` arguments."""
    # Sub-actions use the parent's parser class, so their mistakes are one line too.
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    ls = actions.add_parser("ls", help="checkpoints with step, world size, size, and valid or why not (sizes only)")
    add_field(ls, "dir", config=CkptConfig, field="dir")
    verify = actions.add_parser("verify", help="check every file's checksum; exit status 1 if any checkpoint is damaged")
    add_field(verify, "dir", config=CkptConfig, field="dir")
    exp = actions.add_parser("export", help="write one checkpoint's model weights as a plain torch.save file, or "
                             "(--hf) as a Hugging Face directory")
    add_field(exp, "checkpoint", config=CkptConfig, field="checkpoint")
    add_field(exp, "out", config=CkptConfig, field="out")
    add_field(exp, "--hf", config=CkptConfig, field="hf", metavar="BASE_DIR")
    imp = actions.add_parser("import", help="write a Hugging Face directory as a checkpoint mg.Checkpointer resumes "
                             "from on any layout (step 0, the optimizer fresh)")
    add_field(imp, "hf_dir", config=CkptConfig, field="hf_dir")
    add_field(imp, "out", config=CkptConfig, field="run_dir")
