"""Per-row FP8 quantisation of activations in one pass: ``x [M, d]`` -> e4m3 ``q [M, d]`` and one
float32 scale per row, ``scale[m] = max(max_c |x[m, c]|, EPS) / 448``, ``q = x / scale`` rounded
to nearest e4m3 (:func:`twell.fp8.quantize_tokens` is the reference, bit for bit).

PyTorch's ops make five passes over ``[M, d]`` (a float32 copy, abs, max, divide, cast); here each
program reads its rows once into registers and writes them once, as the dense FP8 baseline's
activation cast is written in torchao (compiled) and vLLM (a CUDA kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_tensor
from ._launch import on_device_of, pdl_ok

__all__ = ["quantize_rows_fp8"]

# rows per program and warps, for a [BM, next_pow2(d)] block of about 8K values
QUANT_WARPS = 4


@triton.jit
def _round_e4m3(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32:
    the step at v's binade is 2^(e - 3) (3 mantissa bits; the subnormal step 2^-9 below 2^-6), and
    adding then subtracting 1.5 * 2^23 steps rounds to a multiple of it in the float32 unit. The
    cast to e4m3 that follows is then exact on every converter (the Triton interpreter rounds
    some values that straddle a power of two wrongly; the GPU's cvt does not)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    c = step * 12582912.0
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_rows_kernel(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, M, d, eps, fmax,
                          BM: tl.constexpr, D: tl.constexpr, GDC: tl.constexpr = False):
    if GDC:  # the kernel reading q may be launched now (it waits for this one's end to read it)
        tl.extra.cuda.gdc_launch_dependents()
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, D)
    mask = (rows < M)[:, None] & (cols < d)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fmax
    q = _round_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -fmax), fmax))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < M)


def quantize_rows_fp8(x: torch.Tensor, dependent_launch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, d] float8_e4m3fn, scale [M] float32)`` of ``x [M, d]`` (fp16, bf16 or fp32, rows
    of unit stride), one scale per row (see the module's text). ``dependent_launch`` (Hopper,
    :func:`._launch.pdl_ok`): the kernel lets the next one, launched as a programmatic dependent
    launch, start before it ends."""
    from ..fp8 import E4M3, E4M3_MAX, EPS

    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    M, d = x.shape
    q = torch.empty(M, d, dtype=E4M3, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    D = triton.next_power_of_2(max(d, 1))
    # rows per program: up to 64, no more than the call has (a decode call of 2 tokens is one
    # program of 2 rows, not of 4 masked ones), about 8192 elements at most
    BM = max(1, min(64, triton.next_power_of_2(M), 8192 // D))
    with on_device_of(x):
        _quantize_rows_kernel[(triton.cdiv(M, BM),)](x, x.stride(0), q, q.stride(0), scale, M, d, EPS, E4M3_MAX, BM=BM,
                                                      D=D, GDC=dependent_launch and pdl_ok(x), num_warps=QUANT_WARPS)
    return q, scale
