"""The FFN of a few tokens on FP8 weights (:mod:`twell.fp8`), fused in one weight-reading kernel.

The CUDA-core GEMV of :mod:`.decode_fused` with e4m3 rows and per-unit scales. One program per
block of ``BU`` units::

    xq[m], sx[m] = x[m] quantised per token                          (see below)
    a[m, u]  = (xq[m] . gq[u]) sx[m] sg[u], rounded to x's dtype    the dense FP8 gate's value
    active   = units that fire for some token                        (the rest are never read again)
    h[m, u]  = relu(a) (x[m] . uq[u]) su[u] sd[u]                    fp32; x itself, not xq
    acc[m]  += sum over active u of h[m, u] dq[u]                    fp32 atomic adds

then ``y = acc`` in x's dtype and the accumulator zeroed by :func:`.decode_fused.launch_write_out`
(a programmatic dependent launch on Hopper). The e4m3 products are exact in fp32, so the gate's
sum differs from ``torch._scaled_mm``'s only by the order of its fp32 additions: its sign, the
active set, can differ only where ``a`` is within rounding of zero.

Where x is quantised: at one token each program does it in registers (it reads x whole anyway),
which costs no launch. From ``FP8_PREQUANT_MIN_M`` tokens inside a CUDA graph capture that work,
repeated by every program for every token, outweighs a launch: :func:`.quantize.quantize_rows_fp8`
runs first, and the weight kernel, a programmatic dependent launch of it on Hopper, loads its gate
rows before it waits for the quantised x. Outside a capture a call of a few tokens is bound by the
host, where the extra launch would cost more than the GPU time it saves, so x is quantised in
registers there.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ._activity import fires as is_active
from ._launch import on_device_of, pdl_ok
from .decode_fused import DecodeScratch, launch_write_out
from .quantize import _round_e4m3, quantize_rows_fp8

__all__ = ["ffn_decode_fp8", "FP8_DECODE_MAX_M", "FP8_DECODE_CONFIG", "FP8_PREQUANT_MIN_M"]

# Tokens per call the kernel takes: its CUDA-core products grow with M (as the bf16 GEMV's, which
# hands over to tensor cores from 6 tokens).
FP8_DECODE_MAX_M = 8
# (units per program, warps). Each program quantises x itself, so fewer, wider programs quantise
# it fewer times: on the H100 (d 2048, f 5632, 29 active units per token, CUDA graphs) the kernel
# and its write-out took 13.9 us at one token with (4, 4) against 16.4 us with one unit per
# program and 2 warps, and 29.7 against 47.0 us at four tokens ((8, 4): 14.4 and 28.6 us).
FP8_DECODE_CONFIG = (4, 4)
# From this many tokens, in a CUDA graph, x is quantised by a kernel of its own first (see the
# module's text). On the H100 (as above, CUDA graphs, L2 flushed; in-register against this, both
# (4, 4)): 19.7 against 17.3 us at two tokens, 29.8 against 22.4 at four, 51.7 against 31.9 at
# eight (dense bf16: 48.6); in a chain of 8 layers without the flush (this with (4, 2) programs,
# within 5% of (4, 4) and (2, 1) above) 16.0 against 13.5, 24.7 against 17.7 and 44.6 against
# 28.9 us per layer (dense bf16 36.5 to 37.2). At one token the extra launch does not pay: 14.5
# against 13.9 us.
FP8_PREQUANT_MIN_M = 2


@triton.jit
def _decode_fp8_kernel(
    x_ptr, stride_xm, xq_ptr, stride_xq, sx_ptr,
    gq_ptr, sg_ptr, uq_ptr, su_ptr, dq_ptr, sd_ptr, stride_w,
    acc_ptr, counts_ptr,
    M, d, f, fmax, eps,
    BM: tl.constexpr, BU: tl.constexpr, D: tl.constexpr, PREQ: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # the write-out may be launched now (it waits for this kernel's end to read acc)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    cols = tl.arange(0, D)
    cmask = cols < d
    w_off = units.to(tl.int64)[:, None] * stride_w + cols[None, :]
    wmask = umask[:, None] & cmask[None, :]
    g = tl.load(gq_ptr + w_off, mask=wmask, other=0.0).to(tl.float32)
    sg = tl.load(sg_ptr + units, mask=umask, other=0.0)
    if PREQ and GDC:  # the quantised x is the kernel before's: wait for it (the gate is in flight)
        tl.extra.cuda.gdc_wait()
    a = tl.zeros([BM, BU], dtype=tl.float32)
    for m in tl.static_range(BM):
        if m < M:
            if PREQ:
                xq = tl.load(xq_ptr + m * stride_xq + cols, mask=cmask, other=0.0).to(tl.float32)
                sx = tl.load(sx_ptr + m)
            else:
                xm = tl.load(x_ptr + m * stride_xm + cols, mask=cmask, other=0.0).to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xm), axis=0), eps) / fmax
                xq = _round_e4m3(tl.minimum(tl.maximum(xm / sx, -fmax), fmax))
            part = tl.sum(g * xq[None, :], axis=1) * sx * sg
            a = tl.where(rows[:, None] == m, part[None, :], a)
    a = a.to(x_ptr.dtype.element_ty).to(tl.float32)  # the dense FP8 gate's rounding (out_dtype x's)
    fires = is_active(a) & (rows < M)[:, None] & umask[None, :]
    per_unit = tl.sum(fires.to(tl.int32), axis=0)
    active = per_unit > 0
    n_active = tl.sum(active.to(tl.int32), axis=0)
    tl.store(counts_ptr + b, n_active)
    if n_active > 0:
        amask = active[:, None] & cmask[None, :]
        u = tl.load(uq_ptr + w_off, mask=amask, other=0.0).to(tl.float32)
        dn = tl.load(dq_ptr + w_off, mask=amask, other=0.0).to(tl.float32)
        scale = tl.load(su_ptr + units, mask=active, other=0.0) * tl.load(sd_ptr + units, mask=active, other=0.0)
        for m in tl.static_range(BM):
            if m < M:
                am = tl.sum(tl.where(rows[:, None] == m, tl.where(fires, a, 0.0), 0.0), axis=0)  # [BU]
                if tl.sum((am != 0).to(tl.int32), axis=0) > 0:
                    xm = tl.load(x_ptr + m * stride_xm + cols, mask=cmask, other=0.0).to(tl.float32)
                    h = am * tl.sum(u * xm[None, :], axis=1) * scale
                    tl.atomic_add(acc_ptr + m * d + cols, tl.sum(h[:, None] * dn, axis=0), mask=cmask, sem="relaxed")


def ffn_decode_fp8(x: torch.Tensor, w, scratch: Optional[DecodeScratch] = None,
                   config: Optional[tuple] = None, prequant: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [M, d], counts)`` of twell's FP8 FFN (see the module's text) for ``x [M, d]`` (fp16,
    bf16 or fp32, ``M <= FP8_DECODE_MAX_M``) and ``w`` a :class:`twell.fp8.Fp8GatedWeights`;
    ``counts [f / BU]`` the active units of each block of units. ``scratch``: a kept zeroed
    accumulator (one launch fewer), as for :func:`.decode_fused.ffn_decode_fused`.
    ``prequant``: x quantised by a kernel of its own first (default: from ``FP8_PREQUANT_MIN_M``
    tokens inside a CUDA graph capture); ``config``: (units per program, warps), by default
    ``FP8_DECODE_CONFIG``."""
    from ..fp8 import E4M3, E4M3_MAX, EPS, Fp8GatedWeights

    if not isinstance(w, Fp8GatedWeights):
        raise TypeError(f"w must be twell.fp8.Fp8GatedWeights, got {type(w).__name__}")
    check_tensor(x, "x", dim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    M, d = x.shape
    f = w.gate.shape[0]
    if M > FP8_DECODE_MAX_M:
        raise ValueError(f"ffn_decode_fp8 takes at most {FP8_DECODE_MAX_M} tokens per call, got {M}")
    rows = (w.gate.q, w.up.q, w.down_t.q)
    if any(t.dtype != E4M3 or tuple(t.shape) != (f, d) or t.stride() != (d, 1) or t.device != x.device for t in rows):
        raise ValueError(f"the FP8 rows must be contiguous [{f}, {d}] {E4M3} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if prequant is None:
        prequant = M >= FP8_PREQUANT_MIN_M and x.is_cuda and torch.cuda.is_current_stream_capturing()
    BU, nw = config if config is not None else FP8_DECODE_CONFIG
    NB = triton.cdiv(f, BU)
    counts = torch.empty(NB, dtype=torch.int32, device=x.device)
    if M == 0 or f == 0:
        return torch.zeros(M, d, dtype=x.dtype, device=x.device), counts
    if scratch is not None and (M > scratch.acc.shape[0] or scratch.acc.shape[1] != d):
        scratch = None
    acc = scratch.acc if scratch is not None else torch.zeros(M, d, dtype=torch.float32, device=x.device)
    gdc = pdl_ok(x)
    D = triton.next_power_of_2(max(d, 1))
    with on_device_of(x):
        if prequant:
            xq, sx = quantize_rows_fp8(x, dependent_launch=gdc)
        else:
            xq, sx = x, acc  # (not read)
        _decode_fp8_kernel[(NB,)](
            x, x.stride(0), xq, xq.stride(0), sx, w.gate.q, w.gate.scale, w.up.q, w.up.scale, w.down_t.q, w.down_t.scale, d,
            acc, counts, M, d, f, E4M3_MAX, EPS,
            BM=triton.next_power_of_2(max(M, 1)), BU=BU, D=D, PREQ=prequant, GDC=gdc, num_warps=nw,
            launch_pdl=gdc and prequant,
        )
        try:
            y = launch_write_out(acc, M, x.dtype, gdc)
        except BaseException:
            if scratch is not None:
                acc.zero_()
            raise
    return y, counts
