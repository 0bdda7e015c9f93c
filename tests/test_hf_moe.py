"""Mixtures of experts under tensor and pipeline parallelism, by what each model declares, equal one process.

Until expert parallelism exists, the entries of a declared TP plan for the experts (transformers' fused
expert weights, ``mlp.experts.gate_up_proj`` / ``down_proj``, styled ``packed_colwise`` and
``moe_tp_experts``) are left out, said in mg.parallelize's line, and the experts stay whole on every TP
rank: they compute on the replicated hidden states each rank holds after the attention's row-wise
projection, as one process does; attention (and Qwen2-MoE's dense parts where present) are sharded as
declared. Under PP each stage runs the model's own forward (OLMoE declares a plan of its head only: its
split is found). Mixtral, Qwen2-MoE (a shared expert), Qwen3-MoE (per-head q/k norms) and OLMoE, 4
experts with 2 per token, float64, 5 AdamW steps with clipping at 0.5: every parameter within 1e-9 of
one process's.
"""

import pytest

from multigpu.testing import spawn

import _hf_layouts as hf

TOL = 1e-9
KINDS = list(hf.MOE)

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install multigpu[hf])")


@pytest.fixture(scope="module")
def reference():
    return dict(zip(KINDS, spawn(hf.train_any, 1, [(k, {}) for k in KINDS], timeout=240)[0]))


def _check(jobs, out, reference) -> None:
    for j, (kind, layout) in enumerate(jobs):
        ref = reference[kind]
        diff = max(hf.max_diff(rank[j], ref) for rank in out)
        print(f"{kind} {layout}: max parameter difference from one process {diff:.1e}")
        assert diff < TOL, (kind, layout, diff)
        assert out[0][j]["norms"] == pytest.approx(ref["norms"], rel=1e-9), (kind, layout)


def test_moe_models_under_tp_2_with_the_experts_whole_and_under_pp_2_equal_one_process(reference):
    jobs = [(k, {"tp": 2}) for k in KINDS] + [(k, {"pp": 2}) for k in KINDS]
    out = spawn(hf.train_any, 2, jobs, timeout=400)
    _check(jobs, out, reference)


@pytest.mark.slow
def test_moe_models_under_fsdp_2_x_tp_2_equal_one_process(reference):
    jobs = [(k, {"tp": 2}) for k in KINDS]
    _check(jobs, spawn(hf.train_any, 4, jobs, timeout=400), reference)
