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
import functools
import inspect
import json
import pathlib
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
# Sizes of some families, tried too (a config that refuses one is built without them): latent attention
# (DeepSeek-V2/V3, MiniCPM3), partial rotary (GPT-J, CodeGen), linear attention (Qwen3-Next).
TINY_MORE = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                 rotary_dim=4, first_k_dense_replace=1, n_group=1, topk_group=1, index_head_dim=8,
                 index_n_heads=2, index_topk=4, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_num_key_heads=2, linear_num_value_heads=4)
TOL = 1e-9
# A family that computes parts in float32 inside a float64 model (Cohere's and Gemma's norms, logits cast
# to float32) is off by more than TOL from one process itself, run with 2 micro-batches a step instead of 1 (the
# same arithmetic in another order): its floor. Such a family is judged within FLOOR_FACTOR times it
# (a single draw of a noisy quantity: TP splits the float32 sums by features, SP by sequence, the floor by
# batch; Gemma-4's TP 2 + SP is 56x its floor, FSDP 2 x TP 2 120x; a wrong split is off by 1e-4 to 1e-2).
FLOOR_FACTOR = 1000
MAX_PARAMS = 3_000_000  # a config whose other sizes (a vision or audio tower) the tiny ones do not reach
MAX_STEP_S = 0.2  # most tiny models take 5-30 ms
CHUNK = 36  # jobs per worker
LAYOUTS = {"TP 2": {"tp": 2}, "TP 2 + SP": {"tp": 2, "sequence_parallel": True}, "PP 2": {"pp": 2},
           "FSDP 2 x TP 2": {"tp": 2}, "EP 2": {"ep": 2}, "EP 2 + TP 2": {"ep": 2, "tp": 2}, "CP 2": {"cp": 2}}
WORLD = {"TP 2": 2, "TP 2 + SP": 2, "PP 2": 2, "FSDP 2 x TP 2": 4, "EP 2": 2, "EP 2 + TP 2": 4, "CP 2": 2}
NO_EXPERTS = "has no experts module"  # a dense family's EP refusal: the same on 4 ranks, not run again


# Encoders with a per-token head and a ViT (tests/_hf_layouts.py builds them), beside the causal LMs: no
# pipeline for them (mg.parallel.pipeline cuts causal LMs and nn.Sequential).
ENCODERS = ["encoder:bert", "encoder:roberta", "encoder:modernbert", "encoder:distilbert", "encoder:vit"]
ENCODER_LAYOUTS = ["TP 2", "TP 2 + SP", "FSDP 2 x TP 2", "CP 2"]


def families() -> dict[str, str]:
    """Every causal-LM family transformers maps (model type -> class name), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def kind_of(name: str) -> str:
    """The model kind tests/_hf_layouts.py builds for a zoo family name."""
    return name.split(":", 1)[1] if name.startswith("encoder:") else "zoo:" + name


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
    def taken(sizes: dict) -> dict:
        kwargs = {}
        for name, value in sizes.items():
            for key in (name, aliases.get(name)):
                if key and (key in known or hasattr(base, key)):
                    kwargs[key] = value
                    break
        return kwargs

    more = taken(TINY | TINY_MORE)
    if "kv_lora_rank" in more:  # latent attention expands its keys to every head: as many KV heads as heads
        more[next(k for k in ("num_key_value_heads", aliases.get("num_key_value_heads")) if k in more)] = \
            TINY["num_attention_heads"]
    try:
        config = cls(**more)
    except Exception:  # noqa: BLE001 - a property without a setter, a validator: the core sizes alone
        config = cls(**taken(TINY))
    for key, value in vars(config).items():  # random draws differ by layout: none, as the zoo compares arithmetic
        if isinstance(value, float) and ("drop" in key or "jitter" in key):  # dropout, a router's noise (PhiMoE)
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
            raise ValueError(f"not tiny: {count:,} parameters from the tiny sizes (sizes its config names otherwise)")
        torch.manual_seed(0)
        return cls(config).double()


@functools.cache
def _recorded() -> dict[str, str]:
    """tests/zoo_expected.json's outcomes for this transformers release (read once a worker; {} for another)."""
    path = pathlib.Path(__file__).with_name("zoo_expected.json")
    expected = json.loads(path.read_text()) if path.exists() else {}
    return expected.get("outcomes", {}) if expected.get("transformers") == transformers_version() else {}


def recorded_outcomes(family: str) -> list[str]:
    """The outcomes tests/zoo_expected.json records for ``family``'s cells under this transformers release."""
    return [v for k, v in _recorded().items() if k.split(" | ")[0] == family]


