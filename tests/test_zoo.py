"""The model zoo: every causal-LM family of the installed transformers, exact or refused, never different.

The families come from transformers itself (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, tests/_zoo.py), each
built from a tiny config in float64 and trained 5 AdamW steps (clipping at 0.5) under TP 2, TP 2 + SP,
PP 2 (2 ranks) and FSDP 2 x TP 2 (4 ranks), against one process: within 1e-9 on every parameter (or 100
times the family's own floor where it computes parts in float32: see _zoo.FLOOR_FACTOR), or refused by
``mg.UsageError`` in one line. Anything else is a crash, and the test fails on any wrong figure or crash.
A family that cannot be built tiny is skipped with its reason. The table goes to the test's output, and
to a file with MULTIGPU_ZOO_TABLE=docs/zoo.md.
"""

import collections
import os

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[hf])")

import _zoo  # noqa: E402

# CI runs a sample fixed by a rule, not by choice (every 8th family transformers lists, and the four MoE
# families multigpu declares plans for; ~5 of 25 minutes on 2 cores); MULTIGPU_ZOO=all runs every family
# (about 10 minutes for the 2-rank layouts: docs/zoo.md has that run's table).
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def zoo_families() -> list[str]:
    names = list(_zoo.families())
    if os.environ.get("MULTIGPU_ZOO") == "all":
        return names
    return [n for i, n in enumerate(names) if i % 8 == 0 or n in MOE]


TWO = [label for label, world in _zoo.WORLD.items() if world == 2]
FOUR = [label for label, world in _zoo.WORLD.items() if world == 4]


def outcome(row: dict) -> str:
    if "diff" in row:
        return "wrong" if row["diff"] > row["tolerance"] else "exact"
    return next(k for k in ("refused", "skipped", "crashed") if k in row)


@pytest.mark.slow
def test_every_causal_lm_family_is_exact_or_refused_under_every_layout(tmp_path):
    names = zoo_families()
    rows = _zoo.zoo(2, [(n, label) for n in names for label in TWO], str(tmp_path / "two.jsonl"))
    built = [n for n in names if not any("skipped" in r for r in rows if r["family"] == n)]
    rows += _zoo.zoo(4, [(n, label) for n in built for label in FOUR], str(tmp_path / "four.jsonl"))
    table = _zoo.table(rows)
    print(table)
    if os.environ.get("MULTIGPU_ZOO_TABLE"):
        with open(os.environ["MULTIGPU_ZOO_TABLE"], "w") as f:
            f.write(table)
    counts = collections.Counter(outcome(r) for r in rows)
    print(dict(counts))
    bad = [f"{r['family']} {r['layout']}: {r.get('crashed') or r['diff']}" for r in rows
           if outcome(r) in ("wrong", "crashed")]
    assert not bad, bad
    assert {r["family"] for r in rows} == set(names)  # every family asked for has its rows
    for r in rows:
        if "refused" in r:
            assert "\n" not in r["refused"] and len(r["refused"]) > 40, r
    # Most of the zoo runs: a regression that refuses (or skips) everything fails here.
    assert counts["exact"] >= 0.4 * len(rows), dict(counts)
