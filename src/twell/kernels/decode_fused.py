"""The FFN of a small batch (up to 16 tokens) with gate, up and down fused in one Triton kernel.

:mod:`twell.kernels.decode` takes three launches (cuBLAS gate, up kernel, down kernel), and on
the H200 each small launch costs a fixed 8 to 14 us after an L2 flush, more than its bytes: at
M = 1, k = 29 the three sum to 26.8 us against a 5.4 us byte floor (benchmarks/NOTES_decode.md).
Here one program per block of ``BU`` units does all of it::

    a[m, u]  = x[m] . w_first[u]                       the block's gate rows, read whole
    active   = units with a > 0 for some token           (the rest are never read again)
    h[m, u]  = relu(a) * (x[m] . w_up[u])  for active u  (non-gated: relu(a))
    acc[m]  += sum over active u of h[m, u] w_down_t[u]  fp32 atomic adds into a zeroed buffer

and ``y = acc`` rounded to x's dtype by PyTorch after the kernel. So a call is three launches
(the buffer's memset, the kernel, the cast), of which only the kernel reads weights. Kernel
boundaries order the atomic adds before the cast: a first design had the last program to finish
(an atomic ticket) write y and zero a persistent buffer, in one launch; on the H200 in bf16 it
returned wrong sums at M = 1 and 4 (an ordering bug the interpreter cannot show), so the
write-out is its own launch here.

The gate and up values are rounded to x's dtype before use, as the dense path's products are;
the down sums run in fp32 in whatever order the programs finish (exact up to rounding, not
bit-reproducible). Every program also writes its block's number of active units (the
dispatcher's sparsity probe) and, when tracking, each unit's firing count and each token's
active units (``row_nnz``, atomic adds across blocks).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device_of
from .decode import _rows_times_units, check_decode_args

__all__ = ["ffn_decode_fused", "decode_fused_launch", "fused_config", "DecodeScratch", "FUSED_MAX_M", "FUSED_CONFIG"]

FUSED_MAX_M = 16  # tokens per call: one tensor-core tile of rows


@triton.jit
def _decode_fused_kernel(
    x_ptr, stride_xm,
    wf_ptr, stride_wf, wu_ptr, stride_wu, wd_ptr, stride_wd,
    acc_ptr, counts_ptr, uc_ptr, nnz_ptr,
    M, d, f,
    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # the gate: this block's rows of w_first, read whole
    a = _rows_times_units(x_rows, rmask, wf_ptr, stride_wf, units, umask, d, BM, BU, BK, PREC)
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)  # the dense path's rounding of the product
    fires = (a > 0) & rmask[:, None] & umask[None, :]
    fires_i = fires.to(tl.int32)
    per_unit = tl.sum(fires_i, axis=0)
    active = per_unit > 0
    n_active = tl.sum(active.to(tl.int32), axis=0)
    tl.store(counts_ptr + b, n_active)
    if TRACK:
        tl.store(uc_ptr + units, per_unit, mask=umask)
        per_row = tl.sum(fires_i, axis=1)
        tl.atomic_add(nnz_ptr + rows, per_row, mask=rmask & (per_row > 0), sem="relaxed")
    if n_active > 0:
        h = tl.where(fires, a, 0.0)
        if GATED:  # the up rows of the active units only
            u = _rows_times_units(x_rows, rmask, wu_ptr, stride_wu, units, active, d, BM, BU, BK, PREC)
            h = h * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
        hb = h.to(wd_ptr.dtype.element_ty)
        cs = tl.arange(0, BD)
        for d0 in range(0, d, BD):
            cols = d0 + cs
            cmask = cols < d
            w = tl.load(wd_ptr + units.to(tl.int64)[:, None] * stride_wd + cols[None, :], mask=active[:, None] & cmask[None, :], other=0.0)
            part = tl.dot(hb, w, input_precision=PREC)
            # relaxed: nothing reads acc until the next launch (acq_rel would fence every add)
            tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], part, mask=rmask[:, None] & cmask[None, :], sem="relaxed")


@triton.jit
def _write_out_kernel(acc_ptr, y_ptr, stride_ym, M, d, BLOCK: tl.constexpr):
    # y = acc in y's dtype, and acc zeroed for the next call (a DecodeScratch's buffer)
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    v = tl.load(acc_ptr + m * d + cols, mask=mask, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + cols, v.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_ptr + m * d + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


class DecodeScratch:
    """A reusable fp32 accumulator for :func:`decode_fused_launch`: ``[16, d]`` zeros, left
    zeroed by every call (its write-out kernel zeroes what the call used), so a call needs no
    memset launch. One per layer, used by one stream at a time (two streams' calls on one
    scratch would mix their sums). Allocate it outside a CUDA graph capture: a buffer from a
    capture's memory pool is the graph's."""

    def __init__(self, d: int, device) -> None:
        self.acc = torch.zeros(FUSED_MAX_M, d, dtype=torch.float32, device=device)


# BU units per program, BK columns of d per gate/up step, BD columns per down step, warps,
# stages. Per largest M: the fastest in CUDA graphs on the H200
# (benchmarks/decode_fused_probe.py, d 2048, f 5632, bf16, k 8 to 56): 16-unit blocks at M = 1
# (25.1 to 26.9 us), 64-unit blocks with 8 warps from M = 4 (30.2 to 34.6 us; fewer atomic adds).
# Adds over all 16 buffer rows (no row mask) were slower (27.8 to 36.5 us) and were dropped.
FUSED_CONFIGS = {2: (16, 256, 256, 4, 3), 16: (64, 256, 256, 8, 3)}
FUSED_CONFIG = FUSED_CONFIGS[16]


def fused_config(M: int) -> tuple:
    """Block shapes used for a call of ``M`` tokens."""
    for m in sorted(FUSED_CONFIGS):
        if M <= m:
            return FUSED_CONFIGS[m]
    return FUSED_CONFIG


def decode_fused_launch(x, w_first, w_down_t, w_up=None, unit_counts=None, row_nnz=None, *, config=None,
                        scratch: Optional[DecodeScratch] = None):
    """:func:`ffn_decode_fused` without the argument checks, for callers that validated them.

    Returns ``(y, counts, M)``: ``counts [NB]`` int32, the active units of each block of units
    (the batch is one chunk of M tokens). ``unit_counts [f]`` is overwritten, ``row_nnz [M]``
    added to (pass zeros). With a ``scratch`` (for x's d and device) the call is two launches
    (the fused kernel, then one that writes y and zeroes the scratch); without, three (a zeroed
    buffer, the kernel, PyTorch's cast)."""
    M, d = x.shape
    f = w_first.shape[0]
    if M == 0 or d == 0 or f == 0:
        return torch.zeros(M, d, dtype=x.dtype, device=x.device), torch.zeros(0, dtype=torch.int32, device=x.device), max(M, 1)
    BU, BK, BD, nw, ns = config or fused_config(M)
    NB = triton.cdiv(f, BU)
    acc = scratch.acc if scratch is not None else torch.zeros(M, d, dtype=torch.float32, device=x.device)
    counts = torch.empty(NB, dtype=torch.int32, device=x.device)
    track = unit_counts is not None
    w_up_ = w_up if w_up is not None else w_first
    with on_device_of(x):
        _decode_fused_kernel[(NB,)](
            x, x.stride(0), w_first, w_first.stride(0), w_up_, w_up_.stride(0), w_down_t, w_down_t.stride(0),
            acc, counts, unit_counts if track else counts, row_nnz if track else counts,
            M, d, f,
            BM=FUSED_MAX_M, BU=BU, BK=min(BK, max(16, triton.next_power_of_2(d))), BD=min(BD, max(16, triton.next_power_of_2(d))),
            GATED=w_up is not None, TRACK=track, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=nw, num_stages=ns,
        )
        if scratch is not None:
            y = torch.empty(M, d, dtype=x.dtype, device=x.device)
            WB = min(1024, triton.next_power_of_2(d))
            _write_out_kernel[(triton.cdiv(d, WB), M)](acc, y, y.stride(0), M, d, BLOCK=WB, num_warps=4)
            return y, counts, M
    return acc[:M].to(x.dtype), counts, M


def ffn_decode_fused(
    x: torch.Tensor,
    w_first: torch.Tensor,
    w_down_t: torch.Tensor,
    *,
    w_up: Optional[torch.Tensor] = None,
    unit_counts: Optional[torch.Tensor] = None,
    row_nnz: Optional[torch.Tensor] = None,
    config: Optional[tuple] = None,
    scratch: Optional[DecodeScratch] = None,
) -> torch.Tensor:
    """The whole FFN of at most 16 tokens with one weight-reading kernel (see the module's text).

    Args:
        x: ``[M, d]`` tokens, ``M <= 16`` (fp16, bf16 or fp32; unit-stride rows).
        w_first: ``[f, d]`` gate (gated) or up (non-gated) rows; w_down_t: ``[f, d]``, row ``j`` =
            ``w_down[:, j]``; w_up: ``[f, d]`` for the gated MLP, None for the non-gated one.
        unit_counts: optional ``[f]`` int32, overwritten with the tokens each unit fired for;
            row_nnz: optional ``[M]`` int32 zeros, given the active units of each token (both
            or neither).
        config: ``(BU, BK, BD, num_warps, num_stages)``.
        scratch: a :class:`DecodeScratch` (zeroed accumulator kept between calls: one launch
            fewer); None: a fresh buffer per call.

    Returns:
        ``y [M, d]`` in x's dtype.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    if M > FUSED_MAX_M:
        raise ValueError(f"the fused decode kernel takes at most {FUSED_MAX_M} tokens per call, got {M}")
    if (unit_counts is None) != (row_nnz is None):
        raise ValueError("pass both unit_counts and row_nnz, or neither")
    if unit_counts is not None:
        for t, name, n in ((unit_counts, "unit_counts", f), (row_nnz, "row_nnz", M)):
            if t.dtype != torch.int32 or t.shape != (n,) or t.device != x.device or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [{n}] int32 tensor on {x.device}, got "
                                 f"{list(t.shape)} {t.dtype} on {t.device}")
    if scratch is not None and (scratch.acc.shape != (FUSED_MAX_M, d) or scratch.acc.device != x.device):
        raise ValueError(f"scratch must be a DecodeScratch for d = {d} on {x.device}, got {list(scratch.acc.shape)} on {scratch.acc.device}")
    return decode_fused_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, config=config, scratch=scratch)[0]
