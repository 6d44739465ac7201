"""The FFN of a small batch (up to 64 tokens) with gate, up and down fused in one Triton kernel.

:mod:`twell.kernels.decode` takes three launches (cuBLAS gate, up kernel, down kernel), and on
the H200 each small launch costs a fixed 8 to 14 us after an L2 flush, more than its bytes: at
M = 1, k = 29 the three sum to 26.8 us against a 5.4 us byte floor.
Here one program per block of ``BU`` units does all of it::

    a[m, u]  = x[m] . w_first[u]                       the block's gate rows, read whole
    active   = units that fire (a > 0 or NaN) for some token  (the rest are never read again)
    h[m, u]  = relu(a) * (x[m] . w_up[u])  for active u  (non-gated: relu(a))
    acc[m]  += sum over active u of h[m, u] w_down_t[u]  fp32 atomic adds into a zeroed buffer
                                                          (rows m with an active unit in the block)

and ``y = acc`` rounded to x's dtype after the kernel by ``_write_out_kernel``, which also
zeroes the accumulator for the next call: with a kept one (a :class:`DecodeScratch`: 16 rows,
or 64 where :mod:`twell.inference.dispatch` shares it with the split kernels) two launches per call, else
three (a fresh buffer's zero fill first). Only
the first kernel reads weights. The adds are ordered before the write-out by the kernel
boundary: on Hopper the write-out is a programmatic dependent launch that starts early and waits
(``griddepcontrol.wait``) until the kernel has completed and its writes are visible. A first
design had the last program to finish (an atomic ticket) write y and zero the buffer, in one
launch; on the H200 in bf16 it returned wrong sums at M = 1 and 4 (an ordering bug the
interpreter cannot show), so the write-out is its own launch here.

Up to ``GEMV_MAX_M`` tokens the same fused FFN runs as a CUDA-core GEMV instead
(``_decode_gemv_kernel``): the tensor-core kernel walks d in dependent steps per program and
read the gate at about 1 TB/s at one token (from 6 tokens its gate costs what any gate product
does, about 13.5 us, and its up and down phases 5 to 6 us each), while a
program of a few units that loads its whole ``[BU, d]`` gate rows at once issues every load of
the call in one wave (hundreds of programs resident at a time), so the gate is bound by HBM
bandwidth rather than by a chain of loads. Its FMA count grows with M: a few tokens only.

The gate and up values are rounded to x's dtype before use, as the dense path's products are;
the down sums run in fp32 in whatever order the programs finish (exact up to rounding, not
bit-reproducible). Every program also writes its block's number of active units (the
dispatcher's sparsity probe) and, when tracking, each unit's firing count and each token's
active units (``row_nnz``, atomic adds across blocks).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from ._activity import fires as is_active
from ._dot import dot_operand, dot_precision
from ._launch import on_device_of, pdl_ok
from ..checks import check_config
from .decode import _rows_times_units, check_decode_args, check_stat_buffers

__all__ = ["ffn_decode_fused", "decode_fused_launch", "fused_config", "DecodeScratch", "GemvConfig", "FUSED_MAX_M",
           "FUSED_CONFIG", "GEMV_MAX_M"]

FUSED_MAX_M = 64  # tokens per call (tiles of 16, 32 or 64 token rows)
SCRATCH_ROWS = 16  # rows of a DecodeScratch: larger calls take a fresh zeroed buffer


@triton.jit
def _block_activity(a, rows, rmask, units, umask, b, counts_ptr, uc_ptr, nnz_ptr, TRACK: tl.constexpr):
    """From the block's rounded gate ``a [BM, BU]``: ``fires`` (a > 0 or NaN, on valid rows and units),
    ``active [BU]`` (fires for some token), their number (stored as the block's count: the
    dispatcher's probe) and ``per_row [BM]`` (each token's active units in the block); when
    tracking, each unit's firing count (overwritten) and each token's (added across blocks)."""
    fires = is_active(a) & rmask[:, None] & umask[None, :]
    fires_i = fires.to(tl.int32)
    per_unit = tl.sum(fires_i, axis=0)
    active = per_unit > 0
    n_active = tl.sum(active.to(tl.int32), axis=0)
    tl.store(counts_ptr + b, n_active)
    per_row = tl.sum(fires_i, axis=1)
    if TRACK:
        tl.store(uc_ptr + units, per_unit, mask=umask)
        tl.atomic_add(nnz_ptr + rows, per_row, mask=rmask & (per_row > 0), sem="relaxed")
    return fires, active, n_active, per_row


@triton.jit
def _decode_fused_kernel(
    x_ptr, stride_xm,
    wf_ptr, stride_wf, wu_ptr, stride_wu, wd_ptr, stride_wd,
    acc_ptr, counts_ptr, uc_ptr, nnz_ptr,
    M, d, f,
    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # as in _decode_gemv_kernel
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # the gate: this block's rows of w_first, read whole
    a = _rows_times_units(x_rows, rmask, wf_ptr, stride_wf, units, umask, d, BM, BU, BK, PREC)
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)  # the dense path's rounding of the product
    fires, active, n_active, per_row = _block_activity(a, rows, rmask, units, umask, b, counts_ptr, uc_ptr, nnz_ptr, TRACK)
    if n_active > 0:
        _up_down_block(tl.where(fires, a, 0.0), x_rows, rmask, rows, units, active, per_row, wu_ptr, stride_wu, wd_ptr,
                       stride_wd, acc_ptr, d, BM, BU, BK, BD, GATED, PREC)


@triton.jit
def _up_down_block(h, x_rows, rmask, rows, units, active, per_row, wu_ptr, stride_wu, wd_ptr, stride_wd, acc_ptr, d,
                   BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr,
                   PREC: tl.constexpr):
    """A block's up and down on tensor cores: ``h [BM, BU]`` (relu(a) where the unit fires for
    the token, else 0) times the up rows of the ``active`` units (gated), rounded, then
    ``acc[rows] += h w_down_t[units]`` (fp32 atomic adds, only rows with ``per_row > 0``).
    Also the overflow path of :mod:`twell.kernels.decode_split`'s gate."""
    if GATED:  # the up rows of the active units only
        u = _rows_times_units(x_rows, rmask, wu_ptr, stride_wu, units, active, d, BM, BU, BK, PREC)
        h = h * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
    hb = h.to(wd_ptr.dtype.element_ty)
    cs = tl.arange(0, BD)
    for d0 in range(0, d, BD):
        cols = d0 + cs
        cmask = cols < d
        w = tl.load(wd_ptr + units.to(tl.int64)[:, None] * stride_wd + cols[None, :], mask=active[:, None] & cmask[None, :], other=0.0)
        part = tl.dot(dot_operand(hb, PREC), dot_operand(w, PREC), input_precision=PREC)
        # only the rows with an active unit in this block add (the others' part is 0: at k 29
        # and 16 tokens about 3 rows in 4 of a 64-unit block); relaxed: nothing reads acc
        # until the next launch (acq_rel would fence every add)
        tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], part, mask=(per_row > 0)[:, None] & cmask[None, :], sem="relaxed")