def why_skipped(family: str) -> str | None:
    """Why ``family`` is left out of the zoo (it does not build tiny, does not run one process, or its tiny
    model's step is too slow for CI), or None."""
    if family.startswith("encoder:"):
        return None
    try:
        model = build(family)
    except ValueError as e:
        return str(e)
    ids = torch.randint(2, hf.VOCAB, (2, hf.SEQ))
    try:  # the first step pays a worker's one-time costs (the first model of its kind in the process): untimed
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    except Exception as e:  # noqa: BLE001
        return f"its tiny model does not run one process: {type(e).__name__}: {first_line(e)}"
    recorded = recorded_outcomes(family)
    if recorded:  # a family this release's record has: its cells run, or all skip, as recorded (a clock near
        # MAX_STEP_S flipped families between runs and within one, one layout run and the next skipped)
        if set(recorded) != {"skipped"}:
            return None
        return "too slow for the zoo (recorded for this transformers release; a Python loop over the sequence)"
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    seconds = time.perf_counter() - start
    if seconds > MAX_STEP_S:  # 4 layouts x 5 steps would take a minute of CI's 25
        return (f"too slow for the zoo: {seconds:.2f} s for a forward and backward of its tiny model on 2 x 16 "
                f"tokens (llama: 0.01 s; a Python loop over the sequence)")
    return None


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
            if name != family:  # rank 0 decides (a time measured on each rank could disagree)
                family, reference = name, _reference(dist, name, out) if dist.rank == 0 else {}
                why = [reference if isinstance(reference, str) else None]  # the skip's reason, to every rank
                torch.distributed.broadcast_object_list(why, src=0)
                reference = why[0] or reference
            if isinstance(reference, str):
                row["skipped"] = reference
            else:
                layout = LAYOUTS[label]
                # One micro-batch a step (two through a pipeline): the zoo checks the layouts, not accumulation.
                if layout.get("pp", 1) > 1:
                    got = hf.train_pipeline(dist, kind_of(name), layout, accum=2)
                else:
                    got = hf.train(dist, kind_of(name), layout, accum=1)
                if dist.rank == 0:
                    row["diff"] = hf.max_diff(got, reference)
                    if row["diff"] > TOL:  # judged against the family's own floor
                        if "floor" not in reference:
                            reference["floor"] = hf.max_diff(hf.train(dist, kind_of(name), None, accum=2), reference)
                        row["floor"] = reference["floor"]
                    row["tolerance"] = max(TOL, FLOOR_FACTOR * row.get("floor", 0.0))
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


def _reference(dist, family: str, out: str) -> dict | str:
    """One process's weights after the zoo's 5 steps, or why ``family`` is skipped: computed once for the
    whole zoo and kept beside ``out`` (in its folder), so the 4-rank pass reads what the 2-rank pass computed."""
    path = pathlib.Path(out).parent / "references" / f"{family.replace(':', '_')}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    reference = why_skipped(family) or hf.train(dist, kind_of(family), None, accum=1)
    path.parent.mkdir(exist_ok=True)
    torch.save(reference, path.with_suffix(".part"))
    path.with_suffix(".part").replace(path)  # a worker killed mid-save leaves no half reference
    return reference


def write(out: str, row: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def zoo(world: int, jobs: list[tuple[str, str]], out: str, timeout: float = 1500.0) -> list[dict]:
    """Run ``jobs`` on ``world`` ranks, a fresh worker after each crash (or hang: ``timeout`` for a worker),
    the job it died in recorded as crashed; every job's row, in order."""
    from multigpu.testing import spawn

    rows: dict[tuple[str, str], dict] = {}
    while len(rows) < len(jobs):
        # A fresh worker every CHUNK jobs: each layout builds its process groups anew, and a worker holding
        # hundreds of them slows down (llama TP 2: 1.5 s fresh, 10 s after 300 jobs).
        todo = [job for job in jobs if job not in rows][:CHUNK]
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


def cell(row: dict) -> str:
    if "diff" in row:
        tol = row["tolerance"]
        figure = f"{row['diff']:.1e}" + (f" (floor {row['floor']:.1e})" if tol > TOL else "")
        return figure if row["diff"] <= tol else f"**WRONG {figure}**"
    if "refused" in row:
        line = row["refused"]
        return "refused: " + (line[:110].rsplit(" ", 1)[0] + " ..." if len(line) > 110 else line)
    if "skipped" in row:
        return "skipped: " + row["skipped"][:100]
    return f"**CRASHED** {row['crashed'][:100]}"


def table(rows: list[dict]) -> str:
    """The zoo as markdown: a row per family that built (a figure: the largest parameter difference from one
    process, or the refusal's start), then the skipped families with their reasons."""
    import torch
    import transformers

    layouts = list(LAYOUTS)
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["family"], {})[r["layout"]] = r
    ran = {f: v for f, v in by.items() if not all("skipped" in r for r in v.values())}
    skipped = {f: next(iter(v.values()))["skipped"] for f, v in by.items() if f not in ran}
    out = [f"transformers {transformers.__version__}, torch {torch.__version__}: {len(by)} families (causal LMs "
           f"as transformers maps them, and {sum(f.startswith('encoder:') for f in by)} encoders), "
           f"{len(ran)} built tiny and run, {len(skipped)} skipped. Float64, 5 AdamW steps, clipping 0.5; the "
           f"figure is the largest parameter difference from one process (tolerance {TOL:g}, or {FLOOR_FACTOR} x "
           "the family's floor where it computes parts in float32).", "",
           "| family | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for family, cells in sorted(ran.items()):
        out.append(f"| {family} | " + " | ".join(cell(cells[l]) if l in cells else "" for l in layouts) + " |")
    out += ["", "Skipped (not built tiny here):", ""]
    out += [f"- {family}: {why}" for family, why in sorted(skipped.items())]
    return "\n".join(out) + "\n"
