"""Workers for tests/test_hf_gpt2_tp.py: GPT-2 (transformers' Conv1D, its fused c_attn) under tensor parallelism.

Each worker runs several cases in one start-up of its processes (2 cores: start-up is most of a test's time).
Training is tests/_hf_layouts.py's ``train`` (float64, 5 AdamW steps, accumulation 2, clipping at 0.5).
"""

from __future__ import annotations

import shutil

import torch
import torch.distributed as tdist
from torch import nn

import multigpu as mg

import _hf_layouts as hf


def sharding(dist) -> dict:
    """GPT-2 under TP 2, before training: each module's placements, this rank's c_attn shard against
    [q_r, k_r, v_r] of the full weight, full_tensor() against the full weights, the attention's split_size."""
    from torch.distributed.tensor import DTensor

    model = hf.build("gpt2")
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mg.parallelize(model, mg.parallel.Layout(tp=2), verbose=False)
    attn, mlp = model.transformer.h[0].attn, model.transformer.h[0].mlp
    r, e = dist.rank, attn.embed_dim
    w = full["transformer.h.0.attn.c_attn.weight"]  # (E, 3E): q | k | v along dim 1
    half = e // 2
    expect = torch.cat([w[:, p * e + r * half: p * e + (r + 1) * half] for p in range(3)], dim=1)
    placements = {name: [str(p) for p in param.placements] for name, param in model.named_parameters()
                  if isinstance(param, DTensor) and name.startswith("transformer.h.0.")}
    state = model.state_dict()
    return {
        "placements": placements,
        "local_c_attn": (attn.c_attn.weight.to_local() - expect).abs().max().item(),
        "local_shape": tuple(attn.c_attn.weight.to_local().shape),
        "full": max((hf.full(state[k]) - v).abs().max().item() for k, v in full.items()),
        "split_size": (attn.split_size, model.transformer.h[1].attn.split_size),
        "nf": (attn.c_attn.nf, mlp.c_fc.nf),  # the one-process widths: only the forward was replaced
        "plain": sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))[:3],
    }


def gqa_gpt2() -> nn.Module:
    """GPT-2 whose fused c_attn holds q (E) and k, v of half the width (grouped-query): 3 unequal parts."""
    from transformers.pytorch_utils import Conv1D

    model = hf.build("gpt2")
    e = model.config.n_embd
    for block in model.transformer.h:
        block.attn.c_attn = Conv1D(e + 2 * (e // 2), e).double()
    return model


class _FusedAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)


class _FusedBlock(hf.Block):
    """The plain block with its q, k, v Linears fused into one nn.Linear qkv (as nanoGPT's c_attn is)."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__(dim, n_head)
        self.attn = _FusedAttention(dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p.reshape(b, t, -1, self.head_dim).transpose(1, 2) for p in self.attn.qkv(self.ln1(x)).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.attn.o(a)
        return x + self.mlp.down(nn.functional.gelu(self.mlp.up(self.ln2(x))))


def fused_linear_model() -> nn.Module:
    """The plain block model with fused q, k, v (``_FusedBlock``): the probe batch runs through it."""
    model = hf.build("own")
    model.blocks = nn.ModuleList(_FusedBlock(32, 4) for _ in model.blocks).double()
    return model


def refusal(dist, kind: str, layout: dict, overrides: dict | None = None, **kwargs) -> str:
    builders = {"gpt2_gqa": gqa_gpt2, "fused_linear": fused_linear_model}
    model = builders[kind]() if kind in builders else hf.build(kind, **(overrides or {}))
    try:
        mg.parallelize(model, mg.parallel.Layout(**layout), verbose=False, **kwargs)
    except mg.UsageError as e:
        return str(e)
    return "accepted"


REFUSALS = [
    dict(kind="gpt2", layout={"tp": 2}, overrides={"n_embd": 48, "n_head": 3}),
    dict(kind="gpt2_gqa", layout={"tp": 2}),
    dict(kind="fused_linear", layout={"tp": 2}),
    dict(kind="gpt2", layout={"tp": 2}, overrides={"n_inner": 65}),
    dict(kind="gpt2", layout={"tp": 2}, tp_plan={"transformer.h.*.mlp.c_fc": "colwise",
                                                 "transformer.h.*.mlp.c_proj": "rowwise"}),
]


def two_ranks(dist, ckpt: str, copy: str) -> dict:
    """On 2 ranks: the sharding, TP 2 trained, a TP 2 checkpoint (steps 0-2) resumed under FSDP 2 and
    under TP 2 again (kept as it was after step 2 in ``copy`` for a one-process resume), and the refusals."""
    out = {"sharding": sharding(dist), "tp": hf.train(dist, "gpt2", {"tp": 2})}
    hf.train(dist, "gpt2", {"tp": 2}, ckpt=ckpt, stop_after=2)
    tdist.barrier()
    if dist.rank == 0:
        shutil.copytree(ckpt, copy)
        shutil.copytree(ckpt, ckpt + "-tp")
    tdist.barrier()
    out["resumed_fsdp"] = hf.train(dist, "gpt2", {}, ckpt=ckpt)
    out["resumed_tp"] = hf.train(dist, "gpt2", {"tp": 2}, ckpt=ckpt + "-tp")
    out["refusals"] = [refusal(dist, **case) for case in REFUSALS]
    return out


def one_process(dist, copy: str) -> dict:
    """One process: the reference run, and the TP 2 checkpoint of ``two_ranks`` resumed here."""
    return {"reference": hf.train(dist, "gpt2", {}), "resumed": hf.train(dist, "gpt2", {}, ckpt=copy)}


def four_ranks(dist, ckpt: str) -> dict:
    """FSDP 2 x TP 2 on a 2-D mesh (FSDP over the TP DTensors, the c_attn weight's _StridedShard among them),
    trained; then steps 0-2 under it saved and resumed under TP 4 (one head per rank)."""
    out = {"fsdp_tp": hf.train(dist, "gpt2", {"dp_shard": 2, "tp": 2})}
    hf.train(dist, "gpt2", {"dp_shard": 2, "tp": 2}, ckpt=ckpt, stop_after=2)
    out["resumed_tp4"] = hf.train(dist, "gpt2", {"tp": 4}, ckpt=ckpt)
    return out