@triton.jit
def _write_out_block(acc_ptr, y_ptr, stride_ym, d, BLOCK: tl.constexpr, GDC: tl.constexpr):
    # y = acc in y's dtype, and acc zeroed for the next call (a kept buffer), BLOCK columns of row
    # program_id(1) per program. With GDC (launched as a programmatic dependent launch) it may
    # start before the kernel that fills acc ends: the wait returns once that kernel has
    # completed and its writes are visible.
    if GDC:
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    v = tl.load(acc_ptr + m * d + cols, mask=mask, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + cols, v.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_ptr + m * d + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


@triton.jit
def _write_out_kernel(acc_ptr, y_ptr, stride_ym, M, d, BLOCK: tl.constexpr, GDC: tl.constexpr):
    _write_out_block(acc_ptr, y_ptr, stride_ym, d, BLOCK, GDC)


@triton.jit
def _write_out_reset_kernel(acc_ptr, y_ptr, stride_ym, count_ptr, M, d, BLOCK: tl.constexpr, GDC: tl.constexpr):
    # the same, and twell.kernels.decode_split's list emptied: its length (count_ptr[0]) kept in
    # count_ptr[1] as the call's number of fires, then set to 0
    _write_out_block(acc_ptr, y_ptr, stride_ym, d, BLOCK, GDC)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(count_ptr + 1, tl.load(count_ptr))
        tl.store(count_ptr, 0)


def launch_write_out(acc: torch.Tensor, M: int, dtype: torch.dtype, gdc: bool, count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [M, d]`` in ``dtype`` from the first M rows of the fp32 accumulator ``acc [*, d]``,
    which is left zeroed (and ``count [2]``, when given, emptied: ``count[1] = count[0]``,
    ``count[0] = 0``: :class:`twell.kernels.decode_split.SplitScratch`'s list length kept as the
    call's fires), in one launch: a programmatic dependent launch of the kernel before it when
    ``gdc``."""
    d = acc.shape[1]
    y = torch.empty(M, d, dtype=dtype, device=acc.device)
    WB = min(1024, triton.next_power_of_2(d))
    grid = (triton.cdiv(d, WB), M)
    if count is None:
        _write_out_kernel[grid](acc, y, y.stride(0), M, d, BLOCK=WB, GDC=gdc, num_warps=4, launch_pdl=gdc)
    else:
        _write_out_reset_kernel[grid](acc, y, y.stride(0), count, M, d, BLOCK=WB, GDC=gdc, num_warps=4, launch_pdl=gdc)
    return y


@triton.jit
def _units_times_rows(x_ptr, stride_xm, M, w_ptr, stride_w, units, wmask, d,
                      BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr):
    """``[BM, BU]`` fp32: x's first M rows times the rows ``units`` of ``w`` (``[f, d]``,
    unit-stride rows) by CUDA-core products, d in steps of BK (one step when BK >= d: every load
    of the block issued at once); rows outside ``wmask`` are never read (they come out 0)."""
    rows = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    w_rows = w_ptr + units.to(tl.int64)[:, None] * stride_w
    out = tl.zeros([BM, BU], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        kmask = kk < d
        w = tl.load(w_rows + kk[None, :], mask=wmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BM):
            if m < M:  # rows past M (BM is M rounded up to a power of two) do nothing
                xm = tl.load(x_ptr + m * stride_xm + kk, mask=kmask, other=0.0).to(tl.float32)
                part = tl.sum(w * xm[None, :], axis=1)
                out = tl.where(rows[:, None] == m, out + part[None, :], out)
    return out


@triton.jit
def _decode_gemv_kernel(
    x_ptr, stride_xm,
    wf_ptr, stride_wf, wu_ptr, stride_wu, wd_ptr, stride_wd,
    acc_ptr, counts_ptr, uc_ptr, nnz_ptr,
    M, d, f,
    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, GDC: tl.constexpr,
):
    # the same steps as _decode_fused_kernel, with CUDA-core products (see the module's text)
    if GDC:  # the write-out may be launched now (it waits for this kernel's end to read acc)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    a = _units_times_rows(x_ptr, stride_xm, M, wf_ptr, stride_wf, units, umask, d, BM, BU, BK)
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)  # the dense path's rounding of the product
    fires, active, n_active, per_row = _block_activity(a, rows, rmask, units, umask, b, counts_ptr, uc_ptr, nnz_ptr, TRACK)
    if n_active > 0:
        h = tl.where(fires, a, 0.0)
        if GATED:  # the up rows of the active units only
            u = _units_times_rows(x_ptr, stride_xm, M, wu_ptr, stride_wu, units, active, d, BM, BU, BK)
            h = h * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
        h = h.to(wd_ptr.dtype.element_ty).to(tl.float32)  # as the fused kernel feeds its dot
        ks = tl.arange(0, BK)
        wd_rows = wd_ptr + units.to(tl.int64)[:, None] * stride_wd
        for k0 in range(0, d, BK):
            kk = k0 + ks
            kmask = kk < d
            w = tl.load(wd_rows + kk[None, :], mask=active[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(BM):
                # only rows with an active unit in this block add (relaxed: see the fused kernel)
                if tl.sum(tl.where(rows == m, per_row, 0), axis=0) > 0:
                    hm = tl.sum(tl.where(rows[:, None] == m, h, 0.0), axis=0)  # row m of h: [BU]
                    part = tl.sum(hm[:, None] * w, axis=0)
                    tl.atomic_add(acc_ptr + m * d + kk, part, mask=kmask, sem="relaxed")


class DecodeScratch:
    """A reusable fp32 accumulator for :func:`decode_fused_launch`: ``[rows, d]`` zeros (16 rows
    unless asked; calls of more tokens make a fresh buffer), left zeroed by every call (its
    write-out kernel zeroes what the call used), so a call needs no memset launch. One can serve
    many layers (:mod:`twell.inference.dispatch` keeps one per device and d), used by one stream at a time
    (two streams' calls on one scratch at once would mix their sums).
    :class:`twell.kernels.decode_split.SplitScratch` can share it. Allocate it outside a CUDA
    graph capture: a buffer from a capture's memory pool is the graph's."""

    def __init__(self, d: int, device, rows: int = SCRATCH_ROWS) -> None:
        # a normal tensor even when made under torch.inference_mode (a serving loop's first call):
        # an inference tensor could not be zeroed in place outside that mode after a failed call
        with torch.inference_mode(False):
            self.acc = torch.zeros(rows, d, dtype=torch.float32, device=device)


# BU units per program, BK columns of d per gate/up step, BD columns per down step, warps,
# stages. Per largest M: the fastest in CUDA graphs on the H200
# (d 2048, f 5632, bf16, k 8 to 56): 16-unit blocks at M = 1
# (25.1 to 26.9 us), 64-unit blocks with 8 warps from M = 4 (30.2 to 34.6 us; fewer atomic adds).
# Adds over all 16 buffer rows (no row mask) were slower (27.8 to 36.5 us) and were dropped.
# With adds only for rows with an active unit in the block (up to 5 tokens the CUDA-core variant
# runs instead): the same 64-unit shape was the fastest of 8 at M = 6 to 16 (28.1 to 29.5 us) except
# k = 8 at 6 and 8 tokens (16-unit blocks: 26.7 against 28.1 us), and of 7 on 32- and 64-row tiles
# at M = 24 to 64 (35.3 to 43.2 us). fp32 inputs on 32- and 64-row tiles take 2 stages: 3 would need
# up to 256 KB of shared memory (more than the H100's 227 KB per block).
FUSED_CONFIGS = {64: (64, 256, 256, 8, 3)}
FUSED_CONFIG = FUSED_CONFIGS[64]


class GemvConfig(NamedTuple):
    """Shape of the CUDA-core variant (``_decode_gemv_kernel``): ``BU`` units per program, d in
    steps of ``BK`` (``BK >= d``: whole rows at once), warps, pipeline stages."""

    BU: int
    BK: int
    num_warps: int
    num_stages: int


# Up to GEMV_MAX_M tokens the CUDA-core variant runs, with the shape for the largest M at most
# each key. Measured (H200, bf16, d 2048, f 5632, k 8 to 56, CUDA graphs,
# kept accumulator): 2 units per program with 2 warps (whole rows at once, 2816 programs) took
# 16.5 / 18.3 / 22.9 / 34.4 us at M = 1 / 2 / 4 / 8 against 24.7 / 27.3 / 28.9 / 29.0 for the
# tensor-core kernel (dense: 40 to 41 us); 4, 8 or 16 units, or d in halves or quarters, were
# slower. Its FMAs grow with M, so the tensor-core kernel wins from about 6 tokens.
# With the write-out as a programmatic dependent launch: one unit per
# program took 14.8 to 15.2 us at M = 1 against 15.9 to 16.1 for two; at M = 5 the CUDA-core
# kernel took 27.1 to 27.8 us, the tensor-core one 28.2 to 28.4, at M = 6 29.5 against 28.1.
GEMV_MAX_M = 5

# What a config may hold (twell.checks.check_config): the tensor-core kernel's tiles at least 16,
# the CUDA-core kernel's units per program from 1.
FUSED_KNOBS = (("BU", 16, 256, True), ("BK", 16, 4096, True), ("BD", 16, 8192, True), ("warps", 1, 32, True),
               ("stages", 1, 8, False))
GEMV_KNOBS = (("BU", 1, 256, True), ("BK", 16, 8192, True), ("warps", 1, 32, True), ("stages", 1, 8, False))
GEMV_CONFIGS = {1: GemvConfig(1, 2048, 2, 1), 5: GemvConfig(2, 2048, 2, 1)}


def fused_config(M: int) -> Union[tuple, GemvConfig]:
    """Block shapes used for a call of ``M`` tokens: a :class:`GemvConfig` up to
    :data:`GEMV_MAX_M` tokens, else the tensor-core kernel's ``(BU, BK, BD, warps, stages)``."""
    if M <= GEMV_MAX_M:
        return GEMV_CONFIGS[min(m for m in GEMV_CONFIGS if m >= M)]
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
    (the fused kernel, then one that writes y and zeroes the scratch); without, three (a zero
    fill of a fresh buffer, the fused kernel, the same write-out), or two for fp32 (the fresh
    buffer is y)."""
    M, d = x.shape
    f = w_first.shape[0]
    if M == 0 or d == 0 or f == 0:
        return torch.zeros(M, d, dtype=x.dtype, device=x.device), torch.zeros(0, dtype=torch.int32, device=x.device), max(M, 1)
    config = config or fused_config(M)
    if scratch is not None and M > scratch.acc.shape[0]:
        scratch = None
    NB = triton.cdiv(f, config[0])
    acc = scratch.acc if scratch is not None else torch.zeros(M, d, dtype=torch.float32, device=x.device)
    counts = torch.empty(NB, dtype=torch.int32, device=x.device)
    track = unit_counts is not None
    w_up_ = w_up if w_up is not None else w_first
    # the write-out (none for a fresh fp32 accumulator: it is y) as a programmatic dependent
    # launch of the kernel
    write_out = scratch is not None or x.dtype != torch.float32
    gdc = write_out and pdl_ok(x)
    args = (x, x.stride(0), w_first, w_first.stride(0), w_up_, w_up_.stride(0), w_down_t, w_down_t.stride(0),
            acc, counts, unit_counts if track else counts, row_nnz if track else counts, M, d, f)
    with on_device_of(x):
        if isinstance(config, GemvConfig):
            _decode_gemv_kernel[(NB,)](
                *args, BM=triton.next_power_of_2(M), BU=config.BU, BK=min(config.BK, max(16, triton.next_power_of_2(d))),
                GATED=w_up is not None, TRACK=track, GDC=gdc, num_warps=config.num_warps, num_stages=config.num_stages,
            )
        else:
            BU, BK, BD, nw, ns = config
            BM = max(16, triton.next_power_of_2(M))
            if x.element_size() == 4 and BM >= 32:
                ns = min(ns, 2)  # shared memory (see FUSED_CONFIGS)
            _decode_fused_kernel[(NB,)](
                *args,
                BM=BM, BU=BU, BK=min(BK, max(16, triton.next_power_of_2(d))), BD=min(BD, max(16, triton.next_power_of_2(d))),
                GATED=w_up is not None, TRACK=track, PREC=dot_precision(x), GDC=gdc,
                num_warps=nw, num_stages=ns,
            )
        if not write_out:
            return acc, counts, M
        try:
            y = launch_write_out(acc, M, x.dtype, gdc)
        except BaseException:
            if scratch is not None:
                acc.zero_()  # the kept accumulator holds this call's sums: never hand them to the next call
            raise
    return y, counts, M


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
    """The whole FFN of at most 64 tokens with one weight-reading kernel (see the module's text).

    Args:
        x: ``[M, d]`` tokens, ``M <= 64`` (fp16, bf16 or fp32; unit-stride rows).
        w_first: ``[f, d]`` gate (gated) or up (non-gated) rows; w_down_t: ``[f, d]``, row ``j`` =
            ``w_down[:, j]``; w_up: ``[f, d]`` for the gated MLP, None for the non-gated one.
        unit_counts: optional ``[f]`` int32, overwritten with the tokens each unit fired for;
            row_nnz: optional ``[M]`` int32 zeros, given the active units of each token (both
            or neither).
        config: ``(BU, BK, BD, num_warps, num_stages)`` for the tensor-core kernel, or a
            :class:`GemvConfig` for the CUDA-core one; None: :func:`fused_config`.
        scratch: a :class:`DecodeScratch` (zeroed accumulator kept between calls: one launch
            fewer; used up to its rows, a larger call makes a fresh buffer); None: a fresh
            buffer per call.

    Returns:
        ``y [M, d]`` in x's dtype.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    if M > FUSED_MAX_M:
        raise ValueError(f"the fused decode kernel takes at most {FUSED_MAX_M} tokens per call, got {M}")
    check_stat_buffers(x, unit_counts, row_nnz, f)
    if config is not None:
        check_config(config, GEMV_KNOBS if isinstance(config, GemvConfig) else FUSED_KNOBS)
    if scratch is not None and (scratch.acc.dim() != 2 or scratch.acc.shape[0] < SCRATCH_ROWS or scratch.acc.shape[1] != d
                                or scratch.acc.device != x.device):
        raise ValueError(f"scratch must be a DecodeScratch for d = {d} on {x.device}, got {list(scratch.acc.shape)} on {scratch.acc.device}")
    return decode_fused_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, config=config, scratch=scratch)[0]
