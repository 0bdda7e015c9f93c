"""The model zoo: every causal-LM family of the installed transformers, exact or refused, never different.

The families come from transformers itself (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, tests/_zoo.py), each
built from a tiny config in float64 and trained 5 AdamW steps (clipping at 0.5) under TP 2, TP 2 + SP,
PP 2, EP 2 (2 ranks), FSDP 2 x TP 2 and EP 2 + TP 2 (4 ranks), against one process (a dense family's EP
refusal, "no experts module", is not run again on 4 ranks); BERT, RoBERTa, ModernBERT and
DistilBERT with a per-token head, and ViT, under the same layouts but PP: within 1e-9 on every parameter (or 1000
times the family's own floor where it computes parts in float32: see _zoo.FLOOR_FACTOR), or refused by
``mg.UsageError`` in one line. Anything else is a crash, and the test fails on any wrong figure or crash.
A family that cannot be built tiny is skipped with its reason. Each cell's outcome (exact, refused,
skipped) must be the one recorded for this transformers release in tests/zoo_expected.json
(MULTIGPU_ZOO_EXPECT=write MULTIGPU_ZOO=all records a new release's): a family that was exact and is
now refused is a regression. The table goes to the test's output, and
to a file with MULTIGPU_ZOO_TABLE=docs/zoo.md.
"""

import collections
import json
import os
import pathlib

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[hf])")

import _zoo  # noqa: E402

# CI runs every family transformers lists (about 12 of CI's minutes on 2 cores: docs/zoo.md): a sample let
# a regression in the families outside it land unseen. MULTIGPU_ZOO=gpt2,gemma2 runs those (and the encoders),
# for your own loop.
def zoo_families() -> list[str]:
    names = list(_zoo.families())
    if os.environ.get("MULTIGPU_ZOO") and os.environ["MULTIGPU_ZOO"] != "all":
        return os.environ["MULTIGPU_ZOO"].split(",")
    return names


EXPECTED = pathlib.Path(__file__).with_name("zoo_expected.json")  # each cell's outcome, per transformers release
TWO = [label for label, world in _zoo.WORLD.items() if world == 2]
FOUR = [label for label, world in _zoo.WORLD.items() if world == 4]


def outcome(row: dict) -> str:
    if "diff" in row:
        return "wrong" if row["diff"] > row["tolerance"] else "exact"
    return next(k for k in ("refused", "skipped", "crashed") if k in row)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # every family: about 12 minutes on 2 cores
def test_every_causal_lm_family_is_exact_or_refused_under_every_layout(tmp_path):
    names = zoo_families() + _zoo.ENCODERS
    jobs = [(n, label) for n in names for label in (_zoo.ENCODER_LAYOUTS if n in _zoo.ENCODERS else _zoo.LAYOUTS)]
    rows = _zoo.zoo(2, [job for job in jobs if job[1] in TWO], str(tmp_path / "two.jsonl"))
    skipped = {r["family"] for r in rows if "skipped" in r}
    dense = {r["family"]: r for r in rows if r["layout"] == "EP 2" and _zoo.NO_EXPERTS in r.get("refused", "")}
    four = [job for job in jobs if job[1] in FOUR and job[0] not in skipped]
    rows += _zoo.zoo(4, [job for job in four if not (job[0] in dense and job[1].startswith("EP"))],
                     str(tmp_path / "four.jsonl"))
    rows += [dict(dense[f], layout=label) for f, label in four if f in dense and label.startswith("EP")]
    table = _zoo.table(rows)
    print(table)
    if os.environ.get("MULTIGPU_ZOO_TABLE"):
        with open(os.environ["MULTIGPU_ZOO_TABLE"], "w") as f:
            f.write(table)
    counts = collections.Counter(outcome(r) for r in rows)
    print(dict(counts))
    got = {f"{r['family']} | {r['layout']}": outcome(r) for r in rows}
    if os.environ.get("MULTIGPU_ZOO_EXPECT") == "write":  # recording the zoo of a new transformers release
        old = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
        kept = old.get("outcomes", {}) if old.get("transformers") == _zoo.transformers_version() else {}
        EXPECTED.write_text(json.dumps({"transformers": _zoo.transformers_version(), "outcomes": kept | got},
                                       indent=0, sort_keys=True) + "\n")
    expected = json.loads(EXPECTED.read_text())
    if expected["transformers"] == _zoo.transformers_version():
        # A cell that was exact and is now refused (or skipped) is a regression too, and so is a new refusal
        # from a planted bug that the probe catches before it becomes a wrong figure.
        changed = [f"{k}: {expected['outcomes'][k]} -> {v}" for k, v in got.items()
                   if k in expected["outcomes"] and expected["outcomes"][k] != v]
        assert not changed, changed
    bad = [f"{r['family']} {r['layout']}: {r.get('crashed') or r['diff']}" for r in rows
           if outcome(r) in ("wrong", "crashed")]
    assert not bad, bad
    assert {r["family"] for r in rows} == set(names)  # every family asked for has its rows
    for r in rows:
        if "refused" in r:
            assert "\n" not in r["refused"] and len(r["refused"]) > 40, r
    # Most of the zoo runs: a regression that refuses (or skips) everything fails here.
    assert counts["exact"] >= 0.4 * len(rows), dict(counts)
