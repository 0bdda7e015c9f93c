"""The FLOP counter a forecast counts with: PyTorch's ``FlopCounterMode`` with the kernels it has no formula for."""

from __future__ import annotations

import torch

GROUPED = ("_grouped_mm", "_scaled_grouped_mm")  # a mixture of experts' matmuls (counted by ``grouped`` below)


def flop_counter():
    """FlopCounterMode, with CPU's fused attention counted as CUDA's flash kernel is (PyTorch registers the
    CUDA kernels only; fake tensors here are CPU tensors), and the grouped matmuls of a mixture of experts
    (no formula in PyTorch's counter as of torch 2.13)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def attention(query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def grouped(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
        # (rows, in) x (groups, in, out) -> (rows, out), or batched (groups, rows, in) x (groups, in, out): each
        # output element one dot product of length ``in``; (rows, in_total) x (in_total, out) with the groups
        # along ``in`` (a weight gradient) sums groups x (rows, out) products over in_total.
        inner = mat_a.shape[-1]
        outputs = mat_a.shape[0] * mat_b.shape[-1] if mat_b.dim() == 2 else mat_a.numel() // inner * mat_b.shape[-1]
        return 2 * outputs * inner

    attention._get_raw = grouped._get_raw = True  # FlopCounterMode's flag: hands the tensors over as they are
    ops = {getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None): attention}
    ops |= {getattr(torch.ops.aten, op, None): grouped for op in GROUPED}
    return FlopCounterMode(display=False, custom_mapping={k: v for k, v in ops.items() if k is not None})
