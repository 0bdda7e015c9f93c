"""Worker for tests/test_zoo.py: every causal-LM family of the installed transformers, built from a tiny
config (no download), trained 5 AdamW steps in float64 under each layout and compared with one process.

The family list is transformers' own (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), so a family added in a new
release is in the zoo the day it is installed; one that cannot be built tiny is skipped with its reason.
Each family's outcome per layout is a figure (the largest parameter difference from one process), a
refusal (``mg.UsageError``: one line naming the feature) or a crash (anything else: a failure).
Outcomes are appended to a JSON-lines file as they come, so a worker that dies or hangs loses nothing
that finished (the test starts another on the families after the one in flight).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
import warnings

import torch

import multigpu as mg

import _hf_layouts as hf

# The tiny sizes, under the names transformers configs use (a config takes those it knows).
TINY = dict(vocab_size=hf.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=0, eos_token_id=1,
            tie_word_embeddings=False)
MAX_PARAMS = 3_000_000
MAX_FORWARD_S = 0.5  # most tiny models take 5-20 ms  # a config that ignores the tiny sizes (an audio or vision tower) is not tiny
LAYOUTS = {"TP 2": {"tp": 2}, "TP 2 + SP": {"tp": 2, "sequence_parallel": True}, "PP 2": {"pp": 2},
           "FSDP 2 x TP 2": {"tp": 2}}
WORLD = {"TP 2": 2, "TP 2 + SP": 2, "PP 2": 2, "FSDP 2 x TP 2": 4}


def families() -> dict[str, str]:
    """Every causal-LM family transformers maps (model type -> class name), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def tiny_config(family: str):
    """The family's config with the tiny sizes it takes, no dropout, eager attention and experts (the same
    arithmetic on any layout; grouped_mm takes no float64)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    base = cls()
    aliases = {v: k for k, v in (getattr(cls, "attribute_map", {}) or {}).items()}
    known = set(inspect.signature(cls.__init__).parameters)
    if dataclasses.is_dataclass(cls):
        known |= {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in TINY.items():
        for key in (name, aliases.get(name)):
            if key and (key in known or hasattr(base, key)):
                kwargs[key] = value
                break
    config = cls(**kwargs)
    for key, value in vars(config).items():  # dropout draws differ by layout: 0, as the zoo compares arithmetic
        if isinstance(value, float) and ("drop" in key or key.endswith("pdrop")):
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def build(family: str):
    """A tiny float64 model of ``family``, the same on every rank (seed 0); ValueError says why it is skipped."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(family)
            cls = getattr(transformers, families()[family])
            with torch.device("meta"):
                count = sum(p.numel() for p in cls(config).parameters())
        except Exception as e:  # noqa: BLE001 - any failure to build is the skip's reason
            raise ValueError(f"does not build from a tiny config: {type(e).__name__}: {first_line(e)}") from None
        if count > MAX_PARAMS:
            raise ValueError(f"not tiny: {count:,} parameters from the tiny sizes (a tower the sizes do not reach)")
        torch.manual_seed(0)
        model = cls(config).double()
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(2, hf.VOCAB, (2, hf.SEQ)), use_cache=False)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"its tiny model does not run one process: {type(e).__name__}: {first_line(e)}") from None
    seconds = time.perf_counter() - start
    if seconds > MAX_FORWARD_S:  # 4 layouts x 5 steps x 2 micro-batches would take minutes
        raise ValueError(f"too slow for the zoo: {seconds:.1f} s for one forward of its tiny model on 2 x 16 "
                         f"tokens (a Python loop over the sequence)")
    return model


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def run(dist, jobs: list[tuple[str, str]], out: str) -> None:
    """Each (family, layout) in turn, one process's weights after 5 steps computed on rank 0 when the family
    changes; rank 0 appends ``{"family", "layout", "diff" | "refused" | "skipped", "seconds"}`` to ``out``.
    A crash (any exception but a refusal) is written by the rank it hit, with its rank, and ends this worker:
    the ranks' collectives no longer pair up after it, so the test starts a fresh one after that job."""
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    family = reference = None
    for name, label in jobs:
        start = time.perf_counter()
        row = {"family": name, "layout": label}
        try:
            if name != family:
                family, reference = name, None
                try:
                    build(name)
                except ValueError as e:
                    reference = str(e)
                else:
                    reference = hf.train(dist, "zoo:" + name, None) if dist.rank == 0 else {}
            if isinstance(reference, str):
                row["skipped"] = reference
            else:
                layout = LAYOUTS[label]
                got = (hf.train_pipeline if layout.get("pp", 1) > 1 else hf.train)(dist, "zoo:" + name, layout)
                if dist.rank == 0:
                    row["diff"] = hf.max_diff(got, reference)
        except mg.UsageError as e:
            row["refused"] = str(e)
        except Exception as e:  # noqa: BLE001 - the crash is the outcome; the test goes on after it
            row |= {"crashed": f"{type(e).__name__}: {first_line(e)}", "rank": dist.rank,
                    "seconds": time.perf_counter() - start}
            write(out, row)
            raise
        row["seconds"] = time.perf_counter() - start
        if dist.rank == 0:
            write(out, row)


def write(out: str, row: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def zoo(world: int, jobs: list[tuple[str, str]], out: str, timeout: float = 1500.0) -> list[dict]:
    """Run ``jobs`` on ``world`` ranks, a fresh worker after each crash (or hang: ``timeout`` for a worker),
    the job it died in recorded as crashed; every job's row, in order."""
    from multigpu.testing import spawn

    rows: dict[tuple[str, str], dict] = {}
    while len(rows) < len(jobs):
        todo = [job for job in jobs if job not in rows]
        try:
            spawn(run, world, todo, out, timeout=timeout)
        except (RuntimeError, TimeoutError) as e:
            failure = f"{type(e).__name__}: {first_line(e)}"
        else:
            failure = None
        before = len(rows)
        for line in open(out):
            row = json.loads(line)
            rows.setdefault((row["family"], row["layout"]), row)
        said = any("crashed" in rows[job] for job in todo if job in rows)
        if failure is not None and not said:  # died or hung without a word: no rank reached its except
            lost = next(job for job in todo if job not in rows)
            rows[lost] = {"family": lost[0], "layout": lost[1], "crashed": f"the worker ended: {failure}"}
        elif failure is not None and len(rows) == before:
            raise RuntimeError(f"the zoo's worker ends without progress: {failure}")
    return [rows[job] for job in jobs]
