"""FLOPs per sample (counted by PyTorch) and the peak FLOP/s of common GPUs, for MFU.

MFU = achieved model FLOP/s / (peak FLOP/s per GPU x GPUs) (PaLM, Chowdhery et
al. 2022). The peaks are the vendors' dense datasheet figures (no 2:4 sparsity)
of gpus.json, the table the forecast reads too; "tf32" is the fp32 matmul rate
with TF32 tensor cores on.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import UsageError
from ..runtime.values import TRAINING_DTYPES, dtype_name
from .gpus import by_device_name

def dtype_key(dtype: str | torch.dtype | None) -> str:
    """'bf16' | 'fp16' | 'tf32' | 'fp32' | 'fp8' (``mg.Precision("fp8").name``); None -> fp32, or tf32 when TF32
    matmuls are on."""
    if dtype is None:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    name = dtype if dtype in ("tf32", "fp8") else dtype_name(dtype)
    if name not in (*TRAINING_DTYPES, "tf32", "fp8"):
        raise UsageError(f"dtype {dtype!r} is not one of bf16, fp16, tf32, fp32, fp8; pass the dtype your matmuls "
                         "run in (amp.name)")
    return name


def peak_flops(device_name: str, dtype: str | torch.dtype | None = "bf16") -> float | None:
    """Dense peak FLOP/s of one GPU for ``dtype``; None for an unknown GPU (or the CPU).

    >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    989000000000000.0
    """
    # float8's MFU is against the bf16 peak, as torchtitan reports it (and forecast): the float8 layers' gain
    # shows as a higher MFU, not as a second peak hiding it.
    key = "bf16" if dtype_key(dtype) == "fp8" else dtype_key(dtype)
    row = by_device_name(device_name)
    tflops = row["tflops"].get(key) if row else None
    return None if tflops is None else tflops * 1e12


# A mixture of experts' grouped matmuls, which PyTorch's counter has no formula for (counted by flop_counter).
GROUPED = ("_grouped_mm", "_scaled_grouped_mm")


def flop_counter():
    """``FlopCounterMode`` with what PyTorch's misses: CPU's fused attention, forward and backward, counted as CUDA's
    flash kernel is (PyTorch registers the CUDA kernels only; forecast's fake tensors are CPU tensors too), and
    the grouped matmuls of a mixture of experts (no formula in PyTorch's counter as of torch 2.13). The one FLOP
    counter: the meter's MFU and forecast's counts both use it."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def attention(query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    def grouped(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
        # (rows, in) x (groups, in, out) -> (rows, out), or batched (groups, rows, in) x (groups, in, out): each
        # output element one dot product of length ``in``; (rows, in_total) x (in_total, out) with the groups
        # along ``in`` (a weight gradient) sums groups x (rows, out) products over in_total.
        inner = mat_a.shape[-1]
        if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups along ``in``: (rows, out) per group
            outputs = mat_a.shape[0] * mat_b.shape[-1]
        else:  # one output row per row of mat_a, whatever its groups
            outputs = mat_a.numel() // inner * mat_b.shape[-1]
        return 2 * outputs * inner

    # FlopCounterMode's flag: hands the tensors over as they are
    attention._get_raw = attention_backward._get_raw = grouped._get_raw = True
    aten = torch.ops.aten
    ops = {getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None): attention,
           getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None): attention_backward}
    ops |= {getattr(aten, op, None): grouped for op in GROUPED}
    return FlopCounterMode(display=False, custom_mapping={k: v for k, v in ops.items() if k is not None})


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of everything ``fn()`` runs (forward and backward), by ``flop_counter()``.

    >>> count_flops(lambda: model(x).sum().backward())
    """
    with flop_counter() as counter:
        fn()
    return int(counter.get_total_flops())


class FlopCount:
    """Counts FLOPs between ``start()`` and ``stop()`` (the meter's first step).

    FlopCounterMode is a dispatch mode: entering it at step start and leaving it
    at step end counts the user's forward and backward without touching their code.
    """

    def __init__(self) -> None:
        self._mode = flop_counter()
        self.total: int | None = None

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> int:
        self._mode.__exit__(None, None, None)
        self.total = int(self._mode.get_total_flops())
        return self.total
