"""Where the meter's records go: JSONL (always), TensorBoard, CSV, W&B, MLflow, console.

Every sink has ``write(record)`` and ``close()``; only rank 0 creates sinks.
A record is a flat-ish dict (see ``SCHEMA`` in meter.py); ``flatten`` turns
nested parts (``gpu.util_pct.max``) into ``gpu/util_pct/max`` for the
scalar-only sinks. W&B and MLflow are optional extras, imported lazily.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from typing import Any

from ..errors import UsageError


def agree_log_dir(log_dir: str | None, distributed: bool) -> str:
    """Where every rank's meter logs: ``log_dir``, else `multigpu run`'s run directory, else a fresh one that
    rank 0 names (a restart appends to its metrics.jsonl: ``continues_launch``). Collective when distributed
    and neither is given."""
    import datetime

    from ..runtime.contract import run_dir

    log_dir = log_dir if log_dir is not None else run_dir()
    if log_dir is None:
        log_dir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        if distributed:  # every rank must write into rank 0's directory
            import torch.distributed as tdist

            box = [log_dir]
            tdist.broadcast_object_list(box, src=0)
            log_dir = box[0]
    return log_dir


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``record`` as ``{"a/b": value}`` (bools and strings dropped)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            if not (isinstance(value, float) and math.isnan(value)):
                out[name] = value
    return out


def _json_default(obj: Any):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _no_nan(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_no_nan(v) for v in obj]
    return obj


def last_header(path: str, block: int = 1 << 16) -> dict[str, Any] | None:
    """The last ``header`` record of a metrics.jsonl, read from its end (None: it has none)."""
    with open(path, "rb") as fp:
        pos, rest = fp.seek(0, os.SEEK_END), b""
        while pos > 0:
            size = min(block, pos)
            pos -= size
            fp.seek(pos)
            lines = (fp.read(size) + rest).split(b"\n")
            rest = lines.pop(0) if pos > 0 else b""  # maybe the end of a line that starts further up
            for line in reversed(lines):
                if line.startswith(b'{"type":"header"'):
                    try:
                        return json.loads(line)
                    except ValueError:
                        continue  # cut short by a crash
    return None


def continues_launch(previous: dict[str, Any] | None, launch: dict[str, int] | None) -> bool:
    """True when ``launch`` is a later attempt of a launch that wrote the header ``previous``.

    A header's ``launch`` maps each ``multigpu run`` launcher of its world (one per node, a fresh
    id per launch) to its attempt number. A restart shares a launcher and has a higher number;
    a separate run, any launch's attempt 0, a second meter in the same attempt, or a file written
    outside ``multigpu run`` do not.

    >>> continues_launch({"launch": {"9f0c": 0}}, {"9f0c": 1}), continues_launch({"launch": {"9f0c": 0}}, {"a1b2": 1})
    (True, False)
    """
    before = (previous or {}).get("launch") or {}
    return any(isinstance(before.get(lid), int) and attempt > before[lid] for lid, attempt in (launch or {}).items())


class JsonlSink:
    """One JSON object per line: a ``header`` line, ``step``/``eval`` lines, a ``summary`` line.

    An existing file is refused unless ``resume`` is true or it is a restart's (``continues_launch``):
    then the records are appended after a new header line.
    """

    name = "jsonl"

    def __init__(self, path: str, header: dict[str, Any], resume: bool = False) -> None:
        if os.path.exists(path) and not resume:
            resume = continues_launch(last_header(path), header.get("launch"))
            if not resume:
                raise UsageError(f"{path} already exists; give the run a fresh log_dir, or pass resume=True to append to it")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._f = open(path, "a" if resume else "x", encoding="utf-8")
        if resume and self._f.tell() > 0:
            with open(path, "rb") as fp:
                fp.seek(-1, os.SEEK_END)
                if fp.read(1) != b"\n":  # a record a crash cut short: the header starts a line of its own
                    self._f.write("\n")
        self.write(header)

    def write(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, separators=(",", ":"), default=_json_default)
        if "NaN" in text:  # JSON readers differ on NaN: write null instead (rare, so only then walk the record)
            text = json.dumps(_no_nan(record), separators=(",", ":"), default=_json_default)
        self._f.write(text + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``; the header as text."""

    name = "tensorboard"

    def __init__(self, log_dir: str, header: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("the tensorboard sink needs the tensorboard package; pip install 'multigpu[tensorboard]'") from None
        self._w = SummaryWriter(log_dir=log_dir)
        self._w.add_text("fingerprint", "```\n" + json.dumps(header, indent=1, default=_json_default) + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") not in ("step", "eval"):
            return
        step = int(record.get("step", 0))
        prefix = "eval/" if record["type"] == "eval" else ""
        for key, value in flatten(record).items():
            if key != "step":
                self._w.add_scalar(prefix + key, value, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class CsvSink:
    """``step`` records as CSV rows; columns fixed by the first record (later new keys are left out)."""

    name = "csv"

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "w", newline="", encoding="utf-8")
        self._writer: csv.DictWriter | None = None

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") != "step":
            return
        row = flatten(record)
        if self._writer is None:
            self._writer = csv.DictWriter(self._f, fieldnames=list(row), extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow(row)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class WandbSink:
    """Weights & Biases (``pip install 'multigpu[wandb]'``); ``mode="offline"`` writes locally."""

    name = "wandb"

    def __init__(self, log_dir: str, header: dict[str, Any], **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise UsageError("the wandb sink needs wandb; pip install 'multigpu[wandb]' or drop 'wandb' from sinks") from None
        init_kwargs.setdefault("dir", log_dir)
        init_kwargs.setdefault("config", flatten_strings(header))
        self._run = wandb.init(**init_kwargs)

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") in ("step", "eval"):
            prefix = "eval/" if record["type"] == "eval" else ""
            self._run.log({prefix + k: v for k, v in flatten(record).items() if k != "step"}, step=int(record["step"]))
        elif record.get("type") == "summary":
            self._run.summary.update(flatten(record))

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow (``pip install 'multigpu[mlflow]'``); a local SQLite store under the run by default.

    (MLflow 3 refuses its old ``file:`` store unless told otherwise; SQLite is its local default.)
    """

    name = "mlflow"

    def __init__(self, log_dir: str, header: dict[str, Any], tracking_uri: str | None = None, **run_kwargs: Any) -> None:
        try:
            import mlflow
        except ImportError:
            raise UsageError("the mlflow sink needs mlflow; pip install 'multigpu[mlflow]' or drop 'mlflow' from sinks") from None
        self._mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri or "sqlite:///" + os.path.abspath(os.path.join(log_dir, "mlflow.db")))
        mlflow.start_run(**run_kwargs)
        mlflow.log_params({k[:250]: str(v)[:500] for k, v in flatten_strings(header).items()})

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") in ("step", "eval"):
            prefix = "eval/" if record["type"] == "eval" else ""
            self._mlflow.log_metrics({prefix + k: float(v) for k, v in flatten(record).items() if k != "step"},
                                     step=int(record["step"]))

    def close(self) -> None:
        self._mlflow.end_run()


def flatten_strings(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten_strings(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def check_sinks(names) -> None:
    """Unknown sinks and missing optional packages, as one-line errors, before anything is written.

    Every rank calls it, so a mistake stops all ranks alike instead of rank 0 alone.
    """
    import importlib.util

    unknown = set(names) - {"jsonl", "csv", *_EXTRAS}
    if unknown:
        raise UsageError(f"unknown sink(s) {sorted(unknown)}; choose from jsonl, tensorboard, csv, wandb, mlflow")
    for name in names:
        if name in _EXTRAS and importlib.util.find_spec(_EXTRAS[name][0]) is None:
            raise UsageError(f"the {name} sink needs the {_EXTRAS[name][0]} package; "
                             f"pip install 'multigpu[{_EXTRAS[name][1]}]' or drop {name!r} from sinks")


def make_sinks(names, log_dir: str, header: dict[str, Any], resume: bool, options: dict[str, dict[str, Any]]) -> list:
    """JSONL plus the named sinks (rank 0)."""
    out: list[Any] = [JsonlSink(os.path.join(log_dir, "metrics.jsonl"), header, resume=resume)]
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardSink(os.path.join(log_dir, "tensorboard"), header))
        elif name == "csv":
            out.append(CsvSink(os.path.join(log_dir, "metrics.csv")))
        elif name == "wandb":
            out.append(WandbSink(log_dir, header, **options.get("wandb", {})))
        elif name == "mlflow":
            out.append(MlflowSink(log_dir, header, **options.get("mlflow", {})))
    return out


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ConsoleSink:
    """Rank 0's progress: an updating ``\\r`` line on a terminal, plain lines otherwise.

    Updated at log steps only: the loss is known there without an extra sync.
    """

    name = "console"

    def __init__(self, total_steps: int | None = None, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total = total_steps
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.monotonic()
        self._open_line = False

    def format(self, record: dict[str, Any]) -> str:
        step = record["step"] + 1
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        if self.total:
            elapsed = time.monotonic() - self._t0
            parts[0] += f" {100 * step / self.total:3.0f}%"
            parts.append(f"ETA {_duration(elapsed / step * (self.total - step))}")
        if record.get("loss") is not None:
            parts.append(f"loss {record['loss']:.4g}")
        if record.get("samples_per_s") is not None:
            parts.append(f"{record['samples_per_s']:,.0f} samples/s")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts.append(f"data {100 * record.get('data_wait_frac', 0):.0f}%")
        return " | ".join(parts)

    def note(self, line: str) -> None:
        """A message that must stay visible (straggler, monitor off): on its own line."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") == "step":
            line = self.format(record)
            if self.tty:
                self.stream.write("\r" + line + "\x1b[K")
                self._open_line = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
            for s in record.get("stragglers") or []:
                if s.get("intervals", 1) >= 2:  # printed once it persists; every detection is in the JSONL
                    self.note(f"{s['line']} ({s['intervals']} log intervals in a row)")
        elif record.get("type") == "eval":
            self.note("eval step {}: {}".format(record["step"], ", ".join(
                f"{k} {v:.4g}" for k, v in flatten(record).items() if k != "step")))

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
