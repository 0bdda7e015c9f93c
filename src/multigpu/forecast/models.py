"""``--model``: a name from ``tables/models.json``, a transformers ``config.json`` (or its folder), or
``module:function`` / ``path.py:function`` returning the user's own ``nn.Module`` (built on fake tensors)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

from ..errors import UsageError
from .counts import Counts, count
from .hardware import DATA


@cache
def presets() -> dict[str, dict]:
    return json.loads((DATA / "models.json").read_text())["models"]


def config_builder(config: dict, name: str):
    """A builder of the transformers causal LM ``config`` describes (attention through SDPA where the family has it,
    else its own; no cache)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UsageError("forecasting a transformers config needs transformers; pip install 'multigpu[hf]'") from None
    fields = dict(config)
    kind = fields.pop("model_type", None)
    if not kind:
        raise UsageError(f"{name} has no \"model_type\"; expected a transformers config.json (model_type: llama, ...)")
    try:
        cfg = AutoConfig.for_model(kind, **fields)
    except Exception as err:  # transformers' validators raise their own kinds
        raise UsageError(f"{name}: transformers cannot read this config ({' '.join(str(err).split())[:200]})") from None
    if getattr(cfg, "is_encoder_decoder", False):  # transformers would build its decoder alone as a causal LM (BART)
        raise UsageError(f"{name} is an encoder-decoder ({kind}); forecast plans a stack of decoder blocks, as "
                         "mg.parallelize spreads it (its zoo skips encoder-decoders): give a decoder-only config")
    own = cfg._attn_implementation

    def build():
        # SDPA: the kernel torchtitan and mg.parallelize's context parallelism run; a family transformers gives none
        # (gpt-oss: its attention sinks) runs the attention its config names, as training it would.
        cfg._attn_implementation = "sdpa"
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError as err:
            if "scaled_dot_product_attention" not in str(err):
                raise
        cfg._attn_implementation = own or "eager"
        return AutoModelForCausalLM.from_config(cfg)
    return build


def builder(spec: str):
    """(a builder, its display name) for ``--model``."""
    if spec in presets():
        return config_builder(presets()[spec], spec), spec
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.is_file():
            raise UsageError(f"--model {spec}: no such file; expected one of {', '.join(presets())}, a config.json "
                             "or module:function")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"--model {spec} is not a JSON config ({str(err)[:120]}); expected a transformers "
                             "config.json") from None
        if not isinstance(config, dict):
            raise UsageError(f"--model {spec} holds a {type(config).__name__}, expected a JSON object (config.json)")
        return config_builder(config, str(path)), path.parent.name or path.stem
    if ":" in spec:
        where, fn = spec.rsplit(":", 1)
        try:
            if where.endswith(".py"):
                loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
                module = importlib.util.module_from_spec(loaded)
                loaded.loader.exec_module(module)
            else:
                module = importlib.import_module(where)
            return getattr(module, fn), fn
        except Exception as err:  # the user's file may raise anything while it is imported
            raise UsageError(f"--model {spec}: cannot load {fn} from {where} ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:160]})") from None
    raise UsageError(f"--model {spec!r} is not a known model ({', '.join(presets())}), a config.json or "
                     "module:function")


_COUNTED: dict[tuple, Counts] = {}  # (spec, seq_len, fp8) -> its counts: each model counted once a process


def counted(spec: str, seq_len: int, fp8: tuple[str, tuple[str, ...], tuple[str, ...]] | None = None) -> Counts:
    """``spec`` counted at ``seq_len``; with ``fp8`` (recipe, include, exclude) its float8 layers apart."""
    key = (spec, seq_len, fp8)
    if key not in _COUNTED:
        build, name = builder(spec)
        _COUNTED[key] = count(build, seq_len, name=name, fp8=fp8)
    return _COUNTED[key]


def count_many(keys) -> None:
    """Count every (spec, seq_len, fp8) in ``keys`` not counted yet, spread over this process and forked
    copies of it, one a core: a count is one Python thread's work (a fake forward and backward, seconds for a
    405B), and checking the published table counts about twenty models."""
    todo = [k for k in dict.fromkeys(keys) if k not in _COUNTED]
    workers = min(len(todo), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        for key in todo:
            counted(*key)
        return
    # Forked, as DataLoader's workers are: a spawned one would import the caller's script again.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        for key, counts in zip(todo, pool.map(_count, todo)):
            _COUNTED[key] = counts


def _count(key: tuple) -> Counts:
    return counted(*key)
